"""FSDP2 on torch_xla devices (``"xla"``).

:func:`register` is what a training script, or torch_xla itself, calls once
after ``import torch_xla``; then ``fully_shard`` works on a mesh of device
type ``"xla"``, per parameter by default. It registers:

- an FSDP backend for ``"xla"`` (:func:`torch_fsdp_ext.register_fsdp_backend`):
  per-parameter collectives by default, which need no copy-in or copy-out
  buffer and so no host round trip (docs/xla.md), and a reduce without
  ``AVG`` (torch_xla's process group has none), so FSDP sums and divides;
- a device module ``torch.xla`` (``torch._register_device_module``): FSDP asks
  the device for streams and events to order its collectives; a lazy
  tensor's graph already orders them, so these are no-ops;
- functionalization kernels for FSDP's ops with mutable list outputs
  (``split_with_sizes_copy``, ``chunk_cat``), which grouped collectives use
  and torch_xla's eager functionalization rejects;
- no-op storage resizing for ``"xla"`` tensors: FSDP frees an unsharded
  parameter by resizing its storage to 0, and an XLA tensor's storage cannot
  be resized; XLA frees device memory when the graph no longer needs it.

The mesh comes from :func:`mesh_from_group`, since ``init_device_mesh`` makes
no process groups for ``"xla"``. docs/xla.md lists which of these are upstream
bugs, each with a one-line repro.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group
from ._fully_shard._fsdp_backend import FSDPBackend, register_fsdp_backend

__all__ = ["mesh_from_group", "register", "XLA_BACKEND"]

#: What :func:`register` registers for ``"xla"``
XLA_BACKEND = FSDPBackend(
    group_collectives=False,
    supports_avg=False,
    supports_premul_sum=False,
    supports_coalescing=False,
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


def _alloc_storage(tensor: torch.Tensor) -> None:
    if tensor.device.type != "xla":
        _ORIGINAL_STORAGE_FNS[0](tensor)


def _free_storage(tensor: torch.Tensor) -> None:
    if tensor.device.type != "xla":
        _ORIGINAL_STORAGE_FNS[1](tensor)


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


_registered = False


def register() -> None:
    """Make ``fully_shard`` run on ``"xla"`` devices (idempotent); see the
    module docstring. Raises ``ImportError`` without torch_xla."""
    global _registered
    if _registered:
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
    register_fsdp_backend("xla", XLA_BACKEND, override=True)
    _registered = True


def _register_if_loaded() -> None:
    # The entry point (pyproject.toml, group torch_fsdp_ext.backends): FSDP
    # calls it at its first backend lookup. Importing torch_xla there would
    # start its runtime in every process, so register only where the script
    # already imported it
    if "torch_xla" in sys.modules:
        register()
