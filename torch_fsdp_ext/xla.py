"""FSDP2 on torch_xla devices (``"xla"``).

:func:`register` makes ``fully_shard`` work on a mesh of device type
``"xla"``, per parameter by default; ``fully_shard`` calls it itself on its
first ``"xla"`` mesh. It registers:

- an FSDP backend for ``"xla"`` (:func:`torch_fsdp_ext.register_fsdp_backend`):
  per-parameter collectives by default, which need no copy-in or copy-out
  buffer and so no host round trip (docs/xla.md), issued together as one
  tuple-shaped all-gather or reduce-scatter per parameter group and dtype
  (:class:`XlaAllGather`, :class:`XlaReduceScatter`), on the tensors of their
  own that per-parameter FSDP hands a comm's ``foreach`` (an XLA tensor is a
  value, so a write into a slice of another is an update op of the whole), and a
  reduce without ``AVG`` (torch_xla's process group has none), so FSDP sums
  and divides;
- ``torch.nn.utils.clip_grad_norm_`` for DTensor gradients: importing
  torch_xla replaces it with a version that DTensor cannot run;
- in-place ops on ``"xla"`` DTensors (``torch.optim``'s steps on FSDP's
  sharded parameters) that reach the tensors their local tensor views: inside
  ``__torch_dispatch__`` torch excludes the functionalization key, so
  torch_xla's functional views miss the update of their base (docs/xla.md);
- a device module ``torch.xla`` (``torch._register_device_module``): FSDP asks
  the device for streams and events to order its collectives; a lazy
  tensor's graph already orders them, so these are no-ops;
- functionalization kernels for FSDP's ops with mutable list outputs
  (``split_with_sizes_copy``, ``chunk_cat``), which grouped collectives use
  and torch_xla's eager functionalization rejects;
- a chain from each tuple collective to the next, and from the gradient
  that reaches a module to the all-gather its backward needs
  (:func:`_chain_zero`): what torch_xla's token and its FSDP's
  optimization barriers do for its own collectives, so that XLA neither
  merges nor hoists a backward all-gather's inputs, which held every group's
  bf16 shards from the forward on (docs/xla.md, "Memory");
- freeing without storage resizing on ``"xla"``: FSDP frees an unsharded
  parameter by resizing its storage to 0, and an XLA tensor's storage cannot
  be resized, so the all-gather outputs and the unsharded parameters are
  pointed at a one-element placeholder and given values again by the next
  all-gather; a sharded parameter is a tensor of its own, not a
  view of its padded shard (an XLA view holds a copy), so a rank keeps only
  sharded state between steps, padded shards included (not with CPU
  offload, whose shards stay FSDP's; docs/xla.md, "Memory").

The mesh comes from :func:`mesh_from_group`, since ``init_device_mesh`` makes
no process groups for ``"xla"``. docs/xla.md lists
which of these are upstream bugs, each with a one-line repro.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import types
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _clip_grad
from ._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group, _fsdp_state
from ._fully_shard._fsdp_backend import FSDPBackend, register_fsdp_backend
from ._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

logger = logging.getLogger(__name__)

__all__ = ["mesh_from_group", "register", "XlaAllGather", "XlaReduceScatter", "XLA_BACKEND"]


def _buckets(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], cap_bytes: int | None
) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Consecutive (outputs, inputs) runs of one input dtype whose inputs hold
    at most ``cap_bytes`` (no cap if ``None``; a larger input gets a run of
    its own). One dtype a run: torch_xla 2.9's list all-gather aborts the
    process on mixed dtypes (docs/xla.md)."""
    if len(outputs) != len(inputs):
        raise ValueError(f"{len(outputs)} outputs for {len(inputs)} inputs")
    start, size = 0, 0
    for i, t in enumerate(inputs):
        nbytes = t.numel() * t.element_size()
        if i > start and (
            t.dtype != inputs[start].dtype or (cap_bytes is not None and size + nbytes > cap_bytes)
        ):
            yield outputs[start:i], inputs[start:i]
            start, size = i, 0
        size += nbytes
    if inputs:
        yield outputs[start:], inputs[start:]


def _copy_results(outputs: list[torch.Tensor], results: list[torch.Tensor]) -> None:
    # Not xm's ``output=`` forms: they set the outputs' XLA data directly,
    # past functionalization, so the tensors an output views (FSDP's outputs
    # are views: the unsharded parameters, the reduce-scatter buffer's
    # chunks) would never see it. A lazy ``copy_`` only rebinds the graph.
    for output, result in zip(outputs, results, strict=True):
        output.copy_(result.view(output.shape))


def _replica_groups(group: dist.ProcessGroup) -> list[list[int]] | None:
    # torch_xla's ProcessGroupXla keeps its replica groups in ``_mesh`` ([] for
    # the world), which its own collectives pass to xm as ``groups``; None
    # for another process group, whose collectives xm cannot issue
    return getattr(group, "_mesh", None)


# the comm classes that said why they go one by one (once each)
_warned: set[type] = set()


def _tuple_unsupported(group: dist.ProcessGroup, comm: object) -> bool:
    if _replica_groups(group) is not None:
        return False
    if comm.__class__ not in _warned:
        _warned.add(comm.__class__)
        logger.warning(
            "%s: %r is not torch_xla's process group, so its collectives cannot go "
            "out as one tuple collective; issuing them one per parameter",
            comm.__class__.__name__,
            group,
        )
    return True


# device -> a +0.0 (one element) that the last tuple collective on it
# gathered or reduced: see _chain_zero
_chain_zeros: dict[torch.device, torch.Tensor] = {}


def _zero_read_from(tensor: torch.Tensor) -> torch.Tensor:
    """+0.0 (fp32, one element) computed from ``tensor``'s first element, so
    that XLA cannot fold it to a constant nor compute it before ``tensor``.

    The element converted to an integer and clamped to [0, 0]: 0 whatever
    the element is (inf, NaN in AMP's skipped steps, -0.0), which XLA does
    not fold (it folds ``i - i`` and ``i & 0``), with no ``select`` (a
    ``where`` on the float was copied by XLA into every input the zero
    reaches: 95 more ``select`` ops a step). A constant for an empty
    ``tensor``.
    """
    if tensor.numel() == 0:  # nothing to read (an expert with no tokens)
        return torch.zeros(1, device=tensor.device)
    first = tensor.detach().reshape(-1)[:1].to(torch.int32)
    return first.clamp(0, 0).float()


def _chain_zero(like: torch.Tensor) -> torch.Tensor:
    """A +0.0 of ``like``'s dtype that the last tuple collective on its device
    computed, to chain the next one to it.

    torch_xla chains each collective to the one before it through a token
    added to its input, but its list collectives add it to their first input
    only. XLA then computes the others (a shard, or its cast to
    ``param_dtype``) as early as it likes: the backward's all-gather inputs
    of every group lived from the forward on (merged with the forward's by
    CSE where the expressions were the same), at the step's peak. Each tuple
    collective here carries this zero as its last input, and each all-gather
    input is ``x - zero`` (:func:`_chained`). XLA cannot fold a collective's
    result to a constant, and a gather or reduction of +0.0s is +0.0: the
    next zero is that result. Not the first input: torch_xla adds its token
    there, and a token made NaN by an earlier collective's result would then
    stay in the chain from step to step. :func:`_pre_backward` also chains
    it to the gradient that reaches a module.
    """
    zero = _chain_zeros.get(like.device)
    if zero is None:
        return torch.zeros(1, dtype=like.dtype, device=like.device)
    return zero.to(like.dtype)


def _chained(t: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    # x - (+0.0) is x bit for bit under IEEE arithmetic for every value but
    # NaN, which stays NaN (-0.0 included: x + 0.0 would make it +0.0); a
    # backend that flushes subnormals flushes them here as in its compute.
    # Not for other dtypes (bool, float8 have no such subtraction): those
    # inputs are ordered by the zero beside them, not held back by it
    return t - zero if t.is_floating_point() and t.element_size() > 1 else t


class XlaAllGather(DefaultAllGather):
    """All-gather comm for ``"xla"``: :meth:`foreach` gathers a parameter
    group's parameters with torch_xla's list all-gather, one tuple-shaped
    ``all-gather`` HLO per dtype and at most ``bucket_cap_bytes`` of inputs,
    with no concatenated copy-in (``tuple_collectives=False``: one per
    parameter). torch_xla chains every collective to the one before it
    through a token, so XLA's combiners cannot merge per-parameter all-gathers
    later; this issues them together instead. Each input is the parameter's
    own (cast) tensor, not a slice of its output: the in-place form costs XLA
    an update of the output per parameter, at an offset that differs by rank,
    so the ranks' programs would differ."""

    def __init__(self, bucket_cap_bytes: int | None = None, tuple_collectives: bool = True) -> None:
        self.bucket_cap_bytes = bucket_cap_bytes
        self.tuple_collectives = tuple_collectives

    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        if not self.tuple_collectives or _tuple_unsupported(group, self):
            return super().foreach(output_tensors, input_tensors, group, async_op)
        import torch_xla.core.xla_model as xm

        for outputs, inputs in _buckets(output_tensors, input_tensors, self.bucket_cap_bytes):
            zero = _chain_zero(inputs[0])
            # layout pinning is not supported for lists (torch_xla raises)
            results = xm.all_gather(
                [*(_chained(t, zero) for t in inputs), zero],
                dim=0,
                groups=_replica_groups(group),
                pin_layout=False,
            )
            _chain_zeros[zero.device] = results.pop()[:1]
            _copy_results(outputs, results)
        return None


class XlaReduceScatter(DefaultReduceScatter):
    """Reduce-scatter comm for ``"xla"``: :meth:`foreach` reduce-scatters a
    parameter group's gradients with torch_xla's list reduce-scatter, one
    tuple-shaped ``reduce-scatter`` HLO per dtype and at most
    ``bucket_cap_bytes`` of inputs (``tuple_collectives=False``: one per
    parameter), straight from the gradients into outputs of their own: a
    write into a view of one buffer costs XLA a ``pad`` and ``select`` of the
    whole buffer per parameter (docs/xla.md)."""

    def __init__(self, bucket_cap_bytes: int | None = None, tuple_collectives: bool = True) -> None:
        self.bucket_cap_bytes = bucket_cap_bytes
        self.tuple_collectives = tuple_collectives

    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        if not self.tuple_collectives or _tuple_unsupported(group, self):
            return super().foreach(output_tensors, input_tensors, group, op, async_op)
        import torch_xla.core.xla_model as xm

        # ProcessGroupXla's own mapping: it raises for ops XLA has not (AVG)
        reduce_type = group._get_reduce_type(op)  # type: ignore[attr-defined]
        groups = _replica_groups(group)
        shard_count = len(groups[0]) if groups else group.size()
        for outputs, inputs in _buckets(output_tensors, input_tensors, self.bucket_cap_bytes):
            # the chain's zero rides along last (see _chain_zero)
            zero = _chain_zero(inputs[0])
            results = xm.reduce_scatter(
                reduce_type,
                [*(t.view(-1) for t in inputs), zero.expand(shard_count)],
                scale=1.0,
                scatter_dim=0,
                shard_count=shard_count,
                groups=groups,
                pin_layout=False,
            )
            _chain_zeros[zero.device] = results.pop()
            _copy_results(outputs, results)
        return None


#: What :func:`register` registers for ``"xla"``
XLA_BACKEND = FSDPBackend(
    group_collectives=False,
    all_gather_comm=XlaAllGather,
    reduce_scatter_comm=XlaReduceScatter,
    # XLA's reduce-scatter has neither AVG nor PREMUL_SUM: FSDP sums and divides
    force_sum_reduction_for_comms=True,
)


class _Event:
    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Stream:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _device_module() -> types.ModuleType:
    import torch_xla
    import torch_xla.runtime as xr

    stream = _Stream()

    @contextlib.contextmanager
    def use_stream(s: object) -> Iterator[None]:
        yield

    module = types.ModuleType("torch.xla", "torch_fsdp_ext's FSDP view of torch_xla")
    module.__dict__.update(
        Stream=_Stream,
        Event=lambda *args, **kwargs: _Event(),
        stream=use_stream,
        current_stream=lambda device=None: stream,
        default_stream=lambda device=None: stream,
        synchronize=lambda device=None: None,
        current_device=lambda: torch_xla.device().index,
        device_count=xr.addressable_device_count,
        is_available=lambda: True,
        set_device=lambda device: None,
    )
    return module


def _split_with_sizes_copy(
    all_gather_output: torch.Tensor,
    all_gather_input_split_sizes: list[int],
    dim: int = 0,
    *,
    out: list[torch.Tensor],
) -> None:
    with torch.no_grad():
        for dst, src in zip(
            out, torch.split(all_gather_output, all_gather_input_split_sizes, dim=dim), strict=True
        ):
            dst.copy_(src)


def _chunk_cat(
    tensors: list[torch.Tensor], dim: int, num_chunks: int, *, out: torch.Tensor
) -> None:
    # Not torch._chunk_cat: torch_xla 2.9's lowering returns zeros for a
    # tensor whose dim 0 needs padding (docs/xla.md), so pad, split into
    # ``num_chunks`` rows and concatenate the rows, as _chunk_cat specifies
    if dim != 0:
        raise NotImplementedError(f"chunk_cat on xla: dim {dim}, FSDP uses 0")
    rows = []
    for t in tensors:
        padded = torch.nn.functional.pad(
            t.reshape(t.size(0), -1), (0, 0, 0, -t.size(0) % num_chunks)
        )
        rows.append(padded.reshape(num_chunks, -1))
    with torch.no_grad():
        out.copy_(torch.cat(rows, dim=1).view(out.shape))


_ORIGINAL_STORAGE_FNS = (_fsdp_param.alloc_storage, _fsdp_param.free_storage)
_ORIGINAL_PARAM_METHODS = (
    _fsdp_param.FSDPParam.init_unsharded_param,
    _fsdp_param.FSDPParam.free_unsharded_param,
)

# An ``xla`` tensor has no resizable storage: it is a handle to device data
# (or to the pending graph that computes it). Freeing it means pointing it at
# a one-element placeholder, so that its device data has no holder left and
# XLA releases it (as torch_xla's own FSDP frees its full parameters), and
# allocating means giving it a value of its size again, which the all-gather
# then overwrites. ``_FREED_SIZE`` is the attribute that keeps the size of a
# freed tensor (its shape is the placeholder's until then).
_FREED_SIZE = "_fsdp_ext_xla_freed_size"
_placeholders: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    key = (tensor.device, tensor.dtype)
    if key not in _placeholders:
        _placeholders[key] = torch.zeros(1, dtype=tensor.dtype, device=tensor.device)
    return _placeholders[key]


def _replace_data(tensor: torch.Tensor, data: torch.Tensor) -> None:
    import torch_xla

    # not a write autograd must see: FSDP's unsharded parameters are saved
    # for backward, and it gives them their data again before backward reads
    # it (torch.autograd._unsafe_preserve_version_counter's two calls, without
    # its context manager: this runs three times per parameter per reshard)
    version = tensor._version
    with torch.no_grad():
        torch_xla._XLAC._replace_xla_tensor(tensor, data)
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


def _xla_free(tensor: torch.Tensor) -> None:
    if getattr(tensor, _FREED_SIZE, None) is None:
        setattr(tensor, _FREED_SIZE, tensor.size())
        _replace_data(tensor, _placeholder(tensor))


def _xla_alloc(tensor: torch.Tensor) -> None:
    size = getattr(tensor, _FREED_SIZE, None)
    if size is not None:
        setattr(tensor, _FREED_SIZE, None)
        _replace_data(tensor, torch.empty(size, dtype=tensor.dtype, device=tensor.device))


def _alloc_storage(tensor: torch.Tensor) -> None:
    if tensor.device.type == "xla":
        _xla_alloc(tensor)
    else:
        _ORIGINAL_STORAGE_FNS[0](tensor)


def _free_storage(tensor: torch.Tensor) -> None:
    if tensor.device.type == "xla":
        _xla_free(tensor)
    else:
        _ORIGINAL_STORAGE_FNS[1](tensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _free_unsharded_param(self, *args, **kwargs) -> None:
    """``FSDPParam.free_unsharded_param``, which on ``xla`` also frees the
    unsharded parameter itself and the all-gather outputs at once.

    On a device with storage, the unsharded parameter is a view of the
    all-gather output's storage, so freeing the output frees both. An ``xla``
    view holds a value of its own (the all-gather's result, viewed), which
    freeing the output leaves alive. FSDP may defer freeing the outputs to a
    later all-gather (for CUDA's streams); a lazy graph needs no such
    ordering, and a deferred output would stay alive between steps.
    """
    _ORIGINAL_PARAM_METHODS[1](self, *args, **kwargs)
    if self.device.type != "xla":
        return
    for tensor in self.all_gather_outputs:
        _xla_free(tensor)
    if hasattr(self, "_unsharded_param"):
        _xla_free(_local(self._unsharded_param))


def _init_unsharded_param(self) -> None:
    """``FSDPParam.init_unsharded_param``, which on ``xla`` brings a freed
    unsharded parameter back: after the all-gather wrote its output, the
    parameter (a view of it) takes its value from the output again, and so
    its size (a freed tensor has the placeholder's)."""
    _ORIGINAL_PARAM_METHODS[0](self)
    if self.device.type != "xla":
        return
    param = _local(self._unsharded_param)
    if getattr(param, _FREED_SIZE, None) is not None:
        setattr(param, _FREED_SIZE, None)
        torch._functionalize_sync(param)


_ORIGINAL_BACKWARD_PREFETCH = _fsdp_param_group.FSDPParamGroup._backward_prefetch


def _backward_prefetch(self) -> None:
    """``FSDPParamGroup._backward_prefetch``, which on ``xla`` prefetches
    nothing (explicit ``set_modules_to_backward_prefetch`` still does).

    A lazy step is one graph, whose collectives torch_xla chains through a
    token in the order they were traced. The implicit prefetch traces the
    next group's all-gather before this group's reduce-scatter, which lets
    XLA's scheduler gather it before this group's backward runs: two groups'
    unsharded parameters live at once, at the step's peak (the activations'
    too). Without it, the next all-gather is chained after this group's
    reduce-scatter, so after this group's backward, as torch_xla's own FSDP
    orders it (with optimization barriers); the finalize step clears the
    indices the prefetch would have popped.
    """
    if self.device.type == "xla":
        return
    _ORIGINAL_BACKWARD_PREFETCH(self)


_ORIGINAL_PRE_BACKWARD = _fsdp_state.FSDPState._pre_backward


def _param_groups(state) -> list:
    # torch 2.15 keeps a list (per-parameter meshes); earlier bases one group
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    return groups


def _gathers_through_the_chain(group) -> bool:
    comm = group._all_gather_comm
    return (
        not group.group_collectives
        and not group.is_unsharded
        and isinstance(comm, XlaAllGather)
        and comm.tuple_collectives
    )


def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
    """``FSDPState._pre_backward``, which on ``xla`` first chains the next
    collective (:func:`_chain_zero`) to the gradient that reached the module,
    where one of its groups (or one it prefetches) will all-gather through
    the tuple comms.

    Backward's first collective of a group is its all-gather, whose inputs
    are the group's shards: without this, XLA may gather them as soon as the
    collective before it is done, while the backward of the modules after
    this one still holds their own parameters and activations (the output
    projection at the backward's start). torch_xla's own FSDP ties them with
    an optimization barrier on the gradient and the shards, which XLA:CPU
    removes; a data dependency holds on every XLA backend. Where no
    all-gather follows, the gradient's buffer would only stay live until the
    next collective.
    """
    if grad.device.type == "xla" and any(
        _gathers_through_the_chain(group)
        for state in (self, *self._states_to_backward_prefetch)
        for group in _param_groups(state)
    ):
        zero = _zero_read_from(_local(grad))
        _chain_zeros[grad.device] = _chain_zero(zero) + zero
    return _ORIGINAL_PRE_BACKWARD(self, grad)


_ORIGINAL_INIT_SHARDED = (
    _fsdp_param.FSDPParam._init_sharded_param,
    _fsdp_param.FSDPParam.reset_sharded_param,
)
_SHARDED_DATA = "_sharded_param_data"
# marks a sharded parameter's local tensor that _own_shard made
_OWN_SHARD = "_fsdp_ext_xla_own_shard"


def _own_shard(fsdp_param) -> None:
    """On ``xla``, makes a sharded parameter's local tensor a tensor of its
    own instead of a view of its padded shard.

    An ``xla`` view holds a value of its own: FSDP's sharded parameter (a
    view of its padded shard) and the flat ``_sharded_param_data`` (another
    view, the all-gather's input) each kept a shard-sized buffer, and after
    the optimizer wrote the parameter the padded shard still held the old
    value: a second copy of every shard between steps. So the local tensor
    is a tensor of its own, and the padded flat input is made where FSDP
    reads it (:func:`_sharded_param_data`: a view of the local tensor, or,
    for a shard that is shorter than the padded size on dim 0, the local
    tensor padded with zeros), dropped after the step's graph is built.
    """
    local = fsdp_param.sharded_param._local_tensor
    if local.device.type != "xla" or fsdp_param.offload_to_cpu:
        return
    if not getattr(local, _OWN_SHARD, False):
        # Not ``local._base``: ``nn.Parameter`` detaches FSDP's narrow of the
        # padded shard, and a detached view has no ``_base`` but is still a
        # view under functionalization: each optimizer step then wrote the
        # padded shard through ``slice_scatter`` and read the parameter back
        # with a ``slice``, which kept the previous step's shard alive as an
        # input of the next step's graph (an unused one: the update covers it)
        local = local.detach().clone()
        setattr(local, _OWN_SHARD, True)
        fsdp_param.sharded_param._local_tensor = local
    fsdp_param.__dict__.pop(_SHARDED_DATA, None)


def _init_sharded_param(self, *args, **kwargs):
    _ORIGINAL_INIT_SHARDED[0](self, *args, **kwargs)
    _own_shard(self)


def _reset_sharded_param(self, *args, **kwargs):
    _ORIGINAL_INIT_SHARDED[1](self, *args, **kwargs)
    _own_shard(self)


def _get_sharded_param_data(self) -> torch.Tensor:
    data = self.__dict__.get(_SHARDED_DATA)
    if data is not None:
        return data
    # an own shard on xla: a fresh flat view of it, padded on dim 0 (the only
    # dim FSDP shards unevenly) to the padded size, as FSDP's padded shard is
    local = self.sharded_param._local_tensor
    padding = self.padded_sharded_param_size[0] - local.size(0)
    if padding:
        local = torch.nn.functional.pad(local, [0, 0] * (local.dim() - 1) + [0, padding])
    return local.view(-1)


def _set_sharded_param_data(self, value: torch.Tensor) -> None:
    self.__dict__[_SHARDED_DATA] = value


#: ``FSDPParam._sharded_param_data`` on ``xla``: see :func:`_own_shard`
_sharded_param_data = property(_get_sharded_param_data, _set_sharded_param_data)


def mesh_from_group(group: dist.ProcessGroup | None = None) -> DeviceMesh:
    """A 1-D ``"xla"`` mesh over ``group`` (default: the world) for
    ``fully_shard(..., mesh=...)``.

    ``init_device_mesh("xla", ...)`` leaves out the process groups (torch_xla
    SPMD's meshes need none), and ``DeviceMesh.from_group`` then leaves out
    this rank's coordinate, which DTensor reads to decide whether the rank
    takes part in an op.
    """
    group = group if group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, "xla")
    if getattr(mesh, "_coordinate_on_dim", None) is None:
        mesh._coordinate_on_dim = [dist.get_rank(group)]
    return mesh


def _commit_xla_inplace_updates(dispatch):
    """Wraps DTensor's op dispatch so that an in-place op on an ``"xla"``
    DTensor commits its local tensor's new value to the tensors it views.

    torch runs ``__torch_dispatch__`` with the functionalization key excluded,
    so an in-place op on the local tensor of a DTensor skips the
    functionalization kernel that records the update on the shared storage:
    the local tensor changes, its base and every other view of it do not.
    FSDP's sharded parameters are views of their padded shards, which the
    all-gathers read, so ``torch.optim``'s steps were lost (docs/xla.md).
    """

    # op -> (position, name) of each argument its schema writes: read once
    # per op, not on each of the optimizer's hundreds of dispatches a step
    written: dict[torch._ops.OpOverload, tuple[tuple[int, str], ...]] = {}

    def dispatch_and_commit(op_call, args, kwargs):
        result = dispatch(op_call, args, kwargs)
        targets = written.get(op_call)
        if targets is None:
            targets = written[op_call] = tuple(
                (i, arg.name)
                for i, arg in enumerate(op_call._schema.arguments)
                if arg.alias_info is not None and arg.alias_info.is_write
            )
        for i, name in targets:
            value = args[i] if i < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if (
                    isinstance(t, DTensor)
                    and t.device.type == "xla"
                    and torch._is_functional_tensor(t._local_tensor)
                ):
                    torch._functionalize_commit_update(t._local_tensor)
        return result

    dispatch_and_commit.__wrapped__ = dispatch  # type: ignore[attr-defined]
    return dispatch_and_commit


def _mesh_from_tensor(mesh: torch.Tensor) -> DeviceMesh:
    """An ``"xla"`` mesh over the ranks of ``mesh``, a process group per dim.

    ``DeviceMesh("xla", mesh)`` makes no process groups, and FSDP builds one
    for ``reshard_after_forward=<int>`` (the 2-D post-forward mesh); the
    generated copy calls this instead on ``"xla"``.
    """
    rank = dist.get_rank()
    groups = []
    for dim in range(mesh.ndim):
        replica_groups = mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist()
        # c10d: every rank creates every group, in the same order
        own = None
        for ranks in replica_groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                own = group
        # An XLA collective's replica groups partition every replica (the
        # HLO verifier rejects {{0, 1}} at 4 replicas); torch_xla's process
        # group passes its ``_mesh`` as those groups
        own._mesh = replica_groups  # type: ignore[union-attr]
        groups.append(own)
    names = tuple(f"dim{i}" for i in range(mesh.ndim))
    device_mesh = DeviceMesh.from_group(groups, "xla", mesh=mesh, mesh_dim_names=names)
    if getattr(device_mesh, "_coordinate_on_dim", None) is None:
        # as in mesh_from_group: DTensor reads this rank's coordinate
        device_mesh._coordinate_on_dim = [int(i) for i in (mesh == rank).nonzero()[0]]
    return device_mesh


def _install_clip_grad_norm() -> None:
    """Makes ``torch.nn.utils.clip_grad_norm_`` clip DTensor gradients again.

    Importing torch_xla replaces it (``torch_xla/_patched_functions.py``) with
    a version that stacks ``torch.norm`` of each gradient, which DTensor has
    no sharding rule for, so ``clip_grad_norm_(model.parameters(), 1.0)``
    failed on an ``"xla"`` mesh. Now a call with any DTensor gradient goes to
    :func:`torch_fsdp_ext.clip_grad_norm_`, any other to the version it
    replaces, with the same arguments; both have torch's signature, which
    the wrapper reports (``functools.wraps``).
    """
    replaced = torch.nn.utils.clip_grad_norm_

    @functools.wraps(replaced)
    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor], *args: object, **kwargs: object
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        clip = replaced
        if any(isinstance(p.grad, DTensor) for p in params):
            clip = _clip_grad.clip_grad_norm_
        return clip(params, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


_registered = False
# ranks run as threads in one process (torch_xla's PJRT CPU test bed) each
# reach fully_shard's first registration
_register_lock = threading.Lock()


def register(*, tuple_collectives: bool = True, bucket_cap_bytes: int | None = None) -> None:
    """Make ``fully_shard`` run on ``"xla"`` devices; see the module
    docstring. ``fully_shard`` calls it on its first ``"xla"`` mesh; call it
    yourself to choose the collectives, before ``fully_shard``:

    - ``tuple_collectives=True`` (default): a parameter group's per-parameter
      collectives go out as one tuple-shaped collective per dtype, each of at
      most ``bucket_cap_bytes`` of inputs (``None``: no cap);
    - ``False``: one collective per parameter.

    A later call with other arguments re-registers the backend, for
    ``fully_shard`` calls made afterwards. Raises ``ImportError`` without
    torch_xla.
    """
    with _register_lock:
        _register(tuple_collectives, bucket_cap_bytes)


def _register(tuple_collectives: bool, bucket_cap_bytes: int | None) -> None:
    global _registered
    backend = XLA_BACKEND
    if tuple_collectives and bucket_cap_bytes is not None:
        backend = dataclasses.replace(
            XLA_BACKEND,
            all_gather_comm=lambda: XlaAllGather(bucket_cap_bytes),
            reduce_scatter_comm=lambda: XlaReduceScatter(bucket_cap_bytes),
        )
    elif bucket_cap_bytes is not None:
        raise ValueError("bucket_cap_bytes applies to tuple_collectives=True only")
    elif not tuple_collectives:
        backend = dataclasses.replace(
            XLA_BACKEND,
            all_gather_comm=lambda: XlaAllGather(tuple_collectives=False),
            reduce_scatter_comm=lambda: XlaReduceScatter(tuple_collectives=False),
        )
    if _registered:
        register_fsdp_backend("xla", backend, override=True)
        return
    try:
        import torch_xla  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"torch_fsdp_ext.xla needs torch_xla ({e}). Fix: pip install "
            f"torch-xla=={torch.__version__.split('+')[0]} (torch-xla releases "
            "match torch's; bash tools/xla_check.sh sets up torch 2.9.0 with it)"
        ) from None

    if not hasattr(torch, "xla"):
        torch._register_device_module("xla", _device_module())
    lib = _fsdp_collectives.lib
    for name, kernel in (
        ("split_with_sizes_copy", _split_with_sizes_copy),
        ("chunk_cat", _chunk_cat),
    ):
        if hasattr(getattr(torch.ops, lib.ns), name):
            lib.impl(name, kernel, "Functionalize")
    for module in (_fsdp_param, _fsdp_param_group):
        if hasattr(module, "alloc_storage"):
            module.alloc_storage = _alloc_storage
        if hasattr(module, "free_storage"):
            module.free_storage = _free_storage
    _fsdp_param.FSDPParam.free_unsharded_param = _free_unsharded_param
    _fsdp_param.FSDPParam.init_unsharded_param = _init_unsharded_param
    _fsdp_param.FSDPParam._init_sharded_param = _init_sharded_param
    _fsdp_param.FSDPParam.reset_sharded_param = _reset_sharded_param
    _fsdp_param.FSDPParam._sharded_param_data = _sharded_param_data
    _fsdp_param_group.FSDPParamGroup._backward_prefetch = _backward_prefetch
    _fsdp_state.FSDPState._pre_backward = _pre_backward
    dispatcher = DTensor._op_dispatcher
    if not hasattr(dispatcher.dispatch, "__wrapped__"):
        dispatcher.dispatch = _commit_xla_inplace_updates(dispatcher.dispatch)
    _install_clip_grad_norm()
    register_fsdp_backend("xla", backend, override=True)
    _registered = True


def _ensure_registered() -> None:
    # The generated copy calls this before FSDP asks an "xla" mesh's device
    # for its handle (the device module above), keeping an earlier explicit
    # register(...)'s choice
    if not _registered:
        register()
