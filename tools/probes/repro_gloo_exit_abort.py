#!/usr/bin/env python3
"""Count the runs that abort at exit ("terminate called without an active
exception") when a gloo process has issued collectives inside backward.

Each run is a fresh 2-rank gloo job. The FSDP scenarios are those of
``test/fsdp_ext_testing/exit_scenarios.py`` (3 MLP blocks, async unshard):
``sequential`` (a grouped model, then a per-parameter one), ``switch`` (one
model, ``set_group_collectives`` True, False, True, False), ``grouped``,
``per-param``, ``upstream`` (torch's own ``fully_shard``, grouped). ``c10d``
uses no FSDP: a tensor hook reduce-scatters the
gradient during backward (synchronously, as FSDP's post-backward does), the
process group stays referenced, then ``destroy_process_group`` and exit; it is
the reproduction in docs/upstream-gloo-exit-abort.md. ``--c10d-outside`` issues
the same reduce-scatter after backward instead. ``--pin`` pins each rank to
one CPU (``pin_to_one_cpu``), so that a gloo worker thread waits for the main
thread to block or be preempted; ``--sleep`` waits before
``destroy_process_group`` (any sleep, even 0 s, yields the CPU to the worker).

The mechanism (docs/upstream-gloo-exit-abort.md): backward stashes a Python
object in thread-local state (``torch.autograd.graph._engine_run_backward``),
every c10d work created meanwhile captures it, and gloo's worker thread drops
its references to a work only after completing it; when that is the last
reference and the interpreter is finalizing, the decref takes the GIL,
``pthread_exit`` unwinds through a destructor, and ``std::terminate`` aborts.
A core dump of an aborted FSDP rank showed the work: an ``AsyncAllreduceWork``
(gloo's reduce-scatter) with sequence number 135, the process's last
collective, completed and waited.

This probe used to call ``time.sleep(0)`` before ``destroy_process_group``,
which yields the CPU to gloo's worker and hid most aborts (then: grouped then
per-parameter 2 of 20, one mode 0 of 40). Without it, ``--pin``, 10 runs each
(torch 2.15.0, 2 cores shared with other jobs), before per-parameter
collectives were issued without the object: ``per-param`` 8, ``grouped`` 4,
``sequential`` 8, ``switch`` 9, ``upstream`` 5, ``c10d`` 8; ``c10d`` unpinned
1, ``c10d --c10d-outside`` 0, ``c10d --sleep 1`` 0. After: ``per-param``,
``sequential``, ``switch`` 0, ``grouped`` 3 (upstream's grouped mode).

Example::

    python tools/probes/repro_gloo_exit_abort.py --runs 25 --scenario sequential
    python tools/probes/repro_gloo_exit_abort.py --runs 10 --scenario c10d --pin
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The scenarios shared with the tests (test/fsdp_ext_testing)
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "test"))
from fsdp_ext_testing.exit_scenarios import (  # noqa: E402
    ABORT_MESSAGE,
    SCENARIOS,
    WORLD_SIZE,
    pin_to_one_cpu,
    run_rank,
)

# The process group (c10d) or the models, kept until interpreter teardown
_KEPT: list[object] = []


def _c10d_rank(rank: int, store_path: str, outside: bool, sleep_s: float) -> object:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, store=dist.FileStore(store_path, WORLD_SIZE)
    )
    group = dist.group.WORLD  # what a DeviceMesh or a model's DTensors keep alive

    def reduce_scatter(tensor: torch.Tensor) -> None:
        dist.reduce_scatter_tensor(torch.empty(tensor.numel() // WORLD_SIZE), tensor)

    weight = torch.randn(64, requires_grad=True)
    if not outside:
        weight.register_hook(reduce_scatter)
    for _ in range(3):
        (weight * 2).sum().backward()
        if outside:
            reduce_scatter(weight.grad)
    if sleep_s:  # even sleep(0) yields the CPU, to gloo's worker too
        time.sleep(sleep_s)
    dist.destroy_process_group()
    return group


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--scenario", choices=(*SCENARIOS, "c10d"), default="sequential")
    parser.add_argument("--c10d-outside", action="store_true", help="c10d: outside backward")
    parser.add_argument("--pin", action="store_true", help="pin each rank to one CPU")
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds to wait before destroy_process_group"
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        if args.pin:
            pin_to_one_cpu(args.rank)
        # Referenced until interpreter teardown, as a script's are
        _KEPT.append(
            _c10d_rank(args.rank, args.store, args.c10d_outside, args.sleep)
            if args.scenario == "c10d"
            else run_rank(args.scenario, args.rank, args.store, args.sleep)
        )
        return 0
    aborted = 0
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--store", os.path.join(tmp, "store")]
            cmd += ["--scenario", args.scenario, "--sleep", str(args.sleep)]
            cmd += ["--pin"] * args.pin + ["--c10d-outside"] * args.c10d_outside
            procs = [
                subprocess.Popen([*cmd, "--rank", str(r)], stderr=subprocess.PIPE, text=True)
                for r in range(WORLD_SIZE)
            ]
            errors = [p.communicate(timeout=300)[1] for p in procs]
        if any(ABORT_MESSAGE in e for e in errors):
            aborted += 1
            print(f"run {run}: aborted", flush=True)
        elif any(p.returncode for p in procs):
            print(f"run {run}: failed otherwise:\n{''.join(errors)[-2000:]}", flush=True)
            return 2
    options = " ".join(
        f"--{name}" for name in ("pin", "c10d_outside") if getattr(args, name)
    ).replace("_", "-")
    print(
        f"{aborted} of {args.runs} runs aborted ({args.scenario} {options}, sleep {args.sleep} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
