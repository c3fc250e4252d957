#!/usr/bin/env python3
"""Print the Python calls made inside FSDP's own files during one steady
training step, per function: torch's own FSDP2, the package's grouped mode
and, where the package has it, its per-parameter mode.

The same measurement as ``test/package/test_call_counts.py`` (which requires
grouped mode to equal torch's, function by function), from
``test/fsdp_ext_testing/call_counts.py``: single process over the fake process
group at world size 2, CPU, a 4-block MLP from seed 42 with ``fully_shard``
on each block then the root, SGD, two warm-up steps, then one step counted
with ``sys.setprofile``; every ``'call'`` event (a frame starting or a
generator resuming; generator expressions and lambdas included) of code in a
``_fully_shard`` directory, keyed by file name and qualified name.

    python tools/probes/count_fsdp_calls.py --config fp32
    python tools/probes/count_fsdp_calls.py --config accum --differing
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
    count_steady_step_calls,
    format_key,
    implementations,
    init_fake_process_group,
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
        "--differing",
        action="store_true",
        help="only the functions whose grouped count differs from torch's",
    )
    args = parser.parse_args()

    init_fake_process_group()
    try:
        counts = {
            name: count_steady_step_calls(impl, CONFIGS[args.config])
            for name, impl in implementations().items()
        }
    finally:
        dist.destroy_process_group()

    names = list(counts)
    keys = sorted(set().union(*counts.values()))
    if args.differing:
        keys = [key for key in keys if counts["grouped"][key] != counts["torch"][key]]
    rows = [[format_key(key), *(str(counts[name][key]) for name in names)] for key in keys]
    rows.append(["total", *(str(counts[name].total()) for name in names)])
    header = ["function", *names]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print(f"config {args.config}: {CONFIGS[args.config].description}")
    for row in [header, *rows]:
        marker = " *" if row[0] != "total" and row in rows and row[2] != row[1] else ""
        print(
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
            + marker
        )
    print("* grouped differs from torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
