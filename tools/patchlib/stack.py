"""Check that every patch of the series passes its tests and PyTorch's lint at its position.

For each prefix 0001..k of the installed torch's series (or --base/--torch),
this applies the prefix to the pristine base files, generates a throwaway copy
of ``_fully_shard`` from them (the package's own rewrites), and runs the
upstream-path tests that exist at that position (their form in the series,
imports rewritten back to the package) against it, as the upstream PR's CI
would after each commit, and checks the files touched so far with PyTorch's
ruff settings (as ``check`` does for the whole series). A stand-in
``torch_fsdp_ext`` exports only the generated ``_fully_shard``, since the
package's own extras need the whole series. The package tests in
``PACKAGE_TESTS``, which need of the package only what the stand-in exports,
run at every position too (with ``test/`` on the path, for
``fsdp_ext_testing``). Exits 0 only if every position passes; names the
first patch whose tests fail otherwise. It says when the RFC stack
(patches/bases.toml's ``rfc_stack_last``) has passed on its own.

    python tools/patches.py stack              # every position (about 2 minutes)
    python tools/patches.py stack --from 5     # positions 5..N only
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import (
    REPO,
    add_base_arguments,
    lint_files,
    log,
    project_form,
    resolve_target,
    vendor,
)

TEST_DIR = Path(vendor.UPSTREAM_TEST_DIR)
# The stand-in package: what the generated copy imports besides itself
STAND_IN_INIT = '''"""Stand-in torch_fsdp_ext for tools/patches.py stack: the generated copy only
(and the test utility generated from the series, once a patch adds it)."""

from ._fully_shard import *  # noqa: F403
from ._fully_shard import __all__  # noqa: F401
'''
STAND_IN_MODULES = ("_upstream_types.py",)
# Package tests that use of the package only the stand-in's exports, run at
# every position: grouped mode makes torch's own Python calls at each one
PACKAGE_TESTS = (REPO / "test" / "package" / "test_call_counts.py",)


def lay_out(
    root: Path, pdir: Path, position: int, tmp: Path
) -> tuple[list[Path], dict[str, tuple[str, str | None]]]:
    """Writes the stand-in package and the tests at ``position`` under ``tmp``;
    returns the test files, and every file the prefix touches in its upstream
    form with its pristine text (``None`` for a new file)."""
    prefix = tmp / "patches" / pdir.name
    prefix.mkdir(parents=True)
    shutil.copyfile(pdir / "base.toml", prefix / "base.toml")
    patches = vendor.read_series(pdir)[:position]
    for patch in patches:
        shutil.copyfile(patch, prefix / patch.name)
    (prefix / "series").write_text("".join(f"{p.name}\n" for p in patches))
    work = tmp / "work"
    vendor.apply_series(root, prefix, work)
    package = tmp / "site" / vendor.PACKAGE
    (package / vendor.VENDORED_NAME).mkdir(parents=True)
    version = vendor.read_base(pdir).torch_version
    touched: dict[str, tuple[str, str | None]] = {}
    for path in sorted((work / vendor.UPSTREAM_DIR).glob("*.py")):
        text = vendor.rewrite(path.name, path.read_text(), version)
        (package / vendor.VENDORED_NAME / path.name).write_text(text)
    init = STAND_IN_INIT
    for name, text in vendor.test_utility(work).items():
        (package / vendor.VENDORED_NAME / name).write_text(text)
        init += f"from ._fully_shard.{name[:-3]} import {vendor.TEST_UTILITY_CLASS}  # noqa: F401\n"
    for rel in vendor.upstream_files(work):
        pristine = root.parent / rel
        upstream = (work / rel).read_text()
        if not pristine.exists() or pristine.read_text() != upstream:
            touched[rel] = (upstream, pristine.read_text() if pristine.exists() else None)
    (package / "__init__.py").write_text(init)
    for name in STAND_IN_MODULES:
        shutil.copyfile(REPO / vendor.PACKAGE / name, package / name)
    tests = []
    for path in sorted((work / TEST_DIR).glob("test_*.py")):
        touched[str(TEST_DIR / path.name)] = (path.read_text(), None)
        dest = tmp / "tests" / path.name
        dest.parent.mkdir(exist_ok=True)
        dest.write_text(project_form(path.read_text()))
        tests.append(dest)
    for path in PACKAGE_TESTS:
        dest = tmp / "tests" / path.name
        dest.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, dest)
        tests.append(dest)
    return tests, touched


def run_position(root: Path, pdir: Path, position: int, pytest_args: list[str]) -> bool:
    patch = vendor.read_series(pdir)[position - 1]
    with tempfile.TemporaryDirectory(prefix="check_stack-") as tmp:
        tests, touched = lay_out(root, pdir, position, Path(tmp))
        # Each PR of the stack must pass upstream's lint on its own
        if lint := lint_files(touched):
            log.error("%s: %s", patch.name, "\n".join(lint))
            return False
        if not tests:
            log.info("%s: no upstream-path tests yet", patch.name)
            return True
        site_and_helpers = [str(Path(tmp) / "site"), str(REPO / "test")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(site_and_helpers)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
        proc = subprocess.run(
            [*cmd, *map(str, tests)], cwd=tmp, env=env, capture_output=True, text=True
        )
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    log.info("%s: %s", patch.name, summary)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:] + proc.stderr[-2000:])
    return proc.returncode == 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser)
    parser.add_argument(
        "--from", dest="start", type=int, default=1, help="first position to check (1-based)"
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")


def run(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    vendor.check_upstream(target.root, vendor.read_base(target.pdir))
    count = len(vendor.read_series(target.pdir))
    rfc = vendor.rfc_stack_length(target.pdir)
    for position in range(args.start, count + 1):
        if not run_position(target.root, target.pdir, position, args.pytest_args):
            log.error(
                "tests fail at position %d of patches/%s: fix that patch in its workspace "
                "(CONTRIBUTING.md, the loop) and export",
                position,
                target.version,
            )
            return 1
        if position == rfc:
            log.info("ok: the RFC stack (patches 1-%d) passes on its own", rfc)
    log.info(
        "ok: every position of patches/%s passes its tests (follow-ups %d-%d on top)",
        target.version,
        rfc + 1,
        count,
    )
    return 0
