#!/usr/bin/env python3
"""Print FSDP's copy ops and peak CPU memory of one training step, grouped vs per-parameter.

Single process over the fake process group (collectives move no data, so what
is measured is FSDP's own work): the model and the exact profiler measurement
of test/test_fully_shard_per_param_memory.py, and the copy-op counter of the
upstream-path test. Numbers are bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

TEST_DIR = Path(__file__).resolve().parent.parent / "test"
sys.path[:0] = [str(TEST_DIR), str(TEST_DIR / "upstream")]

from common_fsdp_ext import EXT, Model  # noqa: E402
from test_fully_shard_group_collectives import _CommAndCopyRecorder  # noqa: E402
from test_fully_shard_per_param_memory import (  # noqa: E402
    reduce_scatter_input_bytes,
    step_peak_bytes,
)


def _sharded_model(args: argparse.Namespace, group_collectives: bool) -> torch.nn.Module:
    torch.manual_seed(42)
    model = Model(args.dim, args.hidden, args.blocks)
    for block in model.blocks:
        EXT.fully_shard(block, group_collectives=group_collectives)
    return EXT.fully_shard(model, group_collectives=group_collectives)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    inp = torch.randn(args.batch, args.dim)
    block_buffer = reduce_scatter_input_bytes(Model(args.dim, args.hidden, 1).blocks[0])
    print(
        f"world size {args.world_size}, {args.blocks} blocks, dim {args.dim}, hidden {args.hidden}"
    )
    print(f"reduce-scatter input buffer of one block group: {block_buffer} B")
    print(f"{'mode':<10} {'fwd peak':>10} {'bwd peak':>10}  copy ops in one step")
    for group_collectives in (True, False):
        fwd, bwd = step_peak_bytes(_sharded_model(args, group_collectives), inp)
        model = _sharded_model(args, group_collectives)
        model(inp).sum().backward()
        with _CommAndCopyRecorder() as recorder:
            model(inp).sum().backward()
        mode = "grouped" if group_collectives else "per-param"
        copies = ", ".join(f"{k}={v}" for k, v in sorted(recorder.copies.items())) or "none"
        print(f"{mode:<10} {fwd:>10} {bwd:>10}  {copies}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
