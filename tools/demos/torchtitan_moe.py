#!/usr/bin/env python3
"""Train torchtitan's deepseek_v3 debug model (MoE) with expert parallelism on
CPU ranks (gloo), sharded three ways, and print a per-step loss table.

The model comes from torchtitan's config registry (deepseek_v3_debugmodel,
shortened sequences and batches) and is parallelized by its own
parallelize_fn: routed experts expert-parallel on "ep", FSDP-sharded on
"efsdp" through ShardPlacementResult, everything else on the "fsdp" mesh. The
columns train it from the same seed on the same tokens:

  (a) upstream   torch.distributed.fsdp.fully_shard (torchtitan as shipped)
  (b) grouped    torch_fsdp_ext.fully_shard, group_collectives=True
  (c) per-param  torch_fsdp_ext.fully_shard, group_collectives=False

(b) and (c) are switched in with torch_fsdp_ext.torchtitan.use_fsdp_ext. The
loss is the global loss torchtitan logs. "match" says whether the three
losses, gradient norms and every rank's sharded parameters after the
optimizer step are bitwise equal (with --deterministic: (b) and (c)). The exit code is 1 if any step does not
match. CPU shims: see fsdp_ext_testing.torchtitan.apply_cpu_shims and
docs/torchtitan.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import time

import _venv  # noqa: F401  (first: names the fix outside the venv)
import torch
import torch.distributed as dist
from _ranks import rank_rows

log = logging.getLogger("torch_fsdp_ext.torchtitan_demo")

COLUMNS = {"upstream": "(a) upstream", "grouped": "(b) grouped", "per-param": "(c) per-param"}


def _worker(rank: int, args: argparse.Namespace, store_path: str, queue) -> None:
    # torchtitan logs every rank's setup at INFO; keep the table readable
    logging.disable(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    from torchtitan.distributed import ParallelDims

    from fsdp_ext_testing.torchtitan import DebugRun, debug_config
    from torch_fsdp_ext.torchtitan import FSDPExtSettings

    # Four ranks share few cores: one intra-op thread each avoids oversubscription
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.world_size)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, store=store)

    def config():
        return debug_config(
            args.model,
            ep=args.ep,
            seq_len=args.seq,
            local_batch_size=args.batch,
            steps=args.steps,
            param_dtype=args.param_dtype,
        )

    arms = {
        "upstream": None,
        "grouped": FSDPExtSettings(True, args.deterministic),
        "per-param": FSDPExtSettings(False, args.deterministic),
    }
    # The reference of the match column, and the columns compared with it
    ref, compared = (
        ("grouped", ["per-param"]) if args.deterministic else ("upstream", ["grouped", "per-param"])
    )
    parallel_dims = ParallelDims.from_config(config().parallelism, args.world_size)
    runs = {name: DebugRun(config(), parallel_dims, fsdp, seed=42) for name, fsdp in arms.items()}
    vocab = runs["upstream"].model_config.vocab_size
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(42 + rank + 1000 * step)
        tokens = torch.randint(vocab, (args.batch, args.seq + 1), generator=gen)
        results = {name: run.step(tokens) for name, run in runs.items()}
        shards = {name: [shard for _, shard in run.local_shards()] for name, run in runs.items()}
        equal = all(
            torch.equal(results[name][i], results[ref][i]) for name in compared for i in (0, 1)
        ) and all(
            torch.equal(p, ref_p)
            for name in compared
            for p, ref_p in zip(shards[name], shards[ref], strict=True)
        )
        flag = torch.tensor(float(equal))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if rank == 0:
            losses = {name: loss.item() for name, (loss, _) in results.items()}
            queue.put((step, losses, bool(flag.item())))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--model",
        choices=("deepseek_v3", "llama3"),
        default="deepseek_v3",
        help="torchtitan model whose <model>_debugmodel config to train (llama3: no EP)",
    )
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--batch", type=int, default=2, help="local batch size")
    parser.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="(b) and (c) reduce-scatter with torch_fsdp_ext.DeterministicReduceScatter "
        "and match compares (b) with (c) only: torch's set_custom_reduce_scatter refuses "
        "modules with several parameter groups (EP's per-parameter meshes), so (a) keeps "
        "the default comms and may differ in the last bits",
    )
    args = parser.parse_args()
    if args.model == "llama3" and args.ep != 1:
        parser.error("llama3 has no experts: pass --ep 1")
    if args.world_size % args.ep:
        parser.error(f"--ep {args.ep} must divide --world-size {args.world_size}")
    if importlib.util.find_spec("torchtitan") is None:
        parser.error("torchtitan is not installed: pip install torchtitan==0.3.0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info(
        "training torchtitan %s_debugmodel on %d CPU ranks (gloo), ep=%d, %d steps, "
        "seq %d x batch %d per rank, %s params, comms: %s",
        args.model,
        args.world_size,
        args.ep,
        args.steps,
        args.seq,
        args.batch,
        args.param_dtype,
        "DeterministicReduceScatter in (b), (c); match: (b) == (c)"
        if args.deterministic
        else "default; match: (a) == (b) == (c)",
    )
    start = time.perf_counter()
    all_match = True
    for i, (step, losses, match) in enumerate(
        rank_rows(_worker, args, args.world_size, args.steps)
    ):
        if i == 0:
            log.info(
                "ranks up, models built and first step done after %.1f s",
                time.perf_counter() - start,
            )
            print("| step | " + " | ".join(f"{c:>18}" for c in COLUMNS.values()) + " | match |")
            print("|-----:|" + "|".join("-" * 19 + ":" for _ in COLUMNS) + "|:-----:|")
        all_match &= match
        print(
            f"| {step:>4} | "
            + " | ".join(f"{losses[m]:>18.15f}" for m in COLUMNS)
            + f" | {'yes' if match else 'NO':>5} |"
        )
    print(
        f"\n{'all steps bitwise equal' if all_match else 'MISMATCH'} "
        f"(wall time {time.perf_counter() - start:.1f} s)"
    )
    raise SystemExit(0 if all_match else 1)


if __name__ == "__main__":
    main()
