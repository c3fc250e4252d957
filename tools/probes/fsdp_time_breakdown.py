#!/usr/bin/env python3
"""Where FSDP's own time goes, per function, grouped vs per-parameter collectives.

Trains one bench model (tools/bench/models.py) on the fake process group in
each mode and prints, per training step, FSDP's own time as the bench reports
it (tools/bench/fsdp_time.py: the time inside FSDP's hooks less the process
group's calls and waits made from them), that process-group time, and the
inclusive time of FSDP's main functions with the process group's time inside
them taken out, with their calls per step. A function called from another is
counted in both (``foreach_all_gather*`` inside ``FSDPParamGroup.unshard``,
for one), so the rows do not add up.

Per-call wrappers cost about a microsecond each, in every mode alike; the
bench's own numbers (docs/results.md) come without them.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fsdp_time import TIMER  # noqa: E402
from bench.measure import _train_step  # noqa: E402
from bench.models import MODELS  # noqa: E402
from bench.modes import MODES_BY_NAME, coalescing  # noqa: E402

import torch_fsdp_ext._fully_shard._fsdp_collectives as collectives  # noqa: E402
import torch_fsdp_ext._fully_shard._fsdp_param as fsdp_param  # noqa: E402
import torch_fsdp_ext._fully_shard._fsdp_param_group as param_group  # noqa: E402

GROUP_METHODS = (
    "pre_forward",
    "post_forward",
    "pre_backward",
    "post_backward",
    "unshard",
    "wait_for_unshard",
    "reshard",
    "_register_post_backward_hook",
    "_backward_prefetch",
)
COLLECTIVE_FUNCTIONS = (
    "foreach_all_gather",
    "foreach_all_gather_copy_out",
    "foreach_all_gather_per_param",
    "foreach_all_gather_per_param_copy_out",
    "foreach_reduce",
)
PARAM_METHODS = ("alloc_all_gather_outputs", "free_unsharded_param", "to_sharded", "to_unsharded")

_seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
_calls: collections.Counter[str] = collections.Counter()


def _timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, pg_start = time.perf_counter(), TIMER.pg_s
        try:
            return fn(*args, **kwargs)
        finally:
            _seconds[label] += time.perf_counter() - start - (TIMER.pg_s - pg_start)
            _calls[label] += 1

    return wrapper


def _install() -> None:
    for name in GROUP_METHODS:
        cls = param_group.FSDPParamGroup
        setattr(cls, name, _timed(getattr(cls, name), f"FSDPParamGroup.{name}"))
    for name in COLLECTIVE_FUNCTIONS:
        timed = _timed(getattr(collectives, name), name)
        setattr(collectives, name, timed)
        # The param group calls the all-gathers through its own imports
        if hasattr(param_group, name):
            setattr(param_group, name, timed)
    for name in PARAM_METHODS:
        cls = fsdp_param.FSDPParam
        setattr(cls, name, _timed(getattr(cls, name), f"FSDPParam.{name}"))
    TIMER.install()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=list(MODELS), default="many-small")
    parser.add_argument("--modes", nargs="+", default=["grouped", "per-param"])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per mode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    _install()
    spec = MODELS[args.model]
    mesh = spec.mesh("cpu", args.world_size)
    inp = spec.make_input(0, torch.device("cpu"))
    rows: dict[str, dict[str, tuple[float, int]]] = {}
    for name in args.modes:
        mode = MODES_BY_NAME[name]
        model = spec.build(mode, mesh, "fp32")
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        with coalescing(mode, "cpu"):
            for _ in range(3):
                _train_step(model, optim, inp, spec.loss_fn)
            _seconds.clear()
            _calls.clear()
            start, fsdp_start, pg_start = time.perf_counter(), TIMER.fsdp_s(), TIMER.pg_s
            for _ in range(args.steps):
                _train_step(model, optim, inp, spec.loss_fn)
            totals = {
                "step": time.perf_counter() - start,
                "FSDP's own time": TIMER.fsdp_s() - fsdp_start,
                "process group": TIMER.pg_s - pg_start,
            }
        rows[name] = {label: (secs, 0) for label, secs in totals.items()}
        rows[name].update({label: (_seconds[label], _calls[label]) for label in _seconds})
        dist.barrier()
    labels = list(dict.fromkeys(label for mode_rows in rows.values() for label in mode_rows))
    print(
        f"{args.model}, fake process group at W={args.world_size}, {args.steps} steps; "
        "ms per step (calls per step)"
    )
    print(f"| function | {' | '.join(args.modes)} |")
    print("|---|" + "---|" * len(args.modes))
    for label in labels:
        cells = []
        for name in args.modes:
            secs, calls = rows[name].get(label, (0.0, 0))
            count = f" ({calls // args.steps})" if calls else ""
            cells.append(f"{secs / args.steps * 1e3:.3f}{count}")
        print(f"| {label} | {' | '.join(cells)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
