#!/usr/bin/env python3
"""Show that the profiler's CPU memory total keeps blocks that gloo's worker
threads free (the cause of a reported 1.27x per-param backward peak on small
many-block models).

Two CPU ranks on gloo. Under ``torch.profiler.profile(profile_memory=True)``,
each rank reduce-scatters ``--collectives`` tensors of 128 B to 8 KiB, one
after another; gloo clones every input into a temporary, freed by the caller
or, when it drops the last reference, by one of gloo's worker threads. Every
collective's tensors are freed by the end, so the profiler's running total
(``total_allocated`` of its last allocation event, which frees its own
allocation) should end where it started. c10's CPU allocator
(``ProfiledCPUMemoryReporter``) updates that total only on threads the
profiler follows, so each clone that a worker thread frees stays in it.

Rank 0 prints, per run, the final total above the starting one with the
profiler alone and with
``fsdp_ext_testing.memory.count_cpu_frees_on_every_thread`` (c10's
``caffe2_report_cpu_memory_usage`` flag, which ``step_peak_bytes`` sets).
Which thread frees is a race, so the first varies from run to run; the
second is 0.

Exit status: 0 if every run with the flag ended at 0 bytes above, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType

# The measurement shared with the tests (test/fsdp_ext_testing)
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "test"))
from fsdp_ext_testing.memory import (  # noqa: E402
    count_cpu_frees_on_every_thread,
    walk_events,
)

WORLD_SIZE = 2
NUMELS = (2048, 64, 2048, 32)  # fp32: 8 KiB, 256 B, 8 KiB, 128 B


def _final_total(collectives: int, every_thread: bool) -> int:
    inputs = [torch.randn(NUMELS[i % len(NUMELS)]) for i in range(collectives)]
    outputs = [torch.empty(t.numel() // WORLD_SIZE) for t in inputs]
    counting = count_cpu_frees_on_every_thread() if every_thread else contextlib.nullcontext()
    with counting, torch.profiler.profile(profile_memory=True) as prof:
        for output, inp in zip(outputs, inputs, strict=True):
            dist.reduce_scatter_tensor(output, inp)
        torch.ones(1)  # the last events: its allocation and free, on this thread
    events = walk_events(prof.profiler.kineto_results.experimental_event_tree())
    allocations = sorted(
        (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated)
        for e in events
        if e.tag == _EventType.Allocation
    )
    # The total carries over from earlier profiler sessions: count from the
    # total before this one's first allocation
    _, first_size, first_total = allocations[0]
    return allocations[-1][2] - (first_total - first_size)


def _run(rank: int, store_path: str, args: argparse.Namespace, result_path: str) -> None:
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, store=store)
    torch.set_num_threads(1)
    ok = True
    for run in range(args.runs):
        alone = _final_total(args.collectives, every_thread=False)
        counted = _final_total(args.collectives, every_thread=True)
        ok &= counted == 0
        if rank == 0:
            print(
                f"run {run + 1}: the total ends {alone:,} B above its start with the "
                f"profiler alone, {counted:,} B counting frees on every thread",
                flush=True,
            )
    if rank == 0:
        Path(result_path).write_text("ok" if ok else "wrong")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--collectives", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result")
        mp.spawn(
            _run,
            args=(os.path.join(tmp, "store"), args, result_path),
            nprocs=WORLD_SIZE,
        )
        return 0 if Path(result_path).read_text() == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
