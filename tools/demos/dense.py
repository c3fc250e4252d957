#!/usr/bin/env python3
"""Train a small transformer with FSDP2 on CPU ranks (gloo) and print a per-step loss table.

Each column is one way of sharding the same model from the same seed:

  upstream    torch.distributed.fsdp.fully_shard
  grouped     torch_fsdp_ext.fully_shard(..., group_collectives=True)
  per-param   torch_fsdp_ext.fully_shard(..., group_collectives=False)

The last column says whether every loss in the row is bitwise equal. At world
size 2 they are with the default comms. At larger world sizes gloo sums in an
order that depends on message size, so per-param can differ from the others in
the last bits; --deterministic gives every column DeterministicReduceScatter,
which makes them all equal again.
"""

from __future__ import annotations

import argparse
import copy
import logging

import _venv  # noqa: F401  (first: names the fix outside the venv)
import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream_fsdp
import torch.nn as nn
import torch.nn.functional as F
from _ranks import rank_rows

from fsdp_ext_testing.models import Transformer

log = logging.getLogger("torch_fsdp_ext.demo")


def _shard(model: nn.Module, fully_shard, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _worker(rank: int, args: argparse.Namespace, store_path: str, queue) -> None:
    import torch_fsdp_ext

    store = dist.FileStore(store_path, args.world_size)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, store=store)
    torch.manual_seed(42)
    base = Transformer(args.vocab, args.dim, args.heads, args.layers)
    variants = {
        "upstream": _shard(copy.deepcopy(base), upstream_fsdp.fully_shard),
        "grouped": _shard(copy.deepcopy(base), torch_fsdp_ext.fully_shard, group_collectives=True),
        "per-param": _shard(
            copy.deepcopy(base), torch_fsdp_ext.fully_shard, group_collectives=False
        ),
    }
    if args.deterministic:
        for model in variants.values():
            for module in model.modules():
                if isinstance(module, upstream_fsdp.FSDPModule):
                    module.set_custom_reduce_scatter(torch_fsdp_ext.DeterministicReduceScatter())
    optims = {
        name: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
        for name, m in variants.items()
    }
    gen = torch.Generator().manual_seed(42 + rank)
    for step in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen)
        row = {}
        for name, model in variants.items():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optims[name].step()
            optims[name].zero_grad()
            # The global loss: mean over ranks, identical on every rank
            dist.all_reduce(loss.detach(), op=dist.ReduceOp.SUM)
            row[name] = loss.item() / args.world_size
        if rank == 0:
            queue.put((step, row))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="reduce-scatter with DeterministicReduceScatter in every column",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("training on %d CPU ranks (gloo) for %d steps", args.world_size, args.steps)

    names = None
    all_equal = True
    for step, row in rank_rows(_worker, args, args.world_size, args.steps):
        if names is None:
            names = list(row)
            print(f"{'step':>4}  " + "  ".join(f"{n:>20}" for n in names) + "  bitwise")
        equal = len({row[n] for n in names}) == 1
        all_equal &= equal
        print(
            f"{step:>4}  "
            + "  ".join(f"{row[n]:>20.15f}" for n in names)
            + f"  {'yes' if equal else 'NO'}"
        )
    print("all losses bitwise equal" if all_equal else "LOSSES DIFFER")
    raise SystemExit(0 if all_equal else 1)


if __name__ == "__main__":
    main()
