"""Check that patches/, the generated copy and the project tests agree.

Exits 0 only if all of these hold, and otherwise names each failure and its fix.
For every base in patches/ (no torch needed):

1. its series has the same patch subjects, in the same order, as the primary base's,
   except those its base.toml lists under [series.omitted], each with a reason
   (a port to a release that lacks a patch's premise; never the primary base);
2. the tests its series adds equal test/upstream/*.py after import rewriting
   (or test/upstream/<version>/*.py where a base has its own); the tests that
   an omitted patch creates are not required.

For the chosen base (--base/--torch, default the installed torch):

3. the torch matches the pinned base (version and sha256 of every file);
4. the series applies cleanly (git am) to the pristine base files;
5. torch_fsdp_ext/_fully_shard/ equals base + series + rewrites (installed torch only);
6. exporting the series again (git format-patch) reproduces it byte for byte;
7. every file the series touches passes PyTorch's ruff lint and format
   (tools/patchlib/pytorch_ruff.toml) with no finding its pristine file lacks;
8. the installed torch with the series in place (a hard-linked copy) imports,
   and ``torch.distributed.fsdp`` exports every name of ``_fully_shard.__all__``
   as its own (``__all__`` and ``__module__``), as upstream does (installed
   torch only).

It also prints the churn: lines one patch adds that a later one changes again.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import (
    BASE_TAG,
    PATCHES,
    Target,
    add_base_arguments,
    am_series,
    churn,
    format_patches,
    git,
    init_base_repo,
    lint_errors,
    log,
    patch_subjects,
    resolve_target,
    series_test_files,
    torch_tree,
    upstream_test_files,
    vendor,
)


def check_bases_agree() -> list[str]:
    errors = []
    primary = vendor.primary_version(PATCHES)
    want = patch_subjects(vendor.patches_dir(primary, PATCHES))
    omitted_anywhere = False
    for version in vendor.supported_versions(PATCHES):
        pdir = vendor.patches_dir(version, PATCHES)
        base = vendor.read_base(pdir)
        if base.torch_version != version:
            errors.append(
                f"patches/{version}/base.toml pins torch {base.torch_version}; rename one of them"
            )
        omitted = base.omitted
        omitted_anywhere = omitted_anywhere or bool(omitted)
        if omitted and version == primary:
            errors.append(
                f"patches/{version} is the primary base and omits {sorted(omitted)}: the "
                "primary base carries every patch. Fix: remove [series.omitted] from its base.toml"
            )
        if unknown := sorted(omitted.keys() - set(want)):
            errors.append(
                f"patches/{version}/base.toml omits {unknown}, which the primary base "
                f"patches/{primary} does not have. Fix: use the primary base's subjects"
            )
        if no_reason := sorted(s for s, reason in omitted.items() if not reason.strip()):
            errors.append(
                f"patches/{version}/base.toml omits {no_reason} without a reason. Fix: say "
                "why the patch does not apply to this release"
            )
        carried = [s for s in want if s not in omitted]
        have = patch_subjects(pdir)
        if have != carried:
            for subject in (s for s in carried if s not in have):
                errors.append(
                    f"patches/{version} lacks the primary base's patch {subject!r} and "
                    f"gives no reason. Fix: carry it, or, if its premise does not exist in "
                    f"torch {version}, list it with the reason under [series.omitted] in "
                    f"patches/{version}/base.toml"
                )
            errors.append(
                f"patches/{version} has other patch subjects than the primary base "
                f"patches/{primary} carries less the omitted ones: {have} != {carried}. "
                'Fix: carry the change to every base (CONTRIBUTING.md, "Carrying a change '
                'to every base")'
            )
        try:
            rfc = vendor.rfc_stack_length(pdir, PATCHES)
            log.info(
                "patches/%s: the RFC stack is patches 1-%d, the follow-ups %d-%d",
                version,
                rfc,
                rfc + 1,
                len(have),
            )
        except vendor.VendorError as e:
            errors.append(str(e))
        tests = upstream_test_files(version)
        in_series = series_test_files(pdir)
        not_required = vendor.omitted_tests(version, PATCHES) if omitted else {}
        for rel in sorted(tests.keys() | in_series.keys()):
            if rel not in in_series and rel in not_required:
                continue
            if rel not in in_series:
                errors.append(
                    f"patches/{version} lacks {rel}. "
                    f"Fix: tools/patches.py workspace sync-tests --base {version}, commit, export"
                )
            elif rel not in tests:
                errors.append(
                    f"patches/{version} adds {rel}, which has no project source. Fix: add it "
                    "to test/upstream/, or drop it from the series (tools/patches.py workspace)"
                )
            elif in_series[rel] != tests[rel]:
                errors.append(
                    f"{rel} in patches/{version} differs from its project source in "
                    "test/upstream/. Fix: tools/patches.py workspace sync-tests --base "
                    f"{version}, commit, export"
                )
    unknown = sorted(
        {b for rw in vendor.REWRITES for b in rw.bases or ()}
        - set(vendor.supported_versions(PATCHES))
    )
    if unknown:
        errors.append(f"REWRITES name bases with no series: {unknown}")
    if not errors:
        log.info(
            "ok: bases %s carry the same %d patch subjects and upstream tests%s",
            ", ".join(vendor.supported_versions(PATCHES)),
            len(want),
            " (less each base's [series.omitted], with reasons)" if omitted_anywhere else "",
        )
    return errors


# Run by the torch copy's own python: what upstream's CI first does with the PR
IN_TREE_PROBE = """
import sys
import torch.distributed.fsdp as fsdp
from torch.distributed.fsdp import _fully_shard
assert fsdp.__file__.startswith(sys.argv[1]), fsdp.__file__
print([
    name
    for name in _fully_shard.__all__
    if name not in fsdp.__all__
    or getattr(fsdp, name).__module__ != "torch.distributed.fsdp"
])
"""


def check_in_tree(torch_root: Path, ws: Path) -> list[str]:
    """Import ``torch.distributed.fsdp`` from a copy of the installed torch
    with ``ws``'s ``HEAD`` in place; the names it does not export as its own."""
    paths = git(ws, "diff", "--name-only", "--diff-filter=AM", BASE_TAG, "HEAD", "--", "torch/")
    files = {path: git(ws, "show", f"HEAD:{path}").stdout for path in paths.stdout.split()}
    with tempfile.TemporaryDirectory(prefix="torch_fsdp_ext-in-tree-") as tmp:
        torch_tree(torch_root, Path(tmp), files)
        proc = subprocess.run(
            [sys.executable, "-c", IN_TREE_PROBE, tmp],
            cwd=tmp,
            env={**os.environ, "PYTHONPATH": tmp},
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        return [f"torch with the series in place fails to import:\n{proc.stderr.strip()[-2000:]}"]
    if (unexported := proc.stdout.strip()) != "[]":
        return [
            f"torch.distributed.fsdp does not export {unexported} of _fully_shard.__all__ "
            "(its import, __all__ and __module__ lines). Fix: the patch that adds the name"
        ]
    log.info(
        "ok: torch with the series in place imports; torch.distributed.fsdp exports _fully_shard's names"
    )
    return []


def check_base(target: Target, vendored_dir: Path) -> list[str]:
    errors = []
    base = vendor.read_base(target.pdir)
    vendor.check_upstream(target.root, base)
    log.info(
        "ok: torch at %s matches base %s (%s)", target.root, base.torch_version, base.commit[:12]
    )

    series = vendor.read_series(target.pdir)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        init_base_repo(ws, target)
        am_series(ws, series)
        log.info("ok: %d patch(es) apply cleanly with git am", len(series))

        if not target.installed:
            log.info("skipped: the generated copy is checked against the installed torch only")
        elif stale := vendor.diff(vendored_dir, target.root, target.pdir):
            errors.append(
                f"{vendored_dir} differs from base + series + rewrites in {stale}. "
                "Fix: python tools/patches.py vendor (never edit the generated copy by hand)"
            )
        else:
            log.info("ok: %s is base + series + rewrites", vendored_dir)

        exported = Path(tmp) / "exported"
        new = format_patches(ws, exported)
        if [p.name for p in new] != [p.name for p in series]:
            errors.append(
                f"export renames the series: {[p.name for p in series]} -> {[p.name for p in new]}. "
                "Fix: tools/patches.py workspace export"
            )
        else:
            changed = [
                p.name for p in series if not filecmp.cmp(p, exported / p.name, shallow=False)
            ]
            if changed:
                errors.append(
                    f"exporting again changes {changed}; patches/{target.version} was not produced "
                    "by tools/patches.py workspace export. Fix: workspace init, export"
                )
            else:
                log.info("ok: export round trip is a no-op")

        if lint := lint_errors(ws):
            errors += lint
        else:
            log.info("ok: PyTorch's ruff lint and format find nothing the pristine files lack")

        if target.installed:
            errors += check_in_tree(target.root, ws)

        counts = churn(ws)
        for (k, j), n in sorted(counts.items()):
            log.info(
                "churn: %d line(s) of %s changed again by %s",
                n,
                series[k - 1].name,
                series[j - 1].name,
            )
        log.info("churn: %d line(s) in all", sum(counts.values()))
    return errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_base_arguments(parser)
    parser.add_argument(
        "--vendored-dir",
        type=Path,
        default=vendor.VENDORED_DIR,
        help="generated copy to check (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    errors = []
    try:
        errors += check_bases_agree()
    except vendor.VendorError as e:
        errors.append(str(e))
    try:
        errors += check_base(resolve_target(args), args.vendored_dir)
    except vendor.VendorError as e:
        errors.append(str(e))
    for error in errors:
        log.error("FAIL: %s", error)
    return 1 if errors else 0
