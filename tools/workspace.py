#!/usr/bin/env python3
"""Edit the patch series as git commits (quilt style).

  init        lay out a scratch git repo: pristine base files at upstream paths,
              tagged ``base``, with patches/series applied as commits (git am)
  sync-tests  write the upstream-path form of test/upstream/*.py into it
  export      regenerate patches/ from base..HEAD (git format-patch), then the
              vendored copy

See CONTRIBUTING.md for the full loop.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from _patchlib import (
    DEFAULT_WORKSPACE,
    PATCHES,
    am_series,
    format_patches,
    git,
    init_base_repo,
    log,
    setup_logging,
    upstream_test_files,
    vendor,
)


def init(ws: Path, force: bool) -> None:
    if ws.exists():
        if not force:
            raise SystemExit(f"{ws} exists; pass --force to discard it and start over")
        shutil.rmtree(ws)
    init_base_repo(ws)
    series = vendor.read_series(PATCHES)
    am_series(ws, series)
    log.info("workspace %s: base + %d patch(es); edit and commit there", ws, len(series))


def sync_tests(ws: Path) -> None:
    for rel, text in upstream_test_files().items():
        path = ws / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            log.info("updated %s", rel)
    log.info("commit the changes into the patch they belong to (git commit --fixup)")


def export(ws: Path) -> None:
    if git(ws, "status", "--porcelain").stdout.strip():
        raise SystemExit(f"{ws} has uncommitted changes; commit them first")
    with tempfile.TemporaryDirectory() as tmp:
        new = format_patches(ws, Path(tmp))
        for old in PATCHES.glob("*.patch"):
            old.unlink()
        for path in new:
            shutil.copyfile(path, PATCHES / path.name)
    header = "# Applied in order by tools/vendor.py and tools/apply_to_pytorch.py.\n"
    (PATCHES / "series").write_text(header + "".join(f"{p.name}\n" for p in new))
    log.info("exported %d patch(es) to %s", len(new), PATCHES)
    if vendor.vendor():
        log.info("regenerated %s", vendor.VENDORED_DIR)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["init", "sync-tests", "export"])
    parser.add_argument(
        "--dir", type=Path, default=DEFAULT_WORKSPACE, help="workspace (default: %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="init: replace an existing workspace")
    args = parser.parse_args()
    setup_logging()
    try:
        if args.command == "init":
            init(args.dir, args.force)
        elif args.command == "sync-tests":
            sync_tests(args.dir)
        else:
            export(args.dir)
    except vendor.VendorError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
