"""Carry the patch series from one torch base to another (a new torch release).

  start     lay out a workspace with the old base and its series, commit the new
            torch's pristine files on top of the old base, and rebase the series
            onto them (git's 3-way merge); stops at the first conflict
  continue  after resolving a conflict and ``git add``-ing the files in the
            workspace, go on with the rebase; stops at the next conflict. To
            leave a patch out instead (its premise does not exist in the new
            release), ``git rebase --skip`` it in the workspace, then continue,
            and give the reason under [series.omitted] in the new base.toml

When the rebase is through, the new base is written to patches/<version>/
(base.toml pinned by commit and per-file sha256, series, patches), ready for
tools/patches.py check --base <version>. Example::

    python tools/patches.py port start --to .venv-2.14.1/lib/python3.11/site-packages/torch
    # edit the conflicted files in .workspace/port-2.14.1, git add them, then
    python tools/patches.py port continue --dir .workspace/port-2.14.1

See CONTRIBUTING.md, "Adding a torch release".
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .common import (
    BASE_TAG,
    PATCHES,
    WORKSPACES,
    add_base_arguments,
    am_series,
    base_files,
    base_toml_tail,
    commit_base,
    copy_base_files,
    export_series,
    git,
    init_base_repo,
    log,
    patch_subjects,
    resolve_target,
    torch_at,
    vendor,
    write_base_toml,
)

STATE = "torch_fsdp_ext_port.json"


def _git_dir(ws: Path) -> Path:
    return ws / git(ws, "rev-parse", "--git-dir").stdout.strip()


def _state_path(ws: Path) -> Path:
    return _git_dir(ws) / STATE


def start(args: argparse.Namespace) -> None:
    source = resolve_target(args)
    to_root = torch_at(args.to)
    version = vendor.release(vendor.installed_torch_version(to_root))
    state = {
        "from": source.version,
        "to": version,
        "commit": vendor.torch_commit(to_root),
        "files": base_files(to_root),
    }
    if version == source.version:
        raise SystemExit(f"error: --to is torch {version}, the base being ported from")
    ws = args.dir or WORKSPACES / f"port-{version}"
    for path in (ws, PATCHES / version):
        if path.exists() and not args.force:
            raise SystemExit(f"error: {path} exists; pass --force to discard it and port again")
    if ws.exists():
        shutil.rmtree(ws)
    log.info("workspace %s: torch %s base + its series", ws, source.version)
    init_base_repo(ws, source)
    am_series(ws, vendor.read_series(source.pdir))
    old_tag = f"{BASE_TAG}-{source.version}"
    git(ws, "tag", old_tag, BASE_TAG)
    git(ws, "switch", "-q", "-c", f"torch-{version}", BASE_TAG)
    copy_base_files(ws, to_root, state["files"])
    commit_base(ws, version, state["commit"])
    git(ws, "tag", "-f", BASE_TAG)
    git(ws, "switch", "-q", "main")
    _state_path(ws).write_text(json.dumps(state, indent=2))
    log.info("rebasing the series onto torch %s (%s)", version, state["commit"][:12])
    proc = git(ws, "rebase", "--onto", BASE_TAG, old_tag, "main", check=False)
    _finish_or_stop(ws, proc.returncode)


def cont(args: argparse.Namespace) -> None:
    ws = args.dir
    if ws is None:
        candidates = sorted(WORKSPACES.glob("port-*"))
        if len(candidates) != 1:
            raise SystemExit(f"error: pass --dir, one of {[str(c) for c in candidates]}")
        ws = candidates[0]
    if not _state_path(ws).is_file():
        raise SystemExit(f"error: {ws} is not a port workspace; run tools/patches.py port start")
    unmerged = git(ws, "diff", "--name-only", "--diff-filter=U").stdout.split()
    if unmerged:
        raise SystemExit(f"error: resolve and git add these first: {unmerged}")
    markers = git(ws, "diff", "--cached", "--check", check=False).stdout.strip()
    if "conflict marker" in markers:
        raise SystemExit(f"error: conflict markers are still staged:\n{markers}")
    returncode = 0
    if _rebasing(ws):
        proc = git(ws, "-c", "core.editor=true", "rebase", "--continue", check=False)
        returncode = proc.returncode
    _finish_or_stop(ws, returncode)


def _rebasing(ws: Path) -> bool:
    return any((_git_dir(ws) / name).exists() for name in ("rebase-merge", "rebase-apply"))


def _finish_or_stop(ws: Path, returncode: int) -> None:
    state = json.loads(_state_path(ws).read_text())
    if _rebasing(ws):
        stopped_at = git(ws, "log", "-1", "--format=%s", "REBASE_HEAD", check=False).stdout.strip()
        unmerged = git(ws, "diff", "--name-only", "--diff-filter=U").stdout.split()
        raise SystemExit(
            f"conflict while carrying {stopped_at!r} to torch {state['to']}, in {unmerged}.\n"
            f"Resolve it in {ws} (keep the patch's intent on the new upstream code), "
            "`git add` the files, then:\n"
            f"    python tools/patches.py port continue --dir {ws}"
        )
    if returncode != 0:
        raise SystemExit(f"error: git rebase failed in {ws}; see `git status` there")
    pdir = PATCHES / state["to"]
    # What follows [files] (the reasons for patches left out with ``git rebase
    # --skip``, excluded requirements) is kept by a port again, and a new base
    # starts from the old base's: a patch it lacks stays out. A newly skipped
    # patch needs its reason added
    tail = base_toml_tail(pdir) or base_toml_tail(PATCHES / state["from"])
    write_base_toml(pdir, state["to"], state["commit"], state["files"], tail)
    omitted = vendor.read_base(pdir).omitted
    export_series(ws, pdir)
    to = state["to"]
    carried = set(patch_subjects(pdir))
    skipped = [
        s
        for s in patch_subjects(vendor.patches_dir(state["from"], PATCHES))
        if s not in carried and s not in omitted
    ]
    if skipped:
        log.warning(
            f"left out of patches/{to}: {skipped}. Add each to [series.omitted] in "
            f"patches/{to}/base.toml with the reason (tools/patches.py check fails until then)"
        )
    log.info(
        f"torch {to}: patches/{to} written. Next: python tools/patches.py check --base {to} "
        f"--torch <torch {to}>; add {to} to the torch range in pyproject.toml; "
        f"bash tools/setup_and_test.sh --base {to}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="port_command", required=True)
    p_start = sub.add_parser("start", help="begin a port (see above)")
    add_base_arguments(p_start)
    p_start.add_argument(
        "--to",
        type=Path,
        required=True,
        metavar="PATH",
        help="the new torch: a torch package directory or a torch wheel",
    )
    p_start.add_argument("--dir", type=Path, help="workspace (default: .workspace/port-<version>)")
    p_start.add_argument(
        "--force", action="store_true", help="replace an existing workspace and patches/<version>"
    )
    p_cont = sub.add_parser("continue", help="go on after resolving a conflict")
    p_cont.add_argument("--dir", type=Path, help="workspace (default: the only .workspace/port-*)")


def run(args: argparse.Namespace) -> None:
    (start if args.port_command == "start" else cont)(args)
