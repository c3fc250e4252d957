#!/usr/bin/env python3
"""Count gradient elements that differ between grouped and per-parameter reduce-scatter.

Trains nothing: one forward/backward of a stack of Linear layers on CPU ranks
(gloo), sharded twice with torch_fsdp_ext.fully_shard (group_collectives=True
and False), then compares every sharded gradient element with ==. With
--deterministic both use DeterministicReduceScatter.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def _worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    import torch_fsdp_ext

    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=args.world_size,
        store=dist.FileStore(store_path, args.world_size),
    )
    torch.manual_seed(42)
    base = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
    models = []
    for group_collectives in (True, False):
        model = copy.deepcopy(base)
        torch_fsdp_ext.fully_shard(model, group_collectives=group_collectives)
        if args.deterministic:
            model.set_custom_reduce_scatter(torch_fsdp_ext.DeterministicReduceScatter())
        models.append(model)
    torch.manual_seed(42 + rank)
    inp = torch.randn(64, args.dim)
    for model in models:
        model(inp).sum().backward()
    differ = total = 0
    for param, ref_param in zip(models[0].parameters(), models[1].parameters(), strict=True):
        grad, ref_grad = param.grad.to_local(), ref_param.grad.to_local()
        differ += (grad != ref_grad).sum().item()
        total += grad.numel()
    counts = torch.tensor([differ, total])
    dist.all_reduce(counts)
    if rank == 0:
        comm = "DeterministicReduceScatter" if args.deterministic else "default comm"
        print(
            f"world size {args.world_size}, {comm}: {counts[0].item()} of "
            f"{counts[1].item()} gradient elements differ"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, os.path.join(tmp, "store")), nprocs=args.world_size)


if __name__ == "__main__":
    main()
