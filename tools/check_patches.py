#!/usr/bin/env python3
"""Check that patches/, the generated copy and the project tests agree.

Exits 0 only if all of these hold, and otherwise names the first failure and its fix:

1. the installed torch matches the pinned base (version and sha256 of every file);
2. the series applies cleanly (git am) to the pristine base files;
3. torch_fsdp_ext/_fully_shard/ equals base + series + rewrites;
4. every test/upstream/*.py equals, after import rewriting, its upstream-path
   copy in the series;
5. exporting the series again (git format-patch) reproduces patches/ byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import tempfile
from pathlib import Path

from _patchlib import (
    PATCHES,
    am_series,
    format_patches,
    init_base_repo,
    log,
    setup_logging,
    upstream_test_files,
    vendor,
)


def check(vendored_dir: Path) -> list[str]:
    errors = []
    base = vendor.read_base(PATCHES)
    vendor.check_upstream(vendor.torch_root(), base)
    log.info("ok: installed torch matches base %s (%s)", base.torch_version, base.commit[:12])

    series = vendor.read_series(PATCHES)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        init_base_repo(ws)
        am_series(ws, series)
        log.info("ok: %d patch(es) apply cleanly with git am", len(series))

        stale = vendor.diff(vendored_dir)
        if stale:
            errors.append(
                f"{vendored_dir} differs from base + series + rewrites in {stale}. "
                "Fix: python tools/vendor.py (never edit the generated copy by hand)"
            )
        else:
            log.info("ok: %s is base + series + rewrites", vendored_dir)

        for rel, text in upstream_test_files().items():
            path = ws / rel
            if not path.is_file() or path.read_text() != text:
                errors.append(
                    f"{rel} in the series differs from test/upstream/{path.name}. "
                    "Fix: tools/workspace.py sync-tests, commit, export"
                )
        orphans = sorted(
            str(p.relative_to(ws))
            for p in (ws / vendor.UPSTREAM_TEST_DIR).glob("test_*.py")
            if str(p.relative_to(ws)) not in upstream_test_files()
        )
        if orphans:
            errors.append(f"the series adds tests with no project source: {orphans}")
        if not errors:
            log.info("ok: upstream-path tests match test/upstream/")

        exported = Path(tmp) / "exported"
        new = format_patches(ws, exported)
        if [p.name for p in new] != [p.name for p in series]:
            errors.append(
                f"export renames the series: {[p.name for p in series]} -> {[p.name for p in new]}. "
                "Fix: tools/workspace.py export"
            )
        else:
            churn = [p.name for p in series if not filecmp.cmp(p, exported / p.name, shallow=False)]
            if churn:
                errors.append(
                    f"exporting again changes {churn}; patches/ was not produced by "
                    "tools/workspace.py export. Fix: init, export"
                )
            else:
                log.info("ok: export round trip is a no-op")
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vendored-dir",
        type=Path,
        default=vendor.VENDORED_DIR,
        help="generated copy to check (default: %(default)s)",
    )
    args = parser.parse_args()
    setup_logging()
    try:
        errors = check(args.vendored_dir)
    except vendor.VendorError as e:
        errors = [str(e)]
    for error in errors:
        log.error("FAIL: %s", error)
    raise SystemExit(1 if errors else 0)


if __name__ == "__main__":
    main()
