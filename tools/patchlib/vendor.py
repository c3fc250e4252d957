"""Regenerate torch_fsdp_ext/_fully_shard/ from the installed torch plus its series.

The output is deterministic and never edited by hand; see CONTRIBUTING.md. With
--base/--torch naming another torch, the copy goes to --dest (the package's own
copy must match the torch it imports).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_base_arguments, log, resolve_target, vendor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser)
    parser.add_argument(
        "--dest", type=Path, help=f"where to generate (default: {vendor.VENDORED_DIR})"
    )


def run(args: argparse.Namespace) -> None:
    target = resolve_target(args)
    if args.dest is None and not target.installed:
        raise vendor.VendorError(
            f"the package's copy must be generated from the installed torch, not "
            f"{target.root}. Fix: pass --dest, or run with the python of a venv "
            f"that has torch {target.version}"
        )
    dest = args.dest or vendor.VENDORED_DIR
    # The old tree is replaced whole: never a directory this tool did not make
    if dest.is_dir() and any(dest.iterdir()) and vendor.read_stamp(dest) is None:
        raise vendor.VendorError(
            f"{dest} is not empty and holds no {vendor.STAMP_NAME}; pass a new or empty --dest"
        )
    wrote = vendor.vendor(dest, target.root, target.pdir)
    log.info("%s %s (torch %s)", "regenerated" if wrote else "up to date:", dest, target.version)
