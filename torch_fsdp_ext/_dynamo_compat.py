"""Make Dynamo treat the vendored ``_fully_shard`` like torch's own.

Dynamo decides whether to trace a frame from its file path
(``torch._dynamo.trace_rules.check_file``). Upstream FSDP2 lives under
``torch/distributed``, which is on ``MOD_SKIPLIST``: when a compiled module's
``_call_impl`` runs an FSDP hook, Dynamo does not start a frame in the hook
and the hook runs eagerly (it is ``torch._dynamo.disable``-d anyway), so the
block compiles to one graph with no graph break. The vendored copy lives
under ``torch_fsdp_ext/``, which no rule names, so Dynamo starts tracing the
``_dynamo_disable`` wrapper of ``_pre_forward``/``_post_forward`` and counts
graph breaks there (4 per compiled block on the first step, 0 upstream).

torch has no public API to skip a third-party package's files.
``trace_rules.add`` (formerly ``torch._dynamo.skipfiles.add``) is the
private helper torch itself uses for its third-party skip list; its entries
survive ``torch._dynamo.reset()``. One difference from upstream remains:
``torch/distributed`` is also on ``MOD_INLINELIST``, so a call *into* FSDP
code from inside a compiled region is inlined upstream and skipped here.
The path-keyed inline list is cached per torch install and cleared on
``init_process_group``, so it cannot be extended robustly.

Other places where torch names upstream's FSDP2 directly need nothing:
pipelining and ``fsdp2_mem_tracker`` use ``isinstance(..., FSDPModule)``,
and ours subclasses torch's ``FSDPModule``.
"""

import torch._dynamo.trace_rules as _trace_rules


def _register_with_dynamo() -> None:
    _trace_rules.add(f"{__package__}._fully_shard")


_register_with_dynamo()
