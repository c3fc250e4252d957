"""The report: machine and load information, time ratios to upstream and to
grouped, the per-parameter targets and the markdown tables."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

import torch

from .measure import MiB
from .models import SWEEP_BATCH, SWEEP_TOTAL_NUMEL
from .modes import SWEEP_MODES

TARGET_COPY_FRACTION = 0.05
TARGET_RS_BUFFER_FRACTION = 0.9
TARGET_TIME_RATIO = 1.05
# Name prefixes of the models the copy, memory and step-time targets are
# checked on
TARGET_MODELS = ("llama", "mlp")
# FSDP's own time, per-param / grouped: at most this on every model, and at
# most the second on the Llama-like ones
TARGET_FSDP_RATIO = 1.0
TARGET_FSDP_RATIO_LLAMA = 0.85


def loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / (1 << 30), 1)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def add_ratios(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        for entry in [*run["models"], *run["sweep"]]:
            modes = entry["modes"]
            ref = modes.get("upstream", modes.get("grouped"))["step_time_s"]["median"]
            grouped = modes["grouped"]
            for stats in modes.values():
                median = stats["step_time_s"]["median"]
                stats["time_ratio_to_upstream"] = median / ref if "upstream" in modes else None
                stats["time_ratio_to_grouped"] = median / grouped["step_time_s"]["median"]
                stats["fsdp_ratio_to_grouped"] = (
                    stats["fsdp_time_s"]["median"] / grouped["fsdp_time_s"]["median"]
                )


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-parameter targets: FSDP's own time on every model; copies,
    memory and step time on the Llama-like models and mlp (the step-time
    target is stated for gloo at W=4)."""
    rows = []
    for run in runs:
        for entry in run["models"]:
            modes = entry["modes"]
            per_param, grouped = modes["per-param"], modes["grouped"]
            where = {"pg": run["pg"], "world_size": run["world_size"], "model": entry["model"]}
            llama = entry["model"].startswith("llama")
            fsdp_limit = TARGET_FSDP_RATIO_LLAMA if llama else TARGET_FSDP_RATIO
            rows.append(
                {
                    **where,
                    "target": f"per-param / grouped FSDP time <= {fsdp_limit}",
                    "value": per_param["fsdp_ratio_to_grouped"],
                    "limit": fsdp_limit,
                    "met": per_param["fsdp_ratio_to_grouped"] <= fsdp_limit,
                }
            )
            if not entry["model"].startswith(TARGET_MODELS):
                continue
            rs_buffer = max(entry["reduce_scatter_buffer_bytes"])
            copy_limit = TARGET_COPY_FRACTION * grouped["copy_bytes"]
            time_ratio = per_param["time_ratio_to_grouped"]
            rows += [
                {
                    **where,
                    "target": "per-param copy bytes <= 5% of grouped",
                    "value": per_param["copy_bytes"],
                    "limit": copy_limit,
                    "met": per_param["copy_bytes"] <= copy_limit,
                },
                {
                    **where,
                    "target": "per-param bwd peak <= grouped",
                    "value": per_param["bwd_peak_bytes"],
                    "limit": grouped["bwd_peak_bytes"],
                    "met": per_param["bwd_peak_bytes"] <= grouped["bwd_peak_bytes"],
                },
                {
                    **where,
                    "target": "per-param step time / grouped <= 1.05",
                    "value": time_ratio,
                    "limit": TARGET_TIME_RATIO,
                    "met": time_ratio <= TARGET_TIME_RATIO,
                },
            ]
            if per_param["reduce_peak_bytes"] is not None:
                # Grouped mode allocates its reduce-scatter output (1/W of the
                # buffer) after dropping the unsharded gradients; per-parameter
                # reduce-scatters read the gradients themselves, so their
                # output lives next to them: (1 - 1/W) of the buffer is what
                # per-param can save
                reachable = (1 - 1 / run["world_size"]) * rs_buffer
                limit = grouped["reduce_peak_bytes"] - TARGET_RS_BUFFER_FRACTION * reachable
                rows.append(
                    {
                        **where,
                        "target": "per-param reduce peak <= grouped - 0.9 x (1 - 1/W) x RS buffer",
                        "value": per_param["reduce_peak_bytes"],
                        "limit": limit,
                        "saving_in_rs_buffers": (
                            grouped["reduce_peak_bytes"] - per_param["reduce_peak_bytes"]
                        )
                        / rs_buffer,
                        "met": per_param["reduce_peak_bytes"] <= limit,
                    }
                )
    return rows


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.2f}"


def _ms(stats: dict[str, Any]) -> str:
    return f"{stats['median'] * 1e3:.1f} [{stats['q1'] * 1e3:.1f}-{stats['q3'] * 1e3:.1f}]"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    machine = meta["machine"]
    lines = [
        "# tools/bench results",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {machine.get('cpu_model', '?')}, {machine['cpus']} CPUs, "
        f"{machine.get('memory_gib', '?')} GiB, {machine['platform']}; torch {machine['torch']}"
        + (f"; GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else "")
        + ".",
        f"Load average at start / end: `{meta['loadavg_start']}` / `{meta['loadavg_end']}`. "
        f"Total {meta['wall_s']:.0f} s.",
        "",
        "Step time: median [quartiles] in ms over the timed steps of one training step "
        "(forward, backward, AdamW, zero_grad), the slowest rank per step. FSDP: FSDP's "
        "own time in that step, median [quartiles], the time inside its hooks less the "
        "process group's calls and waits made from them (bench/fsdp_time.py); PG: those "
        "calls and waits, median. Peaks: bytes allocated above the step's start, in "
        "forward, in backward, and inside FSDP's gradient reductions in backward (reduce; "
        "CPU only), where grouped mode's reduce-scatter buffer lives. Copies: bytes "
        "written by FSDP-side copy ops in one forward+backward; backend copies: those the "
        "process group dispatches when a collective completes (gloo's reduce-scatter "
        "copy-out). Collectives: ops issued / tensors / MiB of payload (all-gather outputs, "
        "reduce-scatter and all-to-all inputs) in one forward+backward.",
        "",
    ]
    for run in report["runs"]:
        lines += [
            f"## {run['pg']}, world size {run['world_size']} ({run['device']}, "
            f"mixed precision {run.get('mp', 'fp32')}, "
            f"{run['threads_per_rank']} thread(s) per rank, {run['warmup_steps']} warm-up + "
            f"{run['timed_steps']} timed steps, load {run['loadavg_start']})",
            "",
            "| model | mode | step ms | vs upstream | vs grouped | FSDP ms | FSDP vs grouped | "
            "PG ms | fwd / bwd / reduce peak MiB | copy MiB | backend copy MiB | "
            "collectives ops / tensors / MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for entry in run["models"]:
            for name, stats in entry["modes"].items():
                coll = stats["collectives"]
                lines.append(
                    f"| {entry['model']} | {name} | {_ms(stats['step_time_s'])} | "
                    f"{_ratio(stats['time_ratio_to_upstream'])} | "
                    f"{_ratio(stats['time_ratio_to_grouped'])} | "
                    f"{_ms(stats['fsdp_time_s'])} | {_ratio(stats['fsdp_ratio_to_grouped'])} | "
                    f"{stats['pg_time_s']['median'] * 1e3:.1f} | "
                    f"{_mib(stats['fwd_peak_bytes'])} / {_mib(stats['bwd_peak_bytes'])} / "
                    f"{_mib(stats['reduce_peak_bytes'])} | "
                    f"{_mib(stats['copy_bytes'])} | {_mib(stats['backend_copy_bytes'])} | "
                    f"{coll['ops']} / {coll['tensors']} / {_mib(coll['bytes'])} |"
                )
        if run["sweep"]:
            lines += [
                "",
                f"Sweep: one group of n square params, {SWEEP_TOTAL_NUMEL} elements in all, "
                f"batch {SWEEP_BATCH}; step ms median [quartiles] and ratio to grouped.",
                "",
                "| params per group | " + " | ".join(SWEEP_MODES) + " |",
                "|---|" + "---|" * len(SWEEP_MODES),
            ]
            for entry in run["sweep"]:
                cells = [
                    f"{_ms(entry['modes'][m]['step_time_s'])} "
                    f"(x{entry['modes'][m]['time_ratio_to_grouped']:.3f})"
                    for m in SWEEP_MODES
                ]
                lines.append(f"| {entry['config']['num_params']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Per-parameter targets",
        "",
        "| pg | W | model | target | value | limit | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in report["targets"]:
        if "bytes" in t["target"] or "peak" in t["target"]:
            value, limit = f"{_mib(t['value'])} MiB", f"{_mib(t['limit'])} MiB"
            if "saving_in_rs_buffers" in t:
                value += f" (saves {t['saving_in_rs_buffers']:.2f} RS buffers)"
        else:
            value, limit = f"{t['value']:.3f}", f"{t['limit']:.2f}"
        lines.append(
            f"| {t['pg']} | {t['world_size']} | {t['model']} | {t['target']} | {value} | "
            f"{limit} | {'yes' if t['met'] else 'NO'} |"
        )
    lines.append("")
    return "\n".join(lines)
