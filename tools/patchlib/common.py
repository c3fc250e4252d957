"""The library every ``tools/patches.py`` command shares: git workspaces over
the pristine base files, targets (``--base``/``--torch``), export, lint, churn.

The commands must run when the generated copy is missing or stale, so this
loads ``torch_fsdp_ext/_vendor.py`` by path instead of importing the package
(whose ``__init__`` refuses a stale copy).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import difflib
import importlib.util
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
UPSTREAM_TESTS = REPO / "test" / "upstream"
WORKSPACES = REPO / ".workspace"
# PyTorch's own ruff settings: what the series' files must pass upstream
PYTORCH_RUFF = Path(__file__).resolve().parent / "pytorch_ruff.toml"


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


@dataclass(frozen=True)
class Target:
    """One base to work on: its series and a torch holding its pristine files."""

    version: str
    pdir: Path
    root: Path  # a torch package directory
    installed: bool  # ``root`` is the torch this interpreter imports


def torch_from_wheel(wheel: Path) -> Path:
    """Extract what the tools read from a torch wheel (``version.py``, the
    ``_fully_shard`` files and ``vendor.OUTSIDE_FILES``) into a temporary
    directory; return its ``torch/``."""
    tmp = Path(tempfile.mkdtemp(prefix="torch_fsdp_ext-wheel-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        wanted = [
            name
            for name in zf.namelist()
            if name in ("torch/version.py", *vendor.OUTSIDE_FILES)
            or (name.startswith(f"{vendor.UPSTREAM_DIR}/") and name.endswith(".py"))
        ]
        if "torch/version.py" not in wanted:
            raise vendor.VendorError(f"{wheel} is not a torch wheel (no torch/version.py)")
        zf.extractall(tmp, wanted)
    return tmp / "torch"


def torch_tree(torch_dir: Path, root: Path, files: dict[str, str]) -> None:
    """A copy of the torch package at ``torch_dir`` under ``root/torch`` (hard
    links, so it costs no data) with ``files`` (upstream path -> text) written in."""

    def link(src: str, dst: str) -> None:
        try:
            Path(dst).hardlink_to(src)
        except OSError:
            shutil.copy2(src, dst)

    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(torch_dir, root / "torch", copy_function=link, symlinks=True, ignore=ignore)
    for rel, text in files.items():
        path = root / rel
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def torch_at(path: Path) -> Path:
    """A torch package directory given as itself, its site-packages, or a wheel."""
    if path.suffix == ".whl":
        return torch_from_wheel(path)
    for root in (path, path / "torch"):
        if (root / "version.py").is_file():
            return root
    raise vendor.VendorError(f"no torch at {path}: pass a torch package directory or wheel")


def add_base_arguments(parser: argparse.ArgumentParser, *, torch: bool = True) -> None:
    """``--base VERSION`` and, with ``torch``, ``--torch PATH`` (see :func:`resolve_target`)."""
    default = "that of --torch, else the installed torch" if torch else "the installed torch"
    parser.add_argument(
        "--base",
        metavar="VERSION",
        help=f"torch release whose series to use (default: {default}); one of "
        f"{', '.join(vendor.supported_versions(PATCHES))}",
    )
    if torch:
        parser.add_argument(
            "--torch",
            type=Path,
            metavar="PATH",
            help="where the base's pristine files come from: a torch package directory "
            "or a torch wheel (default: the installed torch)",
        )


def resolve_target(args: argparse.Namespace) -> Target:
    """The base named by ``--base``/``--torch``; the installed torch by default."""
    installed = vendor.torch_root() if args.torch is None else None
    root = installed or torch_at(args.torch)
    have = vendor.release(vendor.installed_torch_version(root))
    version = checked_base(args.base) or have
    pdir = vendor.patches_dir(version, PATCHES)
    if have != version:
        raise vendor.VendorError(
            f"--base {version} needs the pristine files of torch {version}, but the torch "
            f"at {root} is {have}. Fix: pass --torch with a torch {version} package "
            f"directory or wheel (pip download torch=={version} --no-deps), or run this "
            f"tool with the python of a venv that has torch {version}"
        )
    return Target(version, pdir, root, installed is not None)


def checked_base(version: str | None) -> str | None:
    """``version`` if it has a series (or None); otherwise exit naming the supported ones."""
    supported = vendor.supported_versions(PATCHES)
    if version is not None and version not in supported:
        raise vendor.VendorError(f"--base {version}: no series; one of {', '.join(supported)}")
    return version


def workspace_dir(version: str) -> Path:
    """The default workspace of a base."""
    return WORKSPACES / version


def copy_base_files(path: Path, root: Path, files: dict[str, str]) -> None:
    """Replace the upstream files in the repo at ``path`` with ``root``'s."""
    for old in (path / vendor.UPSTREAM_DIR).glob("*.py"):
        old.unlink()
    for rel in files:
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root.parent / rel, path / rel)


def commit_base(path: Path, version: str, commit: str) -> None:
    """Commit the working tree of ``path`` as the pristine files of torch ``version``."""
    git(path, "add", "-A")
    git(
        path,
        "commit",
        "-q",
        "-m",
        f"torch {version} base ({commit})\n\n"
        f"Pristine {vendor.UPSTREAM_DIR}/*.py and {', '.join(vendor.OUTSIDE_FILES)} "
        f"at upstream commit {commit}.",
    )


def init_base_repo(path: Path, target: Target) -> None:
    """Create a git repo at ``path`` holding the pristine base files at upstream paths."""
    base = vendor.read_base(target.pdir)
    vendor.check_upstream(target.root, base)
    path.mkdir(parents=True)
    git(path, "init", "-q")
    copy_base_files(path, target.root, base.files)
    commit_base(path, base.torch_version, base.commit)
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
                "Fix: rebuild the series with tools/patches.py workspace (see CONTRIBUTING.md)"
            )


def base_files(root: Path) -> dict[str, str]:
    """Upstream path -> sha256 of every ``_fully_shard`` file of the torch at
    ``root``, and of ``vendor.OUTSIDE_FILES``."""
    return {
        rel: vendor.sha256((root.parent / rel).read_bytes())
        for rel in vendor.upstream_files(root.parent)
    }


def write_base_toml(
    pdir: Path, version: str, commit: str, files: dict[str, str], tail: str = ""
) -> None:
    """Write ``base.toml``; ``tail`` (e.g. the ``[series.omitted]`` and
    ``[requirements.exclude]`` tables) goes after ``[files]`` as it is."""
    lines = [
        "# The pinned upstream base of this series. Everything generated from it is",
        '# checked against these files (see CONTRIBUTING.md, "Adding a torch release").',
        "",
        "[torch]",
        f'version = "{version}"',
        f'commit = "{commit}"',
        "",
        f"# sha256 of every {vendor.UPSTREAM_DIR}/*.py at that release, and of the",
        f"# other upstream files the series changes ({', '.join(vendor.OUTSIDE_FILES)}).",
        "[files]",
        *(f'"{rel}" = "{digest}"' for rel, digest in sorted(files.items())),
    ]
    pdir.mkdir(parents=True, exist_ok=True)
    (pdir / "base.toml").write_text("\n".join(lines) + "\n" + tail)


def base_toml_tail(pdir: Path) -> str:
    """What an existing ``base.toml`` has after its ``[files]`` table."""
    path = pdir / "base.toml"
    if not path.is_file():
        return ""
    lines = path.read_text().splitlines(True)
    last_file = max(i for i, line in enumerate(lines) if line.startswith('"torch/'))
    return "".join(lines[last_file + 1 :])


def export_series(ws: Path, pdir: Path) -> None:
    """Write ``base..HEAD`` of the workspace ``ws`` to ``pdir`` as the series."""
    if git(ws, "status", "--porcelain").stdout.strip():
        raise vendor.VendorError(f"{ws} has uncommitted changes; commit them first")
    with tempfile.TemporaryDirectory() as tmp:
        new = format_patches(ws, Path(tmp))
        for old in pdir.glob("*.patch"):
            old.unlink()
        for path in new:
            shutil.copyfile(path, pdir / path.name)
    # The series file's leading comment is kept as written; a new one gets this
    old = (pdir / "series").read_text().splitlines(True) if (pdir / "series").exists() else []
    header = "".join(itertools.takewhile(lambda line: line.startswith("#"), old))
    header = header or "# Applied in order by tools/patches.py vendor and apply.\n"
    (pdir / "series").write_text(header + "".join(f"{p.name}\n" for p in new))
    log.info("exported %d patch(es) to %s", len(new), pdir)


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


def upstream_test_files(version: str) -> dict[str, str]:
    """Upstream path -> expected content, for every project test that travels upstream.

    Every base carries the same ``test/upstream/test_*.py``; a base that really
    needs its own version of one puts it in ``test/upstream/<version>/``.
    """
    sources = {p.name: p for p in UPSTREAM_TESTS.glob("test_*.py")}
    sources.update({p.name: p for p in (UPSTREAM_TESTS / version).glob("test_*.py")})
    return {
        f"{vendor.UPSTREAM_TEST_DIR}/{name}": vendor.rewrite_test(sources[name].read_text())
        for name in sorted(sources)
    }


def series_test_files(pdir: Path) -> dict[str, str]:
    """Upstream path -> content of the tests the series adds, without any torch files:
    only the test paths are applied, to an empty tree."""
    with tempfile.TemporaryDirectory() as tmp:
        for patch in vendor.read_series(pdir):
            proc = subprocess.run(
                ["git", "apply", "--include=test/*", "--whitespace=nowarn", str(patch)],
                cwd=tmp,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise vendor.VendorError(
                    f"the test files of {pdir.name}/{patch.name} do not apply:\n"
                    f"{proc.stderr.strip()}"
                )
        return {str(p.relative_to(tmp)): p.read_text() for p in sorted(Path(tmp).rglob("*.py"))}


def churn(ws: Path) -> dict[tuple[int, int], int]:
    """``(k, j) -> n``: lines that patch ``k`` of the workspace's series adds and
    patch ``j > k`` changes or deletes again (``git blame`` of each line that a
    patch removes, at its parent). A stack a reviewer merges one PR at a time
    has none: each patch's lines are final."""
    commits = git(ws, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").stdout.split()
    position = {commit: k for k, commit in enumerate(commits, start=1)}
    counts: dict[tuple[int, int], int] = {}
    for j, commit in enumerate(commits, start=1):
        diff = git(ws, "diff", "-U0", "--no-renames", f"{commit}^", commit).stdout
        path = None
        for line in diff.splitlines():
            if line.startswith("--- "):
                path = line[len("--- a/") :] if line.startswith("--- a/") else None
            elif line.startswith("@@") and path is not None:
                start, _, count = line.split()[1][1:].partition(",")
                if count == "0":
                    continue
                blame = git(
                    ws, "blame", "-s", "-l", f"-L{start},+{count or 1}", f"{commit}^", "--", path
                ).stdout
                for entry in blame.splitlines():
                    k = position.get(entry.split()[0].lstrip("^"))
                    if k is not None:
                        counts[(k, j)] = counts.get((k, j), 0) + 1
    return counts


def _ruff_command() -> list[str]:
    try:
        import ruff  # noqa: F401
    except ImportError:
        raise vendor.VendorError(
            f"ruff is not installed for {sys.executable}; install the pinned tools: "
            f"{sys.executable} -m pip install -r requirements.txt"
        ) from None
    return [sys.executable, "-m", "ruff"]


def _ruff(*args: str, text: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*_ruff_command(), *args, "--config", str(PYTORCH_RUFF)]
        + ["--no-cache", "--stdin-filename", path, "-"],
        input=text,
        capture_output=True,
        text=True,
    )


def ruff_format(text: str, path: str) -> str:
    """``text`` as ``ruff format`` with PyTorch's settings writes it."""
    proc = _ruff("format", text=text, path=path)
    if proc.returncode != 0:
        raise vendor.VendorError(f"ruff format {path}:\n{proc.stderr.strip()}")
    return proc.stdout


def _ruff_tree(texts: dict[str, str]) -> tuple[dict[str, collections.Counter[str]], dict[str, str]]:
    """PyTorch's ruff findings (by code and message, not line) and ``ruff
    format``'s output for each ``path -> text``, from one ``ruff check`` and
    one ``ruff format`` over a tree of them (a process per file costs seconds
    a check)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for path, text in texts.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        command = _ruff_command()
        settings = ["--config", str(PYTORCH_RUFF), "--no-cache", *sorted(texts)]
        proc = subprocess.run(
            [*command, "check", "--output-format", "json", "--exit-zero", *settings],
            cwd=root,
            capture_output=True,
            text=True,
        )
        findings: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in texts}
        for f in json.loads(proc.stdout):
            rel = Path(f["filename"]).relative_to(root).as_posix()
            findings[rel][f"{f['code']} {f['message']}"] += 1
        proc = subprocess.run(
            [*command, "format", *settings], cwd=root, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise vendor.VendorError(f"ruff format:\n{proc.stderr.strip()}")
        formatted = {path: (root / path).read_text() for path in texts}
    return findings, formatted


def _format_changes(text: str, formatted: str) -> collections.Counter[str]:
    """The lines of ``text`` that ``ruff format`` (giving ``formatted``) changes."""
    lines = difflib.ndiff(text.splitlines(), formatted.splitlines())
    return collections.Counter(line[2:] for line in lines if line.startswith("- "))


def format_keeping_pristine(text: str, pristine: str | None, path: str) -> str:
    """``text`` formatted with PyTorch's settings, except where it keeps a
    pristine line that ruff would change: the patch then adds no formatting
    change to upstream's own lines."""
    formatted = ruff_format(text, path)
    if pristine is None:
        return formatted
    with tempfile.TemporaryDirectory() as tmp:
        ours, base, theirs = (Path(tmp) / name for name in ("ours", "base", "theirs"))
        ours.write_text(formatted)
        base.write_text(ruff_format(pristine, path))
        theirs.write_text(pristine)
        proc = subprocess.run(
            ["git", "merge-file", "-p", str(ours), str(base), str(theirs)],
            capture_output=True,
            text=True,
        )
    # A conflict: the patch changed a line that ruff reformats upstream; keep
    # the formatted text there
    return formatted if proc.returncode != 0 else proc.stdout


def lint_files(files: dict[str, tuple[str, str | None]]) -> list[str]:
    """Each ``path -> (text, pristine text or None)`` checked with PyTorch's
    ruff settings: a lint finding, or a line ``ruff format`` would change, that
    the pristine file does not have."""
    errors = []
    texts = {f"patched/{path}": text for path, (text, _) in files.items()}
    texts.update({f"pristine/{path}": pristine or "" for path, (_, pristine) in files.items()})
    findings, formatted = _ruff_tree(texts)
    for path in sorted(files):
        patched, pristine = f"patched/{path}", f"pristine/{path}"
        new_findings = findings[patched] - findings[pristine]
        new_format = _format_changes(texts[patched], formatted[patched]) - _format_changes(
            texts[pristine], formatted[pristine]
        )
        if new_findings:
            errors.append(
                f"{path}: lint findings the pristine file does not have: {sorted(new_findings)}"
            )
        if new_format:
            errors.append(
                f"{path}: ruff format would change {sum(new_format.values())} line(s) the "
                f"patches add, e.g. {next(iter(new_format))!r}"
            )
    if errors:
        errors.append(
            "Fix: tools/patches.py workspace format, then export (PyTorch's settings: "
            f"{PYTORCH_RUFF.relative_to(REPO)})"
        )
    return errors


def lint_errors(ws: Path) -> list[str]:
    """:func:`lint_files` over every file that ``base..HEAD`` of ``ws`` touches."""
    files = {}
    paths = git(ws, "diff", "--name-only", "--diff-filter=AM", BASE_TAG, "HEAD").stdout.split()
    for path in (p for p in paths if p.endswith(".py")):
        pristine = git(ws, "show", f"{BASE_TAG}:{path}", check=False)
        files[path] = (
            git(ws, "show", f"HEAD:{path}").stdout,
            pristine.stdout if pristine.returncode == 0 else None,
        )
    return lint_files(files)


def project_form(text: str) -> str:
    """The project form of an upstream-path test (``vendor.rewrite_test`` undone)."""
    for old, new in reversed(vendor.TEST_REWRITES):
        text = text.replace(new, old)
    if vendor.rewrite_test(text) == text:
        raise vendor.VendorError("a test imports neither torch_fsdp_ext nor upstream FSDP2")
    return text


def patch_subjects(pdir: Path) -> list[str]:
    """The ``Subject:`` of every patch in the series, in order."""
    return [vendor.patch_subject(patch) for patch in vendor.read_series(pdir)]
