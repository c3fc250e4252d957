"""The command line: flags, the plan of runs they ask for (process groups,
world sizes, models, sweep, steps), and :func:`main`, which runs the plan and
writes the report (JSON, markdown, plots), or renders an earlier JSON again."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import bench
import torch_fsdp_ext

from .measure import RunConfig
from .models import MODELS
from .modes import MIXED_PRECISION, MODES
from .plots import render_plots
from .report import add_ratios, loadavg, machine_info, render_markdown, targets
from .runner import LOG_FORMAT, launch

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]

# few-large is the slowest model on gloo (its gloo collectives copy 32 MiB)
QUICK_MODELS = ["llama-S", "many-small", "few-large", "moe"]
QUICK_GLOO_MODELS = ["llama-S", "many-small"]
QUICK_SWEEP = [4, 64, 256]
FULL_SWEEP = [4, 16, 64, 256]


def _plan(args: argparse.Namespace) -> list[RunConfig]:
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU is available")
        gpus = torch.cuda.device_count()
        pgs = args.pg or (["nccl", "fake"] if gpus >= 2 else ["fake"])
    else:
        pgs = args.pg or ["gloo", "fake"]
    if "nccl" in pgs and args.device != "cuda":
        raise SystemExit("--pg nccl needs --device cuda")
    if "gloo" in pgs and args.device == "cuda":
        raise SystemExit("--pg gloo runs on CPU; use --device cpu")
    default_sizes = {
        "gloo": [2] if args.quick else [2, 4],
        "fake": [8],
        "nccl": [min(torch.cuda.device_count(), 8)] if args.device == "cuda" else [],
    }
    if args.quick:
        models, sweep, warmup, steps = QUICK_MODELS, QUICK_SWEEP, 1, 3
    else:
        models, sweep, warmup, steps = list(MODELS), FULL_SWEEP, 3, args.steps
    if args.models is not None:
        models = args.models
    if args.sweep is not None:
        sweep = args.sweep
    plan = []
    for pg in pgs:
        for world_size in args.world_size or default_sizes[pg]:
            if pg == "nccl" and world_size > torch.cuda.device_count():
                raise SystemExit(f"nccl W={world_size}: only {torch.cuda.device_count()} GPUs")
            run_models = (
                QUICK_GLOO_MODELS if args.quick and pg == "gloo" and args.models is None else models
            )
            if args.mp != "fp32" and "moe" in run_models:
                log.info("--mp %s: skipping moe (it runs in fp32 only)", args.mp)
                run_models = [name for name in run_models if name != "moe"]
            if "moe" in run_models and not hasattr(torch_fsdp_ext, "ShardPlacementResult"):
                log.info(
                    "torch %s: skipping moe (its series leaves out per-parameter meshes, "
                    "see patches/<version>/base.toml)",
                    torch.__version__,
                )
                run_models = [name for name in run_models if name != "moe"]
            skipped = [name for name in run_models if not MODELS[name].runs_at(world_size)]
            if skipped:
                log.info(
                    "%s W=%d: skipping %s (moe: ep=2 must divide W into efsdp >= 2 ranks)",
                    pg,
                    world_size,
                    ", ".join(skipped),
                )
            plan.append(
                RunConfig(
                    pg=pg,
                    world_size=world_size,
                    device=args.device,
                    models=[name for name in run_models if name not in skipped],
                    # Quick mode sweeps on the fake process group only
                    sweep=sweep if (not args.quick or pg == "fake" or args.sweep) else [],
                    warmup=warmup,
                    steps=steps,
                    threads=args.threads,
                    profile_dir=str(args.out / "profiles") if args.profile else None,
                    mp=args.mp,
                )
            )
    return plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/bench",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out", help="output folder")
    parser.add_argument("--json", type=Path, help="JSON path (default: OUT/bench.json)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"gloo W=2 ({', '.join(QUICK_GLOO_MODELS)}) and fake W=8 "
        f"({', '.join(QUICK_MODELS)}), 1 warm-up + 3 timed steps, sweep on fake only "
        "(under a minute on 2 cores)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--mp",
        choices=list(MIXED_PRECISION),
        default="fp32",
        help="mixed precision of the dense models: fp32, bf16 parameters with fp32 "
        "reduce_dtype, or bf16 parameters with reduce_dtype None (default: fp32; the "
        "moe model runs in fp32 only)",
    )
    parser.add_argument(
        "--pg",
        nargs="+",
        choices=["gloo", "fake", "nccl"],
        help="process groups (default: gloo and fake on cpu; nccl (>= 2 GPUs) and fake on cuda)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        help="world sizes for every process group (default: gloo 2 4, fake 8, nccl #GPUs)",
    )
    parser.add_argument(
        "--steps", type=int, default=15, help="timed steps per mode (full mode; >= 10)"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        help=f"models to run (default: all; --quick: {' '.join(QUICK_MODELS)}); moe runs "
        "where its ep of 2 leaves at least 2 efsdp ranks (W = 4, 6, 8, ...)",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        help="params per group of the sweep, none to skip it (default: "
        f"{' '.join(map(str, FULL_SWEEP))}; --quick: {' '.join(map(str, QUICK_SWEEP))}, "
        "on fake only)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per rank (default 1: on a loaded machine, OpenMP threads "
        "that spin-wait for a busy core make step times erratic)",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="measure nothing: render OUT/bench.md and the plots again from a bench JSON",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also write torch.profiler key_averages of one step per mode to OUT/profiles/",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot is not None:
        _write_report(json.loads(args.replot.read_text()), args.out)
        return
    json_path = args.json or args.out / "bench.json"
    command = " ".join(["tools/bench", *(sys.argv[1:] if argv is None else argv)])

    start = time.perf_counter()
    meta = {
        "command": command,
        "quick": args.quick,
        "machine": machine_info(args.device),
        "loadavg_start": loadavg(),
        "modes": [asdict(m) for m in MODES],
        "models": {name: asdict(spec) for name, spec in MODELS.items()},
        "notes": [
            "coalescing: per-param and deterministic are sharded with the device type's FSDP "
            "backend registered with comms that coalesce (FSDP's own on CUDA), "
            "per-param-nocoalesce with comms that go one by one "
            "(torch_fsdp_ext.register_fsdp_backend, fsdp_ext_testing.coalescing)",
            "moe: 2-D mesh (efsdp = W / ep, ep = 2); upstream shards each block's experts and "
            "then the block with torch.distributed.fsdp.fully_shard (on CPU summing, then "
            "dividing, as gloo has no PREMUL_SUM), the other modes each block once with "
            "expert parameters on the efsdp mesh; no targets",
            "collective bytes: all-gather output, reduce-scatter and all-to-all input, "
            "all-reduce tensors",
        ],
    }
    runs = [launch(cfg) for cfg in _plan(args)]
    add_ratios(runs)
    meta["loadavg_end"] = loadavg()
    meta["wall_s"] = time.perf_counter() - start
    report = {"meta": meta, "runs": runs, "targets": targets(runs)}

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    log.info("wrote %s", json_path)
    _write_report(report, args.out)


def _write_report(report: dict[str, Any], out: Path) -> None:
    markdown = render_markdown(report)
    (out / "bench.md").write_text(markdown)
    plots = render_plots(report, out)
    print(markdown)
    log.info("wrote %s, %s", out / "bench.md", ", ".join(map(str, plots)))
