"""One rank of a gloo job that trains with ``fully_shard`` and then exits the
way a script does (``destroy_process_group``, then interpreter teardown), for
the checks that a process exits cleanly after switching collective modes.

``python -m fsdp_ext_testing.exit_scenarios --scenario S --rank R --store F``
runs one rank (``test/`` on ``sys.path``); ``run_job`` starts a whole job and
returns each rank's exit code and stderr. Every scenario trains 3 MLP blocks
(``fully_shard`` per block and at the root, ``reshard_after_forward=True``,
``_set_unshard_async_op(True)`` on every block, SGD) at world size 2:

- ``sequential``: a grouped model for 3 steps, then a new per-parameter one;
- ``switch``: one model, ``set_group_collectives`` True, False, True, False
  between iterations, 2 steps each;
- ``grouped`` / ``per-param``: one model in one mode, 3 steps;
- ``upstream``: as ``grouped``, with torch's own ``fully_shard``.

The models stay referenced until exit, as in a training script, so the
process group (and gloo's worker threads) outlives ``destroy_process_group``.

A rank whose exit went wrong dies with SIGABRT and "terminate called without
an active exception" (see docs/upstream-gloo-exit-abort.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = ("sequential", "switch", "grouped", "per-param", "upstream")
WORLD_SIZE = 2
ABORT_MESSAGE = "terminate called without an active exception"


def _build(mesh, group_collectives: bool | None):
    """``group_collectives=None``: torch's own ``fully_shard``."""
    import torch
    import torch.distributed.fsdp
    from torch import nn

    import torch_fsdp_ext

    torch.manual_seed(42)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3))
    )
    if group_collectives is None:
        fully_shard, kwargs = torch.distributed.fsdp.fully_shard, {}
    else:
        fully_shard = torch_fsdp_ext.fully_shard
        kwargs = {"group_collectives": group_collectives}
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, **kwargs)
        block._set_unshard_async_op(True)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _train(model, rank: int, steps: int) -> None:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(42 + rank)
    for _ in range(steps):
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def pin_to_one_cpu(rank: int) -> None:
    """Pins this process's threads created from now on (gloo's worker threads
    included) to one of its CPUs, by rank: a worker thread then runs only when
    the main thread blocks or is preempted, as on a busy machine."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def run_rank(scenario: str, rank: int, store_path: str, sleep_s: float = 0.0) -> list:
    """Trains ``scenario`` on this rank, waits ``sleep_s`` and destroys the
    process group; returns the models, for the caller to keep until exit."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, store=dist.FileStore(store_path, WORLD_SIZE)
    )
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    models = []
    if scenario == "sequential":
        for group_collectives in (True, False):
            models.append(_build(mesh, group_collectives))
            _train(models[-1], rank, 3)
    elif scenario == "switch":
        models.append(_build(mesh, True))
        for group_collectives in (True, False, True, False):
            models[0].set_group_collectives(group_collectives)
            _train(models[0], rank, 2)
    else:
        group_collectives = None if scenario == "upstream" else scenario == "grouped"
        models.append(_build(mesh, group_collectives))
        _train(models[0], rank, 3)
    if sleep_s:  # even sleep(0) yields the CPU, to gloo's worker too
        time.sleep(sleep_s)
    dist.destroy_process_group()
    return models


def run_job(scenario: str, pin: bool = False, timeout: float = 300) -> list[tuple[int, str]]:
    """Runs ``scenario`` as a fresh job of ``WORLD_SIZE`` processes, each
    importing the same ``torch_fsdp_ext`` as this process and, with ``pin``,
    pinned to one CPU (``pin_to_one_cpu``); returns each rank's (exit code,
    stderr)."""
    import torch_fsdp_ext

    paths = [
        str(Path(torch_fsdp_ext.__file__).resolve().parents[1]),
        str(Path(__file__).resolve().parents[1]),
        os.environ.get("PYTHONPATH", ""),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fsdp_ext_testing.exit_scenarios", "--scenario", scenario]
        cmd += ["--store", os.path.join(tmp, "store")] + ["--pin"] * pin
        procs = [
            subprocess.Popen(
                [*cmd, "--rank", str(rank)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(WORLD_SIZE)
        ]
        try:
            errors = [p.communicate(timeout=timeout)[1] for p in procs]
        finally:
            for p in procs:
                p.kill()
    return [(p.returncode, error) for p, error in zip(procs, errors, strict=True)]


def main() -> list:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--pin", action="store_true", help="pin_to_one_cpu")
    args = parser.parse_args()
    if args.pin:
        pin_to_one_cpu(args.rank)
    return run_rank(args.scenario, args.rank, args.store)


if __name__ == "__main__":
    # Referenced until interpreter teardown, as a script's models are
    MODELS = main()
