"""Edit one base's patch series as git commits (quilt style).

  init        lay out a scratch git repo: the base's pristine files at upstream
              paths, tagged ``base``, with patches/<version>/series applied as
              commits (git am)
  sync-tests  write the upstream-path form of test/upstream/*.py into it
  format      reformat every commit of base..HEAD with PyTorch's ruff settings
              (tools/patchlib/pytorch_ruff.toml), leaving upstream's own lines as they
              are, and write the tests' project form back to test/upstream/
  export      regenerate patches/<version>/ from base..HEAD (git format-patch),
              then the vendored copy if the base is the installed torch

The base defaults to the installed torch; the workspace to .workspace/<version>.
See CONTRIBUTING.md for the full loop.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .common import (
    BASE_TAG,
    PATCHES,
    REPO,
    UPSTREAM_TESTS,
    Target,
    add_base_arguments,
    am_series,
    export_series,
    format_keeping_pristine,
    git,
    init_base_repo,
    log,
    project_form,
    resolve_target,
    upstream_test_files,
    vendor,
    workspace_dir,
)

# The hidden command ``format`` runs as git filter-branch's tree filter
FORMAT_TREE = "_format-tree"


def init(target: Target, ws: Path, force: bool) -> None:
    if ws.exists():
        if not force:
            raise SystemExit(f"{ws} exists; pass --force to discard it and start over")
        shutil.rmtree(ws)
    init_base_repo(ws, target)
    series = vendor.read_series(target.pdir)
    am_series(ws, series)
    log.info(
        "workspace %s: torch %s base + %d patch(es); edit and commit there",
        ws,
        target.version,
        len(series),
    )


def sync_tests(target: Target, ws: Path) -> None:
    # A test that a patch the base leaves out creates is neither carried nor run there
    omitted = vendor.omitted_tests(target.version, PATCHES)
    for rel, text in upstream_test_files(target.version).items():
        if rel in omitted:
            continue
        path = ws / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            log.info("updated %s", rel)
    log.info("commit the changes into the patch they belong to (git commit --fixup)")


def format_tree() -> None:
    """The tree filter of ``format``: runs in a checkout of one commit."""
    commit = os.environ["GIT_COMMIT"]
    cwd = Path.cwd()
    changed = git(cwd, "diff-tree", "-r", "--name-only", "--diff-filter=AM", BASE_TAG, commit)
    for path in (p for p in changed.stdout.split() if p.endswith(".py")):
        pristine = git(cwd, "show", f"{BASE_TAG}:{path}", check=False)
        text = (cwd / path).read_text()
        new = format_keeping_pristine(
            text, pristine.stdout if pristine.returncode == 0 else None, path
        )
        if new != text:
            (cwd / path).write_text(new)


def format_series(ws: Path, version: str) -> None:
    if git(ws, "status", "--porcelain").stdout.strip():
        raise vendor.VendorError(f"{ws} has uncommitted changes; commit them first")
    command = REPO / "tools" / "patches.py"
    tree_filter = f"{shlex.quote(sys.executable)} {shlex.quote(str(command))} {FORMAT_TREE}"
    subprocess.run(
        ["git", "filter-branch", "-f", "--tree-filter", tree_filter, f"{BASE_TAG}..HEAD"],
        cwd=ws,
        env={**os.environ, "FILTER_BRANCH_SQUELCH_WARNING": "1"},
        check=True,
        capture_output=True,
    )
    # The project form of the formatted tests (imports from torch_fsdp_ext),
    # into the base's own version of a test where it has one
    for path in sorted((ws / vendor.UPSTREAM_TEST_DIR).glob("test_*.py")):
        for source in (UPSTREAM_TESTS / version / path.name, UPSTREAM_TESTS / path.name):
            if source.exists():
                source.write_text(project_form(path.read_text()))
                break
    log.info("formatted base..HEAD in %s and test/upstream/; export next", ws)


def export(target: Target, ws: Path) -> None:
    export_series(ws, target.pdir)
    if not target.installed:
        log.info("the installed torch is not %s: the vendored copy is left alone", target.version)
    elif vendor.vendor(vendor.VENDORED_DIR, target.root, target.pdir):
        log.info("regenerated %s", vendor.VENDORED_DIR)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("command", choices=["init", "sync-tests", "format", "export"])
    add_base_arguments(parser)
    parser.add_argument(
        "--dir", type=Path, help="workspace (default: .workspace/<version> in the repository)"
    )
    parser.add_argument("--force", action="store_true", help="init: replace an existing workspace")


def run(args: argparse.Namespace) -> None:
    target = resolve_target(args)
    ws = args.dir or workspace_dir(target.version)
    if args.command == "init":
        init(target, ws, args.force)
    elif args.command == "sync-tests":
        sync_tests(target, ws)
    elif args.command == "format":
        format_series(ws, target.version)
    else:
        export(target, ws)
