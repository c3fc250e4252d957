"""Shared plumbing for the patch tools: git workspaces over the pristine base files.

The tools must run when the generated copy is missing or stale, so they load
``torch_fsdp_ext/_vendor.py`` by path instead of importing the package (whose
``__init__`` refuses a stale copy).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
UPSTREAM_TESTS = REPO / "test" / "upstream"
DEFAULT_WORKSPACE = REPO / ".workspace"


def _load_vendor():
    spec = importlib.util.spec_from_file_location(
        "_torch_fsdp_ext_vendor", REPO / "torch_fsdp_ext" / "_vendor.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


vendor = _load_vendor()
log = logging.getLogger("torch_fsdp_ext.tools")

# Fixed identity and dates make the base commit, and therefore every exported
# patch, byte-for-byte reproducible.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "torch-fsdp-ext",
    "GIT_AUTHOR_EMAIL": "torch-fsdp-ext@users.noreply",
    "GIT_COMMITTER_NAME": "torch-fsdp-ext",
    "GIT_COMMITTER_EMAIL": "torch-fsdp-ext@users.noreply",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
    # A user's diff.noprefix or format.* settings must not change the export
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}
BASE_TAG = "base"


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")


def git(
    cwd: Path, *args: str, check: bool = True, reproducible: bool = True
) -> subprocess.CompletedProcess:
    env = {**os.environ, **_GIT_ENV} if reproducible else None
    proc = subprocess.run(
        ["git", "-c", "core.abbrev=12", "-c", "init.defaultBranch=main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if check and proc.returncode != 0:
        raise vendor.VendorError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr.strip()}")
    return proc


def init_base_repo(path: Path) -> None:
    """Create a git repo at ``path`` holding the pristine base files at upstream paths."""
    base = vendor.read_base(PATCHES)
    root = vendor.torch_root()
    vendor.check_upstream(root, base)
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for rel in base.files:
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root.parent / rel, path / rel)
    git(path, "add", "-A")
    git(
        path,
        "commit",
        "-q",
        "-m",
        f"torch {base.torch_version} base ({base.commit})\n\n"
        f"Pristine {vendor.UPSTREAM_DIR}/*.py at upstream commit {base.commit}.",
    )
    git(path, "tag", BASE_TAG)


def am_series(path: Path, patches: list[Path], *, reproducible: bool = True) -> None:
    """``git am`` the series onto the repo at ``path``; abort and explain on conflict.

    ``reproducible`` commits as the fixed tool identity (workspaces); otherwise the
    user's own git identity is used (a real pytorch checkout).
    """
    for patch in patches:
        args = ["am", "-q", "--keep-non-patch", str(patch)]
        if reproducible:
            args.insert(2, "--committer-date-is-author-date")
        proc = git(path, *args, check=False, reproducible=reproducible)
        if proc.returncode != 0:
            git(path, "am", "--abort", check=False, reproducible=reproducible)
            output = (proc.stdout + proc.stderr).strip()
            if "patch does not apply" not in output and "Patch failed" not in output:
                raise vendor.VendorError(f"git am {patch.name} failed:\n{output}")
            raise vendor.VendorError(
                f"{patch.name} does not apply:\n{output}\n"
                "Fix: rebuild the series with tools/workspace.py (see CONTRIBUTING.md)"
            )


def format_patches(path: Path, outdir: Path) -> list[Path]:
    """Export ``base..HEAD`` as a stable ``git format-patch`` series into ``outdir``."""
    proc = git(
        path,
        "format-patch",
        "--zero-commit",
        "--no-signature",
        "--no-numbered",
        "-o",
        str(outdir),
        f"{BASE_TAG}..HEAD",
    )
    return [Path(line) for line in proc.stdout.split()]


def upstream_test_files() -> dict[str, str]:
    """Upstream path -> expected content, for every project test that travels upstream."""
    return {
        f"{vendor.UPSTREAM_TEST_DIR}/{p.name}": vendor.rewrite_test(p.read_text())
        for p in sorted(UPSTREAM_TESTS.glob("test_*.py"))
    }
