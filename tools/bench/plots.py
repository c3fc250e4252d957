"""The plots (matplotlib, rendered without a display): step time, peak memory
and FSDP-side copy bytes per run, model and mode, and the sweep's step-time
ratio to grouped against the number of parameters per group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .measure import MiB
from .models import SWEEP_TOTAL_NUMEL
from .modes import MODES
from .report import TARGET_TIME_RATIO


def _mode_colors() -> dict[str, str]:
    return dict(
        zip(
            [m.name for m in MODES],
            ["#7f7f7f", "#1f77b4", "#2ca02c", "#98df8a", "#d62728"],
            strict=True,
        )
    )


def render_plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = _mode_colors()
    runs = report["runs"]
    model_names = list(dict.fromkeys(e["model"] for r in runs for e in r["models"]))
    paths = []

    def grid(title: str):
        fig, axes = plt.subplots(
            len(runs),
            len(model_names),
            figsize=(3.2 * len(model_names), 2.6 * len(runs) + 0.6),
            squeeze=False,
            constrained_layout=True,
        )
        fig.suptitle(title)
        return fig, axes

    def each_panel(axes):
        for row, run in enumerate(runs):
            entries = {e["model"]: e for e in run["models"]}
            for col, model in enumerate(model_names):
                ax = axes[row][col]
                ax.set_title(f"{run['pg']} W={run['world_size']}: {model}", fontsize=8)
                ax.tick_params(labelsize=7)
                if model not in entries:
                    ax.set_axis_off()
                    continue
                yield ax, entries[model]

    # Step time
    fig, axes = grid("Step time: median, whiskers = quartiles (ms)")
    for ax, entry in each_panel(axes):
        names = list(entry["modes"])
        med = [entry["modes"][n]["step_time_s"]["median"] * 1e3 for n in names]
        lo = [
            m - entry["modes"][n]["step_time_s"]["q1"] * 1e3
            for m, n in zip(med, names, strict=True)
        ]
        hi = [
            entry["modes"][n]["step_time_s"]["q3"] * 1e3 - m
            for m, n in zip(med, names, strict=True)
        ]
        ax.bar(range(len(names)), med, yerr=[lo, hi], color=[colors[n] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    paths.append(out / "time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Peak memory
    fig, axes = grid(
        "Peak bytes allocated above the step's start (MiB): forward (light), backward (dark)"
    )
    for ax, entry in each_panel(axes):
        names = list(entry["modes"])
        x = range(len(names))
        fwd = [entry["modes"][n]["fwd_peak_bytes"] / MiB for n in names]
        bwd = [entry["modes"][n]["bwd_peak_bytes"] / MiB for n in names]
        ax.bar([i - 0.2 for i in x], fwd, 0.4, color=[colors[n] for n in names], alpha=0.5)
        ax.bar([i + 0.2 for i in x], bwd, 0.4, color=[colors[n] for n in names])
        ax.set_xticks(list(x), names, rotation=40, ha="right")
    paths.append(out / "memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Copy bytes
    fig, axes = grid("FSDP-side copy bytes in one forward + backward (MiB)")
    for ax, entry in each_panel(axes):
        names = list(entry["modes"])
        bars = ax.bar(
            range(len(names)),
            [entry["modes"][n]["copy_bytes"] / MiB for n in names],
            color=[colors[n] for n in names],
        )
        ax.bar_label(bars, fmt="%.3g", fontsize=6)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    paths.append(out / "copies.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Sweep
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    styles = ["-", "--", ":", "-."]
    for k, run in enumerate(r for r in runs if r["sweep"]):
        xs = [e["config"]["num_params"] for e in run["sweep"]]
        for mode in ("per-param", "per-param-nocoalesce"):
            ys = [e["modes"][mode]["time_ratio_to_grouped"] for e in run["sweep"]]
            ax.plot(
                xs,
                ys,
                styles[k % len(styles)],
                marker="o",
                color=colors[mode],
                label=f"{mode}, {run['pg']} W={run['world_size']}",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(TARGET_TIME_RATIO, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel(f"params per group ({SWEEP_TOTAL_NUMEL} elements in all)")
    ax.set_ylabel("median step time / grouped")
    ax.set_title("Per-parameter vs grouped collectives")
    ax.legend(fontsize=7)
    paths.append(out / "sweep.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
