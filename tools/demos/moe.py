#!/usr/bin/env python3
"""Train a tiny DeepSeek-V3-like MoE with expert parallelism on CPU ranks (gloo),
sharded three ways, and print a per-step loss table and the all-gather order.

The world mesh is ("efsdp", "ep"): routed experts are DTensors Shard(0) on "ep"
and FSDP shards them Shard(1) on "efsdp"; every other parameter is sharded on
the flattened "dp" mesh (all ranks). The columns train the same model from the
same seed:

  (a) old        fully_shard(block.moe.experts, mesh=efsdp) + fully_shard(block, mesh=dp)
  (b) grouped    torch_fsdp_ext.fully_shard(block, mesh=dp, shard_placement_fn=...):
                 expert params on the efsdp mesh via ShardPlacementResult
  (c) per-param  (b) with group_collectives=False

"match" says whether the three losses, and every rank's sharded parameters
after the optimizer step, are bitwise equal. Every FSDP parameter group
reduce-scatters with DeterministicReduceScatter (--no-deterministic for the
default comms, which at world size 4 sum in a size-dependent order). The exit
code is 1 if any step does not match.

With --ep 1, (a) differs from (b) and (c) in the last bits: its separate experts
module puts FSDP's post-backward autograd node on the experts' inputs, so
autograd sums the MoE input's gradients in another order. With ep > 1 the
token all-gather's node sits there in every wrapping.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

import _venv  # noqa: F401  (first: names the fix outside the venv)
import torch
import torch.distributed as dist
from _ranks import rank_rows

log = logging.getLogger("torch_fsdp_ext.moe_demo")

COLUMNS = {"old": "(a) old", "grouped": "(b) grouped", "per-param": "(c) per-param"}


def _worker(rank: int, args: argparse.Namespace, store_path: str, queue) -> None:
    from fsdp_ext_testing import moe

    # Four ranks share few cores: one intra-op thread each avoids oversubscription
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.world_size)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, store=store)
    meshes = moe.build_meshes("cpu", args.world_size // args.ep, args.ep)
    model_args = moe.MoEArgs(
        vocab=args.vocab,
        dim=args.dim,
        layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        score_func=args.score_func,
    )
    models = {mode: moe.build_model(model_args, mode, meshes) for mode in moe.MODES}
    if args.deterministic:
        for model in models.values():
            moe.set_deterministic_reduce_scatter(model)
    optims = {
        mode: torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        for mode, model in models.items()
    }
    gen = torch.Generator().manual_seed(42 + rank)
    for step in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen)
        losses, orders = {}, {}
        for mode, model in models.items():
            # Step 0 runs FSDP's lazy init; trace a steady-state step
            trace = moe.FSDPCollectiveTrace(meshes)
            with trace if step == 1 else contextlib.nullcontext():
                loss = moe.loss_fn(model, tokens)
                loss.backward()
            optims[mode].step()
            optims[mode].zero_grad()
            if step == 1:
                orders[mode] = (
                    trace.order("forward"),
                    trace.order("backward"),
                    trace.order("backward", ("all_gather", "reduce_scatter", "all_to_all")),
                )
            # The global loss: mean over ranks, the same on every rank
            dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.SUM)
            losses[mode] = loss.item() / args.world_size
        params = {mode: [moe.local(p) for p in m.parameters()] for mode, m in models.items()}
        equal = torch.tensor(
            float(
                all(
                    torch.equal(p, ref)
                    for mode in ("grouped", "per-param")
                    for p, ref in zip(params[mode], params["old"], strict=True)
                )
            )
        )
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        if rank == 0:
            queue.put((step, losses, bool(equal.item()), orders))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--score-func", choices=("softmax", "sigmoid"), default="softmax")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce-scatter with DeterministicReduceScatter in every column (default: on)",
    )
    args = parser.parse_args()
    if args.world_size % args.ep or args.experts % args.ep:
        parser.error(f"--ep {args.ep} must divide --world-size and --experts")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is traced)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    efsdp = args.world_size // args.ep
    log.info(
        "training on %d CPU ranks (gloo), mesh (efsdp=%d, ep=%d), %d steps, comms: %s",
        args.world_size,
        efsdp,
        args.ep,
        args.steps,
        "DeterministicReduceScatter" if args.deterministic else "default",
    )
    if args.ep == 1:
        log.warning("--ep 1: expect (a) to differ in the last bits (see --help)")
    start = time.perf_counter()
    all_match = True
    orders = {}
    rows = rank_rows(_worker, args, args.world_size, args.steps)
    for i, (step, losses, params_equal, step_orders) in enumerate(rows):
        if i == 0:
            log.info("ranks up and models sharded after %.1f s", time.perf_counter() - start)
            print("| step | " + " | ".join(f"{c:>18}" for c in COLUMNS.values()) + " | match |")
            print("|-----:|" + "|".join("-" * 19 + ":" for _ in COLUMNS) + "|:-----:|")
        match = params_equal and len(set(losses.values())) == 1
        all_match &= match
        print(
            f"| {step:>4} | "
            + " | ".join(f"{losses[m]:>18.15f}" for m in COLUMNS)
            + f" | {'yes' if match else 'NO':>5} |"
        )
        orders.update(step_orders)
    print("\nFSDP all-gather order in step 1 (block, and which mesh: dense = dp, experts = efsdp):")
    for mode, column in COLUMNS.items():
        forward, backward, schedule = orders[mode]
        print(f"  {column:<14} forward:  {forward}")
        print(f"  {'':<14} backward: {backward}")
        print(f"  {'':<14} backward with reduce-scatters: {schedule}")
    print(
        f"\n{'all steps bitwise equal' if all_match else 'MISMATCH'} "
        f"(wall time {time.perf_counter() - start:.1f} s)"
    )
    raise SystemExit(0 if all_match else 1)


if __name__ == "__main__":
    main()
