#!/usr/bin/env python3
"""Count the runs that abort at exit when one gloo process trains a model
grouped, then one per-parameter, with async unshard (a reported SIGABRT).

Each run is a fresh 2-rank gloo job (W=2, 3 MLP blocks, fully_shard per block
and at the root, ``reshard_after_forward=True``, ``_set_unshard_async_op(True)``
on every block, SGD). ``--scenario sequential`` trains a grouped model for 3
steps and then a new per-parameter one; ``switch`` trains one model,
``set_group_collectives`` True, False, True, False, 2 steps each. A run that
dies with "terminate called without an active exception" counts as aborted.

What a core dump of an aborted rank showed (torch 2.15.0, 2026-12-04): the
abort happens while the interpreter finalizes, on a gloo worker thread
(``ProcessGroupGloo::runLoop``) that drops the last reference to a finished
``AsyncWork``; its captured ``at::ThreadLocalState`` holds a Python object
(a ``c10::SafePyObject`` in a ``shared_ptr``), whose decref takes the GIL,
which a finalizing interpreter answers with ``pthread_exit``; the forced
unwind through the destructor ends in ``std::terminate``. ``--sleep`` waits
before ``destroy_process_group`` to test that reading (1 of 25 runs aborted
without it, 0 of 25 with 1 s).

Example::

    python tools/probes/repro_gloo_exit_abort.py --runs 25 --scenario sequential
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

WORLD_SIZE = 2


def _rank(rank: int, store_path: str, scenario: str, sleep_s: float) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from torch_fsdp_ext import fully_shard

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, store=dist.FileStore(store_path, WORLD_SIZE)
    )
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))

    def build(group_collectives: bool) -> nn.Module:
        torch.manual_seed(42)
        model = nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3))
        )
        for block in model:
            fully_shard(
                block, mesh=mesh, reshard_after_forward=True, group_collectives=group_collectives
            )
            block._set_unshard_async_op(True)
        fully_shard(model, mesh=mesh, group_collectives=group_collectives)
        return model

    def train(model: nn.Module, steps: int) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(42 + rank)
        for _ in range(steps):
            model(torch.randn(4, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    if scenario == "sequential":
        for group_collectives in (True, False):
            train(build(group_collectives), 3)
    else:
        model = build(True)
        for group_collectives in (True, False, True, False):
            model.set_group_collectives(group_collectives)
            train(model, 2)
    time.sleep(sleep_s)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--scenario", choices=("sequential", "switch"), default="sequential")
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds to wait before destroy_process_group"
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.store, args.scenario, args.sleep)
        return 0
    aborted = 0
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--store", os.path.join(tmp, "store")]
            cmd += ["--scenario", args.scenario, "--sleep", str(args.sleep)]
            procs = [
                subprocess.Popen([*cmd, "--rank", str(r)], stderr=subprocess.PIPE, text=True)
                for r in range(WORLD_SIZE)
            ]
            errors = [p.communicate(timeout=300)[1] for p in procs]
        if any("terminate called without an active exception" in e for e in errors):
            aborted += 1
            print(f"run {run}: aborted", flush=True)
        elif any(p.returncode for p in procs):
            print(f"run {run}: failed otherwise:\n{''.join(errors)[-2000:]}", flush=True)
            return 2
    print(f"{aborted} of {args.runs} runs aborted ({args.scenario}, sleep {args.sleep} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
