"""Make torch's own code treat the vendored ``_fully_shard`` like upstream's.

torch recognises FSDP2 in three ways. ``isinstance(..., FSDPModule)``
(pipelining, ``fsdp2_mem_tracker``, Dynamo's guards) already holds, since our
``FSDPModule`` subclasses torch's. The other two key on upstream's identity and
are bridged here, each through the smallest hook torch offers. Both are
private torch helpers (no public API exists for either); drop each once the
upstream change named in its comment lands.
"""

import torch._dynamo.trace_rules as _trace_rules
import torch.distributed.fsdp as _upstream_fsdp

from ._fully_shard import FSDPModule


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


_register_with_dynamo()
_register_with_pipelining()
