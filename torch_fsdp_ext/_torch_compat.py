"""Make torch's own code treat the vendored ``_fully_shard`` like upstream's.

torch recognises FSDP2 in three ways. ``isinstance(..., FSDPModule)``
(pipelining, ``fsdp2_mem_tracker``, Dynamo's guards) already holds, since our
``FSDPModule`` subclasses torch's. The other two key on upstream's identity and
are bridged here, each through the smallest hook torch offers. Last, each
``fully_shard`` is made to refuse a model that the other already shards in
part. All are private torch helpers (no public API exists for any); drop each
bridge once the upstream change named in its comment lands. Nothing here
depends on the environment; the hooks, and the tests that fail if one stops
working:

- ``torch._dynamo.trace_rules.add``: :func:`_register_with_dynamo`
  (``test/package/test_interop_compile.py``, graph breaks equal to upstream's);
- ``torch.distributed.fsdp.fully_shard.state``: :func:`_register_with_pipelining`
  (``test/package/test_interop_pipelining_memtracker.py``, ``REDUCE_GRAD``);
- ``_get_managed_modules`` of both ``fully_shard`` (in ``_fsdp_init``, or
  in ``_fully_shard`` on torch 2.9) and
  ``torch.distributed._composable_state._get_module_state``:
  :func:`_forbid_mixing_with_upstream` (``test/package/test_mixing.py``).
"""

import functools
import importlib

import torch._dynamo.trace_rules as _trace_rules
import torch.distributed.fsdp as _upstream_fsdp
import torch.distributed.fsdp._fully_shard._fsdp_init as _upstream_init
import torch.distributed.fsdp._fully_shard._fsdp_state as _upstream_state
from torch.distributed._composable_state import _get_module_state

from ._fully_shard import FSDPModule
from ._fully_shard import _fsdp_init as _ext_init
from ._fully_shard import _fsdp_state as _ext_state

_upstream_fully_shard = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
_ext_fully_shard = importlib.import_module(f"{__package__}._fully_shard._fully_shard")


def _register_with_dynamo() -> None:
    # Dynamo decides whether to trace a frame from its file path
    # (``trace_rules.check_file``). Upstream FSDP2 lives under
    # ``torch/distributed``, on ``MOD_SKIPLIST``: when a compiled block's
    # ``_call_impl`` runs an FSDP hook, Dynamo starts no frame in the hook, which
    # runs eagerly, and the block compiles to one graph with no break. No rule
    # names ``torch_fsdp_ext/``, so Dynamo traced the ``_dynamo_disable``
    # wrappers of ``_pre_forward``/``_post_forward`` instead and broke the graph
    # there (4 breaks per compiled 2-block model, 0 upstream).
    # ``trace_rules.add`` (formerly ``torch._dynamo.skipfiles.add``) is what torch
    # uses for its own third-party skip list, and survives ``torch._dynamo.reset()``.
    # One difference remains: ``torch/distributed`` is also on ``MOD_INLINELIST``,
    # so a call *into* FSDP code from inside a compiled region is inlined upstream
    # and skipped (a graph break) here. That list is path-keyed under torch's
    # install and its cache is cleared by ``init_process_group``, so it cannot be
    # extended robustly.
    _trace_rules.add(f"{__package__}._fully_shard")


def _register_with_pipelining() -> None:
    # ``torch.distributed.pipelining.stage`` runs FSDP's post-backward by hand
    # (``REDUCE_GRAD``) through ``fully_shard.state(module)``, which looks the
    # state up under upstream ``fully_shard``'s own key and so returns None for
    # our modules ("'NoneType' object has no attribute '_state_ctx'"). Fall back
    # to the module's own state for our modules; upstream lookups are unchanged.
    # Upstream fix: use ``module._get_fsdp_state()`` in ``perform_reduce_grad``.
    upstream_state = _upstream_fsdp.fully_shard.state
    if getattr(upstream_state, "_torch_fsdp_ext_fallback", False):
        return

    def state(module):
        fsdp_state = upstream_state(module)
        if fsdp_state is None and isinstance(module, FSDPModule):
            return module._get_fsdp_state()
        return fsdp_state

    state._torch_fsdp_ext_fallback = True
    _upstream_fsdp.fully_shard.state = state


def _forbid_mixing_with_upstream() -> None:
    # Each FSDP2 finds the modules it manages by skipping submodules that hold
    # a state of its own class. To either one, a submodule sharded by the other
    # looks unsharded: its DTensor parameters are taken for tensor-parallel
    # ones, and the model fails later and obscurely ("Cannot concatenate
    # overlapping meshes" in fully_shard, or "Invariant encountered: value was
    # None" at the first forward). Fail in fully_shard instead, naming both.
    # The hook is the managed-module lookup both ``fully_shard`` use; no
    # public one exists. torch 2.9's ``fully_shard`` calls the name it imports
    # into ``_fully_shard``; later releases call it inside ``_fsdp_init``.
    upstream_name, ext_name = "torch.distributed.fsdp.fully_shard", "torch_fsdp_ext.fully_shard"
    for fully_shard_module, init, name, other_state_cls, other_name in (
        (_upstream_fully_shard, _upstream_init, upstream_name, _ext_state.FSDPState, ext_name),
        (_ext_fully_shard, _ext_init, ext_name, _upstream_state.FSDPState, upstream_name),
    ):
        owner = fully_shard_module if hasattr(fully_shard_module, "_get_managed_modules") else init
        get_managed_modules = owner._get_managed_modules
        if getattr(get_managed_modules, "_torch_fsdp_ext_checked", False):
            continue

        @functools.wraps(get_managed_modules)
        def checked(
            root_modules,
            *args,
            _get=get_managed_modules,
            _name=name,
            _other_state_cls=other_state_cls,
            _other_name=other_name,
            **kwargs,
        ):
            # ``get_state_fn`` (torch 2.14 on, 4th argument) is None for
            # fully_shard's own lookup (not replicate's)
            get_state_fn = kwargs.get("get_state_fn", args[2] if len(args) > 2 else None)
            if get_state_fn is None:
                for root in root_modules:
                    for fqn, module in root.named_modules():
                        if isinstance(_get_module_state(module), _other_state_cls):
                            raise ValueError(
                                f"{_name} cannot shard a model in which {_other_name} "
                                f"already shards '{fqn}': they are separate FSDP2 "
                                "implementations and neither manages the other's "
                                "modules. Use one of them for the whole model "
                                f"({ext_name} with group_collectives=True behaves "
                                f"as {upstream_name})."
                            )
            return _get(root_modules, *args, **kwargs)

        checked._torch_fsdp_ext_checked = True
        owner._get_managed_modules = checked


_register_with_dynamo()
_register_with_pipelining()
_forbid_mixing_with_upstream()
