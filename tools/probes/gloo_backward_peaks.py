#!/usr/bin/env python3
"""Backward peak of per-parameter collectives against grouped ones, on gloo.

For each world size, mixed-precision setting, block and residual-MLP shape
(``dim:hidden:blocks``, one ``fully_shard`` per block and the root), one gloo
process per rank measures the peak bytes allocated in one backward
(``step_peak_bytes``: the profiler's allocations, with blocks that gloo's
worker threads free counted as freed), ``--repeats`` times per mode, each
from the same seed. Blocks (``--blocks``):

  layernorm-gelu  test/fsdp_ext_testing/models.py's ``Model``: an input and an
                  output Linear around blocks x + Linear(GELU(Linear(LayerNorm(x))))
  linear-relu     blocks x + Linear(ReLU(Linear(x))) only (the reported 1.27x model)

Modes:

  grouped      group_collectives=True
  per-param    group_collectives=False, gloo's default (one by one)
  coalesced    the same with comms that coalesce on gloo
               (fsdp_ext_testing.coalescing.COALESCED registered)

gloo's worker threads drop a finished collective's tensors on their own
schedule, which can only raise a peak, so the same run differs from repeat
to repeat. Each cell is the minimum and maximum on rank 0 over the repeats,
with the minimum's ratio to grouped's minimum; "ok" means per-param's
minimum is at most 1.02x grouped's.

Example::

    python tools/probes/gloo_backward_peaks.py --world-size 2 4 --mp fp32 bf16-fp32
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import torch_fsdp_ext

# The models and measurements shared with the tests (test/fsdp_ext_testing)
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "test"))
from fsdp_ext_testing.coalescing import COALESCED  # noqa: E402
from fsdp_ext_testing.memory import step_peak_bytes  # noqa: E402
from fsdp_ext_testing.models import Model  # noqa: E402

MODES = {
    # name: (group_collectives, coalesced)
    "grouped": (True, False),
    "per-param": (False, False),
    "coalesced": (False, True),
}
MP = {
    "fp32": None,
    "bf16-fp32": torch_fsdp_ext.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    ),
}
DEFAULT_SHAPES = [
    "16:32:8",
    "16:32:16",
    "32:64:8",
    "32:64:16",
    "16:64:8",
    "64:256:4",
    "128:512:2",
    "512:2048:2",
]
# Per-param's minimum over grouped's minimum that counts as "ok"
OK_RATIO = 1.02


class _LinearReLUBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


class _LinearReLUModel(nn.Module):
    def __init__(self, dim: int, hidden: int, num_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(_LinearReLUBlock(dim, hidden) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


BLOCKS = {"layernorm-gelu": Model, "linear-relu": _LinearReLUModel}


def _peak(shape: tuple[int, int, int], block: str, mp_name: str, mode: str, rank: int) -> int:
    dim, hidden, blocks = shape
    group_collectives, coalescing = MODES[mode]
    torch_fsdp_ext.register_fsdp_backend(
        "cpu", COALESCED if coalescing else torch_fsdp_ext.FSDPBackend(), override=True
    )
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        torch.manual_seed(42)
        model = BLOCKS[block](dim, hidden, blocks)
        kwargs = {"mesh": mesh, "group_collectives": group_collectives}
        if MP[mp_name] is not None:
            kwargs["mp_policy"] = MP[mp_name]
        for block in model.blocks:
            torch_fsdp_ext.fully_shard(block, **kwargs)
        torch_fsdp_ext.fully_shard(model, **kwargs)
        torch.manual_seed(42 + rank)
        return step_peak_bytes(model, torch.randn(8, dim)).backward
    finally:
        torch_fsdp_ext.unregister_fsdp_backend("cpu")


def _cell(peaks: list[int], grouped: int) -> str:
    return f"{min(peaks):,} - {max(peaks):,} ({min(peaks) / grouped:.3f}x)"


def _rows(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    return [
        (block, mp_name, text)
        for block in args.blocks
        for mp_name in args.mp
        for text in args.shapes
    ]


def _run(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for block, mp_name, text in _rows(args):
        shape = tuple(int(x) for x in text.split(":"))
        # Modes interleaved, so that a slow phase of the machine hits all
        runs: dict[str, list[int]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(_peak(shape, block, mp_name, mode, rank))
        if rank == 0:
            cells = [_cell(runs[mode], min(runs["grouped"])) for mode in MODES]
            ok = min(runs["per-param"]) <= OK_RATIO * min(runs["grouped"])
            print(
                f"| {world_size} | {mp_name} | {block} | {text} | {' | '.join(cells)} | "
                f"{'ok' if ok else 'ABOVE'} |",
                flush=True,
            )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mp", nargs="+", choices=sorted(MP), default=["fp32", "bf16-fp32"])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, metavar="DIM:HIDDEN:BLOCKS")
    parser.add_argument(
        "--blocks",
        nargs="+",
        choices=sorted(BLOCKS),
        default=["layernorm-gelu"],
        help="residual blocks to build (see above; default: layernorm-gelu)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        "| W | mp | block | dim:hidden:blocks | grouped bwd peak, min - max (B) | "
        f"per-param (one by one) | coalesced (opt-in) | per-param <= {OK_RATIO}x grouped |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world_size in args.world_size:
        mp.spawn(_run, args=(world_size, _free_port(), args), nprocs=world_size)


if __name__ == "__main__":
    main()
