"""FSDP's own time in a training step: the wall time spent inside FSDP2's hooks
(pre/post-forward, pre/post-backward and the root's final backward callback),
less the time spent inside the process group's collective calls and
``Work.wait`` made from them.

This is the host-side work that FSDP adds to a step (all-gather and
reduce-scatter setup, copies, casts, views, Python) and that runs ahead of an
accelerator; the model's own forward, backward and optimizer are not in it,
and neither is the process group, whose time depends on the process group
rather than on FSDP: torch's fake process group, for one, copies the input
into every rank's chunk of an all-gather output, per tensor. Both parts are
reported next to the step time, so the three can be compared.

The wrappers go on the classes, for torch's FSDP2 and the generated copy
alike, and must be installed before ``fully_shard`` registers its forward
hooks (it binds them then). Only the outermost hook call on a thread counts,
so a hook that runs another (the final callback runs post-backward) is
counted once.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as upstream_param_group
import torch.distributed.fsdp._fully_shard._fsdp_state as upstream_state

import torch_fsdp_ext._fully_shard._fsdp_param_group as ext_param_group
import torch_fsdp_ext._fully_shard._fsdp_state as ext_state

_HOOKS = {
    "FSDPState": (
        "_pre_forward",
        "_post_forward",
        "_pre_backward",
        "_root_post_backward_final_callback",
    ),
    "FSDPParamGroup": ("post_backward",),
}
# The collectives FSDP and its comms call on a ``ProcessGroup`` (c10d's
# Python API calls these too)
_PG_METHODS = (
    "_allgather_base",
    "_reduce_scatter_base",
    "all_gather_single",
    "all_gather_single_coalesced",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "all_to_all_single",
    "alltoall_base",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
)


class FSDPTimer:
    """Accumulates, per process, the seconds inside FSDP's hooks
    (:attr:`hooks_s`) and inside process-group calls made from them
    (:attr:`pg_s`); :meth:`fsdp_s` is their difference."""

    def __init__(self) -> None:
        self.hooks_s = 0.0
        self.pg_s = 0.0
        self._local = threading.local()
        self._installed = False

    def fsdp_s(self) -> float:
        return self.hooks_s - self.pg_s

    def install(self) -> None:
        """Wraps the hooks and process-group methods (once per process)."""
        if self._installed:
            return
        self._installed = True
        for module in (upstream_state, ext_state, upstream_param_group, ext_param_group):
            for cls_name, names in _HOOKS.items():
                cls = getattr(module, cls_name, None)
                for name in names if cls is not None else ():
                    if name in vars(cls):
                        setattr(cls, name, self._wrap(getattr(cls, name), "hooks_s"))
        for cls, names in ((dist.ProcessGroup, _PG_METHODS), (dist.Work, ("wait",))):
            for name in names:
                if hasattr(cls, name):
                    setattr(cls, name, self._wrap(getattr(cls, name), "pg_s"))

    def _wrap(self, fn: Callable[..., Any], counter: str) -> Callable[..., Any]:
        local = self._local

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, counter, 0)
            # Process-group time counts only inside FSDP's hooks, and only
            # the outermost call of either kind
            if depth or (counter == "pg_s" and not getattr(local, "hooks_s", 0)):
                return fn(*args, **kwargs)
            setattr(local, counter, 1)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)
                setattr(local, counter, 0)

        return wrapper


TIMER = FSDPTimer()
