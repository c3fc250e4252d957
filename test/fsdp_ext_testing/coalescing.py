"""How a group's per-parameter collectives go out, chosen by the comm.

FSDP's default comms issue a group's pairs as one coalesced c10d op only where
the process group's c10d backend reports ``supports_coalescing`` (NCCL, XCCL),
so on gloo and the fake process group they go one by one. The tests, the
benchmark and the probes choose with these comms instead, registered as a
device type's defaults (:data:`COALESCED`, :data:`ONE_BY_ONE`):

- :class:`CoalescedAllGather` / :class:`CoalescedReduceScatter` coalesce on any
  process group. Synchronously, since several of gloo's coalesced works in
  flight corrupted the heap (docs/upstream-gloo-coalesced-heap-corruption.md),
  and one by one for a group of several dtypes, for which gloo's coalesced
  all-gather writes wrong values (tools/probes/repro_gloo_coalesced_dtypes.py).
- :class:`OneByOneAllGather` / :class:`OneByOneReduceScatter` issue one c10d
  collective per pair, also where the process group coalesces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_fsdp_ext import FSDPBackend
from torch_fsdp_ext._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter


def _each_pair(
    comm: Callable[..., Any],
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: dist.ProcessGroup,
    *args: Any,
) -> None:
    # FSDP's own tensors, straight to ``__call__`` (the default comms' memory)
    for output_tensor, input_tensor in zip(output_tensors, input_tensors, strict=True):
        comm(output_tensor, input_tensor, group, *args)


def _coalesced(
    comm: Callable[..., Any],
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: dist.ProcessGroup,
    *args: Any,
) -> None:
    if len({t.dtype for t in input_tensors}) > 1:
        _each_pair(comm, output_tensors, input_tensors, group, *args)
        return
    with dist.distributed_c10d._coalescing_manager(group):
        _each_pair(comm, output_tensors, input_tensors, group, *args)


class CoalescedAllGather(DefaultAllGather):
    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        _coalesced(self, output_tensors, input_tensors, group)


class CoalescedReduceScatter(DefaultReduceScatter):
    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        _coalesced(self, output_tensors, input_tensors, group, op)


class OneByOneAllGather(DefaultAllGather):
    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        _each_pair(self, output_tensors, input_tensors, group)


class OneByOneReduceScatter(DefaultReduceScatter):
    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        _each_pair(self, output_tensors, input_tensors, group, op)


COALESCED = FSDPBackend(
    all_gather_comm=CoalescedAllGather, reduce_scatter_comm=CoalescedReduceScatter
)
ONE_BY_ONE = FSDPBackend(
    all_gather_comm=OneByOneAllGather, reduce_scatter_comm=OneByOneReduceScatter
)
