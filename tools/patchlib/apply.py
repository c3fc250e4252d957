"""Apply a base's series to a pytorch checkout with git am, ready to push as a PR branch.

The checkout's torch/distributed/fsdp/_fully_shard/*.py must be that base
(checked by sha256); a HEAD other than the base commit is reported, not refused,
so the series can also be tried on a later main. --base defaults to the
installed torch's release; the upstream PR uses the primary base in
patches/bases.toml.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import PATCHES, add_base_arguments, am_series, checked_base, git, log, vendor


def apply(checkout: Path, version: str) -> None:
    pdir = vendor.patches_dir(version, PATCHES)
    base = vendor.read_base(pdir)
    if git(checkout, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise vendor.VendorError(f"{checkout} has uncommitted changes; commit or stash them")
    changed = [
        rel
        for rel, digest in base.files.items()
        if not (checkout / rel).is_file() or vendor.sha256((checkout / rel).read_bytes()) != digest
    ]
    if changed:
        raise vendor.VendorError(
            f"{checkout} is not at the base (torch {base.torch_version}): {changed} differ. "
            f"Fix: git checkout {base.commit}"
        )
    head = git(checkout, "rev-parse", "HEAD").stdout.strip()
    if head != base.commit:
        log.warning("note: HEAD is %s, not the base commit %s", head[:12], base.commit[:12])
    series = vendor.read_series(pdir)
    am_series(checkout, series, reproducible=False)
    log.info("applied %d patch(es) to %s", len(series), checkout)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkout", type=Path, help="path to a pytorch git checkout")
    add_base_arguments(parser, torch=False)


def run(args: argparse.Namespace) -> None:
    apply(args.checkout, checked_base(args.base) or vendor.installed_release())
