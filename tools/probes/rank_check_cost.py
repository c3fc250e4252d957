#!/usr/bin/env python3
"""Measure what FSDP's cross-rank consistency check costs at lazy init.

Spawns CPU ranks (gloo), shards a model with torch_fsdp_ext, runs one forward
(lazy init, which runs the check once), then times the check alone: building
every parameter group's fingerprint, one ``all_gather_object`` of a 16-byte
digest per mesh, and the comparison. Prints, from rank 0, the median and
maximum over ``--repeat`` runs (and the median of the local part alone), the
pickled payload each rank contributes, the number of FSDP modules, parameter
groups, parameters and meshes, and the first forward's time for scale.

The models are the benchmark's (tools/bench/models.py), sharded as its
"per-param" mode (group_collectives=False), e.g. "moe" (the MoE demo model;
experts on the efsdp mesh, the rest on all ranks) and "llama-M". The check's
cost grows with the number of parameters, not their size.
"""

from __future__ import annotations

import argparse
import logging
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# A probe borrows the bench's models and the demos' rank spawner from tools/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.models import MODELS  # noqa: E402
from demos._ranks import rank_rows  # noqa: E402

log = logging.getLogger("torch_fsdp_ext.rank_check_cost")


def _worker(rank: int, args: argparse.Namespace, store_path: str, queue) -> None:
    from bench.models import MODELS
    from bench.modes import MODES_BY_NAME

    from torch_fsdp_ext._fully_shard import _fsdp_rank_check

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.world_size)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, store=store)
    spec = MODELS[args.model]
    model = spec.build(MODES_BY_NAME["per-param"], spec.mesh("cpu", args.world_size))
    model.set_rank_consistency_check(True)  # off by default
    inp = spec.make_input(rank, torch.device("cpu"))
    dist.barrier()
    start = time.perf_counter()
    spec.loss_fn(model, inp)  # lazy init, with the check
    first_forward = time.perf_counter() - start
    state = model._get_fsdp_state()
    seconds = []
    for _ in range(args.repeat):
        # Forget the last checked digests: the check at lazy init again
        state._state_ctx.rank_check._digests = None
        dist.barrier()
        start = time.perf_counter()
        state._check_rank_consistency()
        seconds.append(time.perf_counter() - start)
    groups = [g for s in state._state_ctx.all_states for g in s._fsdp_param_groups]
    local_seconds = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        by_mesh = _fsdp_rank_check._fingerprints(groups)
        _fsdp_rank_check._digests(by_mesh)
        local_seconds.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(
            {
                "median_ms": 1e3 * statistics.median(seconds),
                "max_ms": 1e3 * max(seconds),
                "local_ms": 1e3 * statistics.median(local_seconds),
                "first_forward_ms": 1e3 * first_forward,
                "payload_bytes": len(pickle.dumps(_fsdp_rank_check._digests(by_mesh))),
                "fingerprint_bytes": len(pickle.dumps(by_mesh)),
                "fsdp_modules": len(state._state_ctx.all_states),
                "groups": len(groups),
                "params": sum(len(g.fsdp_params) for g in groups),
                "meshes": len(by_mesh),
            }
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="moe")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if not MODELS[args.model].runs_at(args.world_size):
        parser.error(f"{args.model} cannot be sharded on {args.world_size} ranks")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info(
        "timing the check %d times on %d CPU ranks (gloo), model %s",
        args.repeat,
        args.world_size,
        args.model,
    )
    (row,) = rank_rows(_worker, args, args.world_size, rows=1)
    log.info(
        "%s: %d FSDP modules, %d parameter groups, %d parameters, %d meshes per rank",
        args.model,
        row["fsdp_modules"],
        row["groups"],
        row["params"],
        row["meshes"],
    )
    log.info(
        "check: median %.2f ms, max %.2f ms (of which fingerprints and digests, no "
        "communication: median %.2f ms); all_gather_object payload %d B per rank (full "
        "fingerprints, exchanged only on a mismatch: %d B)",
        row["median_ms"],
        row["max_ms"],
        row["local_ms"],
        row["payload_bytes"],
        row["fingerprint_bytes"],
    )
    log.info(
        "for scale: the first forward (lazy init and the check) took %.0f ms",
        row["first_forward_ms"],
    )


if __name__ == "__main__":
    main()
