#!/usr/bin/env python3
"""Print the lines, Python calls and builtin calls run inside FSDP's own files
during one steady training step, per key: torch's own FSDP2, the package's
grouped mode and, where the package has it, its per-parameter mode.

The same measurement as ``test/package/test_call_counts.py`` (which requires
grouped mode to equal torch's in all three counters), from
``test/fsdp_ext_testing/call_counts.py``: single process over the fake process
group at world size 2, CPU, a 4-block MLP from seed 42 with ``fully_shard``
on each block then the root, SGD, two warm-up steps, then one step counted
with ``sys.settrace`` and ``sys.setprofile``, in code of a ``_fully_shard``
directory: executed lines (``'line'`` events, keyed by file name, qualified
name and the line's stripped text, so that a line moved by a patch still
matches), Python calls (``'call'`` events: a frame starting or a generator
resuming, generator expressions and lambdas included, keyed by file name and
qualified name) and builtin calls (``'c_call'`` events, keyed by the caller's
file name and qualified name and the builtin's name).

    python tools/probes/count_fsdp_calls.py --config fp32              # calls table
    python tools/probes/count_fsdp_calls.py --config accum --counter lines --differing
    python tools/probes/count_fsdp_calls.py --totals                   # every config
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

# The measurement shared with the tests (test/fsdp_ext_testing)
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "test"))
from fsdp_ext_testing.call_counts import (  # noqa: E402
    CONFIGS,
    COUNTERS,
    count_steady_step,
    format_key,
    implementations,
    init_fake_process_group,
)


def print_table(header: list[str], rows: list[list[str]], differing_column: int | None) -> None:
    """Left-aligned first column, the others right-aligned; `` *`` marks a row
    whose ``differing_column`` differs from the column before it."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        marker = (
            " *"
            if differing_column is not None
            and row is not header
            and row[differing_column] != row[differing_column - 1]
            else ""
        )
        print(
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
            + marker
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        choices=list(CONFIGS),
        default="fp32",
        help="what the step does: "
        + "; ".join(f"{name}: {config.description}" for name, config in CONFIGS.items())
        + " (default: fp32)",
    )
    parser.add_argument(
        "--counter",
        choices=COUNTERS,
        default="calls",
        help="the table to print: executed lines (file, function, text), Python calls "
        "(file, function) or builtin calls (calling file and function, builtin); "
        "the totals of all three follow it (default: calls)",
    )
    parser.add_argument(
        "--differing",
        action="store_true",
        help="only the keys whose grouped count differs from torch's",
    )
    parser.add_argument(
        "--totals",
        action="store_true",
        help="instead of a table, the totals of every counter in every config",
    )
    args = parser.parse_args()

    configs = list(CONFIGS) if args.totals else [args.config]
    init_fake_process_group()
    try:
        counts = {
            config: {
                name: count_steady_step(impl, CONFIGS[config])
                for name, impl in implementations().items()
            }
            for config in configs
        }
    finally:
        dist.destroy_process_group()

    names = list(counts[configs[0]])
    if args.totals:
        print("per steady step in _fully_shard; * grouped differs from torch")
        rows = [
            [
                f"{config} {counter}",
                *(str(counts[config][name].totals()[counter]) for name in names),
            ]
            for config in configs
            for counter in COUNTERS
        ]
        print_table(["config counter", *names], rows, differing_column=2)
        return 0

    step = counts[args.config]
    keys = sorted(set().union(*(step[name].counter(args.counter) for name in names)))
    if args.differing:
        keys = [
            key
            for key in keys
            if step["grouped"].counter(args.counter)[key]
            != step["torch"].counter(args.counter)[key]
        ]
    rows = [
        [format_key(key), *(str(step[name].counter(args.counter)[key]) for name in names)]
        for key in keys
    ]
    rows += [
        [f"total {counter}", *(str(step[name].totals()[counter]) for name in names)]
        for counter in COUNTERS
    ]
    print(f"config {args.config}: {CONFIGS[args.config].description}; {args.counter}")
    print_table([args.counter, *names], rows, differing_column=2)
    print("* grouped differs from torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
