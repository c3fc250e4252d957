#!/usr/bin/env python3
"""Show that gloo's coalesced all-gather writes wrong values for some dtype mixes.

Two CPU ranks on gloo. For every ordered pair of dtypes among fp32, bf16,
fp64 and fp16, each rank all-gathers two tensors filled with ``rank + 1``
(3 and 5 elements, the first of the first dtype, the second of the second)
with one ``ProcessGroup.all_gather_single_coalesced`` call, and reduce-scatters
two such tensors with ``reduce_scatter_single_coalesced``; rank 0 prints
whether every output holds the exact expected values. Only torch is used.

On torch 2.9.0, 2.14.1 and 2.15.0 the all-gather is wrong, without an error, for
mixes such as bf16 then fp32 or fp32 then fp64 (7 of the 12 pairs); the
reduce-scatter is right for all. The wrong pairs are exactly those whose
promoted dtype (printed last) is not the first tensor's: gloo's all-gather
flattens the inputs with ``at::cat``, which promotes, and hands gloo that
buffer typed as the first input's dtype (read in ProcessGroupGloo.cpp; the
values ``--values`` prints are exactly what that gives). The upstream report:
docs/upstream-gloo-coalesced-heap-corruption.md. This is why the patch series
coalesces a group's per-parameter collectives only when they share one dtype
(``_foreach_coalesced``; test/package/test_coalescing.py covers it).

Exit status: 0 if every output was right, 1 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions

WORLD_SIZE = 2
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.float16)
NUMELS = (3, 5)


def _run(rank: int, store_path: str, result_path: str, show_values: bool) -> None:
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, store=store)
    group = dist.group.WORLD
    # torch 2.15 binds the ops as *_single_coalesced, torch 2.9 only as
    # allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced (the same c10d ops)
    all_gather_coalesced = getattr(group, "all_gather_single_coalesced", None) or (
        group.allgather_into_tensor_coalesced
    )
    reduce_scatter_coalesced = getattr(group, "reduce_scatter_single_coalesced", None) or (
        group.reduce_scatter_tensor_coalesced
    )
    lines, all_right = [], True
    for dtypes in itertools.permutations(DTYPES, 2):
        inputs = [
            torch.full((n,), rank + 1.0, dtype=d) for n, d in zip(NUMELS, dtypes, strict=True)
        ]
        outputs = [torch.zeros(t.numel() * WORLD_SIZE, dtype=t.dtype) for t in inputs]
        opts = AllgatherOptions()
        opts.asyncOp = True
        all_gather_coalesced(outputs, inputs, opts).wait()
        gathered_right = all(
            torch.equal(out, torch.cat([torch.full_like(inp, r + 1.0) for r in range(WORLD_SIZE)]))
            for out, inp in zip(outputs, inputs, strict=True)
        )
        rs_inputs = [
            torch.full((n * WORLD_SIZE,), rank + 1.0, dtype=d)
            for n, d in zip(NUMELS, dtypes, strict=True)
        ]
        rs_outputs = [torch.zeros(n, dtype=d) for n, d in zip(NUMELS, dtypes, strict=True)]
        opts = ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.asyncOp = True
        reduce_scatter_coalesced(rs_outputs, rs_inputs, opts).wait()
        expected_sum = float(sum(range(1, WORLD_SIZE + 1)))
        reduced_right = all(torch.equal(t, torch.full_like(t, expected_sum)) for t in rs_outputs)
        all_right &= gathered_right and reduced_right
        names = " then ".join(str(d).removeprefix("torch.") for d in dtypes)
        promoted = str(torch.promote_types(*dtypes)).removeprefix("torch.")
        lines.append(
            f"{names:20} all-gather {'right' if gathered_right else 'WRONG'}, "
            f"reduce-scatter {'right' if reduced_right else 'WRONG'}, "
            f"promote_types {promoted}"
        )
        if show_values and not gathered_right:
            lines += [f"    gathered {out.tolist()}" for out in outputs]
    dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "w") as f:
            f.write("\n".join(lines) + f"\n{int(all_right)}\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--values", action="store_true", help="print rank 0's gathered values for wrong pairs"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result")
        mp.spawn(
            _run,
            args=(os.path.join(tmp, "store"), result_path, args.values),
            nprocs=WORLD_SIZE,
        )
        *lines, all_right = open(result_path).read().splitlines()
    print(f"torch {torch.__version__}, gloo, {WORLD_SIZE} ranks, one coalesced op per pair:")
    print("\n".join(lines))
    return 0 if all_right == "1" else 1


if __name__ == "__main__":
    sys.exit(main())
