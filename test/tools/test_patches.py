# Owner(s): ["oncall: distributed"]
"""Tests for the patch tooling: tools/patches.py and the import-time checks in _vendor.py.

Every test works on a throwaway copy of the repository layout in a temporary
directory and runs the tools there as subprocesses; the tools locate everything
relative to their own file, so the real patches/, the real generated copy and
the installed torch are never touched.
"""

import concurrent.futures
import email
import email.policy
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
from packaging.requirements import Requirement
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_fsdp_ext._vendor import OUTSIDE_FILES, patch_subject

REPO = Path(__file__).resolve().parents[2]
# The series of the installed torch, relative to a repository copy
INSTALLED = torch.__version__.split("+", 1)[0]
PDIR = Path("patches") / INSTALLED
# What the tools and the package need; setup.py & co. only for building a wheel.
LAYOUT = (
    "patches",
    "tools",
    "torch_fsdp_ext/_vendor.py",
    "torch_fsdp_ext/__init__.py",
    "torch_fsdp_ext/_upstream_types.py",
    "torch_fsdp_ext/_torch_compat.py",
    "torch_fsdp_ext/_clip_grad.py",
    "test/fsdp_ext_testing",
    "test/upstream",
    "test/conftest.py",
    # run by ``patches.py stack`` at every position (its ``PACKAGE_TESTS``)
    "test/package/test_call_counts.py",
)
BUILD_LAYOUT = ("setup.py", "pyproject.toml", "README.md")
# The commands of tools/patches.py
PATCH_COMMANDS = ("workspace", "vendor", "check", "stack", "port", "apply")


def tool_commands() -> list[list[str]]:
    """Every tool's command line, relative to the repository: each script under
    tools/ (a file with a ``__main__`` guard, or a folder with ``__main__.py``),
    each command of tools/patches.py, and the shell scripts."""
    tools = REPO / "tools"
    packages = sorted(p.parent for p in tools.rglob("__main__.py"))
    scripts = sorted(
        p
        for p in tools.rglob("*.py")
        if not any(package in p.parents for package in packages)
        and 'if __name__ == "__main__":' in p.read_text()
    )
    commands = [[sys.executable, str(p.relative_to(REPO))] for p in [*scripts, *packages]]
    commands += [[sys.executable, "tools/patches.py", name] for name in PATCH_COMMANDS]
    commands += [["bash", str(p.relative_to(REPO))] for p in sorted(tools.rglob("*.sh"))]
    return commands


VENDORED = Path("torch_fsdp_ext/_fully_shard")
# A fixed git identity, so ``patches.py apply`` (which commits as the user) also
# works where no identity is configured.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.invalid",
}


@functools.cache
def _template() -> tempfile.TemporaryDirectory:
    """The repository layout, build files included, copied once per session
    and generated there: every copy a test makes comes from it, so
    ``patches.py vendor`` runs once rather than once per copy, and every
    copy is of one moment of a tree that someone may be editing."""
    tmp = tempfile.TemporaryDirectory(prefix="torch_fsdp_ext-test-template-")
    template = Path(tmp.name)
    for rel in LAYOUT + BUILD_LAYOUT:
        src, dst = REPO / rel, template / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            shutil.copy2(src, dst)
        elif rel == "README.md":
            # pyproject.toml names a readme; the build only needs one to exist.
            dst.write_text("torch-fsdp-ext\n")
        else:
            raise FileNotFoundError(src)
    proc = run(template, "tools/patches.py", "vendor")
    if proc.returncode != 0:
        raise RuntimeError(f"tools/patches.py vendor failed:\n{proc.stdout}")
    return tmp


def make_repo(dest: Path, *, vendored: bool = False, build: bool = False) -> Path:
    """Copy the repository layout to ``dest``, with the generated copy if
    ``vendored`` and what building a wheel needs if ``build``."""
    shutil.copytree(_template().name, dest, ignore=shutil.ignore_patterns("__pycache__"))
    if not vendored:
        shutil.rmtree(dest / VENDORED)
    if not build:
        for rel in BUILD_LAYOUT:
            (dest / rel).unlink()
    return dest


def _env(repo: Path) -> dict[str, str]:
    # PYTHONPATH makes the copy's package shadow the installed editable one.
    return {**os.environ, **GIT_IDENTITY, "PYTHONPATH": str(repo)}


def run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``python *args`` in ``repo``; stdout holds stdout and stderr together."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=repo,
        env=_env(repo),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, env=_env(cwd), check=True, capture_output=True, text=True
    ).stdout


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def series(repo: Path, pdir: Path = PDIR) -> list[Path]:
    lines = (repo / pdir / "series").read_text().splitlines()
    names = [line.split("#", 1)[0].strip() for line in lines]
    return [repo / pdir / name for name in names if name]


class _TempRepoTestCase(TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        shared = tempfile.TemporaryDirectory(prefix="torch_fsdp_ext-test-")
        cls.addClassCleanup(shared.cleanup)
        cls.shared_tmp = Path(shared.name)
        cls.shared_checks = {}

    def setUp(self):
        super().setUp()
        tmp = tempfile.TemporaryDirectory(prefix="torch_fsdp_ext-test-")
        self.addCleanup(tmp.cleanup)
        self.tmp = Path(tmp.name)

    def new_repo(self, name: str = "repo", **kwargs) -> Path:
        return make_repo(self.tmp / name, **kwargs)

    def shared_check(
        self, make_defects: Callable[[Path], None], **kwargs
    ) -> subprocess.CompletedProcess:
        """``patches.py check`` on a copy (``make_repo(**kwargs)``) that
        ``make_defects`` changed, run once per class for the tests that each
        require their own finding of it. Every finding is a FAIL line, and any
        FAIL line fails the check: a finding shows that its defect alone fails it."""
        name = make_defects.__name__
        if name not in self.shared_checks:
            repo = make_repo(self.shared_tmp / name, **kwargs)
            make_defects(repo)
            self.shared_checks[name] = run(repo, "tools/patches.py", "check")
        return self.shared_checks[name]

    def assertFails(self, proc: subprocess.CompletedProcess, *needles: str) -> None:
        self.assertNotEqual(proc.returncode, 0, proc.stdout)
        for needle in needles:
            self.assertIn(needle, proc.stdout)

    def assertSucceeds(self, proc: subprocess.CompletedProcess) -> None:
        self.assertEqual(proc.returncode, 0, proc.stdout)

    def assertTreeComplete(self, dest: Path) -> None:
        stamp = json.loads((dest / "VENDORED.json").read_text())
        self.assertIn("_fully_shard.py", stamp["files"])
        for name, digest in stamp["files"].items():
            self.assertEqual(hashlib.sha256((dest / name).read_bytes()).hexdigest(), digest, name)
        self.assertEqual(
            sorted(p.name for p in dest.iterdir()), sorted([*stamp["files"], "VENDORED.json"])
        )


class TestPatchToolingCheck(_TempRepoTestCase):
    """``patches.py check`` on a shared, unmodified copy and on copies with one defect each."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.repo = make_repo(cls.shared_tmp / "repo", vendored=True)

    def series_defects(self, repo: Path) -> None:
        """Two defects of the series that fail different steps of the check:
        the registry patch leaves ``FSDPBackend.__module__`` private, and the
        ``_coalesces`` patch adds a line that PyTorch's ruff settings flag (a
        useless semicolon) and one that ``ruff format`` would change."""
        line = '+FSDPBackend.__module__ = "torch.distributed.fsdp"\n'
        (patch,) = [p for p in series(repo) if line in p.read_text()]
        patch.write_text(patch.read_text().replace(line, line.replace('fsdp"', 'fsdp._x"')))
        old = "+        return False\n"
        (patch,) = [p for p in series(repo) if "+def _coalesces(" in p.read_text()]
        text = patch.read_text()
        self.assertIn(old, text)
        text = text.replace(old, "+        return False;\n", 1)
        text = text.replace("+    if len(tensors) < 2:\n", "+    if len(tensors)<2:\n", 1)
        patch.write_text(text)

    def test_unchanged_copy_passes(self):
        """Tests that ``patches.py check`` passes on an unmodified copy of the repository."""
        proc = run(self.repo, "tools/patches.py", "check")
        self.assertSucceeds(proc)
        self.assertIn("ok: export round trip is a no-op", proc.stdout)
        self.assertIn(str(self.repo / VENDORED), proc.stdout)

    def test_names_a_public_name_the_patched_fsdp_does_not_export(self):
        """Tests that ``patches.py check`` imports torch with the series in place
        and names a ``_fully_shard.__all__`` name that ``torch.distributed.fsdp``
        does not export as its own: here the registry patch leaves
        ``FSDPBackend.__module__`` private (:meth:`series_defects`)."""
        proc = self.shared_check(self.series_defects)
        self.assertFails(proc, "torch.distributed.fsdp does not export ['FSDPBackend']")

    @pytest.mark.slow
    def test_every_tool_answers_help(self):
        """Tests that every script under tools/, every package there run as a
        script, every command of tools/patches.py and every shell script answers
        --help with exit 0."""
        commands = tool_commands()
        names = [" ".join(c[1:]) for c in commands]
        for expected in ("tools/patches.py check", "tools/bench", "tools/demos/moe.py"):
            self.assertIn(expected, names)

        # Each answer is a process that mostly imports torch: run a few at once
        def answer_help(command: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run(
                [*command, "--help"],
                cwd=self.repo,
                env=_env(self.repo),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )

        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(answer_help, commands))
        for command, proc in zip(commands, answers, strict=True):
            with self.subTest(tool=" ".join(command[1:])):
                self.assertSucceeds(proc)
                self.assertIn("usage:", proc.stdout)

    def test_tampered_context_line(self):
        """Tests that a patch whose context no longer matches the base is named as not applying."""
        repo = self.new_repo()
        # The first patch that changes torch/ (the series opens with a test-only one)
        patch = next(p for p in series(repo) if "\ndiff --git a/torch/" in p.read_text())
        lines = patch.read_text().splitlines(keepends=True)
        start = next(i for i, line in enumerate(lines) if line.startswith("diff --git a/torch/"))
        hunk = next(i for i in range(start, len(lines)) if lines[i].startswith("@@"))
        ctx = next(i for i in range(hunk, len(lines)) if lines[i].startswith(" "))
        lines[ctx] = lines[ctx].rstrip("\n") + "  # tampered\n"
        patch.write_text("".join(lines))
        proc = run(repo, "tools/patches.py", "check")
        self.assertFails(proc, f"{patch.name} does not apply", "tools/patches.py workspace")

    def test_tampered_diffstat(self):
        """Tests that a patch that applies but was not produced by export fails the round trip."""
        repo = self.new_repo(vendored=True)
        patch = series(repo)[0]
        text, n = re.subn(
            r"^( \d+ files? changed, )(\d+)",
            lambda m: m.group(1) + str(int(m.group(2)) + 1),
            patch.read_text(),
            count=1,
            flags=re.M,
        )
        self.assertEqual(n, 1)
        patch.write_text(text)
        proc = run(repo, "tools/patches.py", "check")
        self.assertFails(
            proc, f"exporting again changes ['{patch.name}']", "tools/patches.py workspace export"
        )
        self.assertIn("patch(es) apply cleanly", proc.stdout)

    def test_modified_upstream_file(self):
        """Tests that an installed base file with another sha256 names pip install as the fix."""
        repo = self.new_repo(vendored=True)
        base = repo / PDIR / "base.toml"
        text = base.read_text()
        digest = re.search(r'= "([0-9a-f]{64})"', text).group(1)
        base.write_text(text.replace(digest, "0" * 64))
        proc = run(repo, "tools/patches.py", "check")
        self.assertFails(proc, "does not match the pinned base", "pip install")

    def test_wrong_torch_version(self):
        """Tests that a torch version other than the base names pip install torch== as the fix."""
        repo = self.new_repo(vendored=True)
        base = repo / PDIR / "base.toml"
        text = base.read_text()
        text, n = re.subn(r'^version = "[^"]+"', 'version = "1.0.0"', text, flags=re.M)
        self.assertEqual(n, 1)
        base.write_text(text)
        proc = run(repo, "tools/patches.py", "check")
        self.assertFails(proc, "pip install torch==1.0.0")

    def test_lint_and_format_findings_fail(self):
        """Tests that ``patches.py check`` fails, naming the file and the
        finding, on a line the series adds that PyTorch's ruff settings flag
        (a useless semicolon) and on one ``ruff format`` would change
        (:meth:`series_defects`)."""
        proc = self.shared_check(self.series_defects)
        path = "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"
        self.assertFails(proc, f"{path}: lint findings the pristine file does not have", "E703")
        self.assertIn(f"{path}: ruff format would change", proc.stdout)

    def test_check_without_ruff_names_the_install(self):
        """Tests that ``patches.py check`` on a Python without ruff fails with one
        line naming the pip command that installs it, not a traceback."""
        proc = run(
            self.repo,
            "-c",
            "import runpy, sys; sys.modules['ruff'] = None; sys.path.insert(0, 'tools'); "
            "sys.argv = ['tools/patches.py', 'check']; "
            "runpy.run_path('tools/patches.py', run_name='__main__')",
        )
        self.assertFails(proc, "ruff is not installed for ")
        self.assertIn("-m pip install -r requirements.txt", proc.stdout)
        self.assertNotIn("Traceback", proc.stdout)

    def test_demos_outside_the_venv_name_the_fix(self):
        """Tests that every demo run by a Python without torch (``-S``: no
        site-packages) exits with one line naming the setup command and the
        venv's interpreter, not a ``ModuleNotFoundError`` traceback."""
        demos = sorted(
            p for p in (self.repo / "tools" / "demos").glob("*.py") if not p.name.startswith("_")
        )
        self.assertGreaterEqual(len(demos), 3)
        for demo in demos:
            with self.subTest(demo=demo.name):
                proc = run(self.repo, "-S", str(demo.relative_to(self.repo)))
                self.assertFails(
                    proc,
                    "error: torch",
                    "not installed for",
                    "bash tools/setup_and_test.sh",
                )
                self.assertNotIn("Traceback", proc.stdout)
                self.assertEqual(len(proc.stdout.strip().splitlines()), 1, proc.stdout)

    def test_setup_script_names_the_supported_bases(self):
        """Tests that the README's test command, asked for a torch release
        without a series, fails at once with one line listing the supported
        bases, before it creates any venv."""
        proc = subprocess.run(
            ["bash", "tools/setup_and_test.sh", "--base", "2.0.0"],
            cwd=self.repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.assertFails(proc, "error: no series for torch 2.0.0; supported:", "2.15.0")
        self.assertEqual(len(proc.stdout.strip().splitlines()), 1, proc.stdout)
        self.assertFalse((self.repo / ".venv-2.0.0").exists())

    def test_vendor_refuses_a_foreign_dest(self):
        """Tests that ``patches.py vendor --dest`` never replaces a non-empty directory it did not generate."""
        dest = self.tmp / "mine"
        dest.mkdir()
        (dest / "notes.txt").write_text("keep me\n")
        proc = run(self.repo, "tools/patches.py", "vendor", "--dest", str(dest))
        self.assertFails(proc, "holds no VENDORED.json")
        self.assertEqual((dest / "notes.txt").read_text(), "keep me\n")

    def test_stale_generated_copy(self):
        """Tests that a hand-edited generated file fails the check and names tools/patches.py vendor."""
        repo = self.new_repo(vendored=True)
        with open(repo / VENDORED / "_fully_shard.py", "a") as f:
            f.write("# edited by hand\n")
        proc = run(repo, "tools/patches.py", "check")
        self.assertFails(proc, "['_fully_shard.py']", "python tools/patches.py vendor")
        self.assertSucceeds(run(repo, "tools/patches.py", "vendor"))
        self.assertSucceeds(run(repo, "tools/patches.py", "check"))


class TestPatchToolingWorkspace(_TempRepoTestCase):
    @pytest.mark.slow
    def test_export_round_trip_is_noop(self):
        """Tests that ``patches.py workspace`` init then export leaves every file in patches/ byte-identical."""
        repo = self.new_repo(vendored=True)
        before = snapshot(repo / PDIR)
        generated = snapshot(repo / VENDORED)
        ws = self.tmp / "ws"
        self.assertSucceeds(run(repo, "tools/patches.py", "workspace", "init", "--dir", str(ws)))
        self.assertEqual(git(ws, "tag", "--list"), "base\n")
        self.assertSucceeds(run(repo, "tools/patches.py", "workspace", "export", "--dir", str(ws)))
        self.assertEqual(snapshot(repo / PDIR), before)
        self.assertEqual(snapshot(repo / VENDORED), generated)

    @pytest.mark.slow
    def test_format_writes_a_base_s_own_test_back_to_its_copy(self):
        """Tests that ``workspace format`` writes a test the base keeps its own
        copy of (``test/upstream/<version>/``) back to that copy, leaving the
        common file as it is."""
        repo = self.new_repo()
        name = "test_fully_shard_cpu_offload.py"
        common = repo / "test" / "upstream" / name
        own = repo / "test" / "upstream" / INSTALLED / name
        own.parent.mkdir(exist_ok=True)  # 2.9.0 and 2.14.1 have copies of their own
        own.write_text(common.read_text().replace("def test_", "def test_own_", 1))
        before = common.read_text()
        ws = self.tmp / "ws"
        self.assertSucceeds(run(repo, "tools/patches.py", "workspace", "init", "--dir", str(ws)))
        self.assertSucceeds(
            run(repo, "tools/patches.py", "workspace", "sync-tests", "--dir", str(ws))
        )
        git(ws, "commit", "-qam", "own copy")
        # Unformatted in the workspace: format writes the formatted text back
        path = ws / "test" / "distributed" / "_composable" / "fsdp" / name
        path.write_text(path.read_text().replace("def test_own_", "def  test_own_", 1))
        git(ws, "commit", "-qam", "unformatted")
        own.write_text("stale\n")
        self.assertSucceeds(run(repo, "tools/patches.py", "workspace", "format", "--dir", str(ws)))
        self.assertIn("def test_own_", own.read_text())
        self.assertEqual(common.read_text(), before)


class TestPatchToolingImport(_TempRepoTestCase):
    """``import torch_fsdp_ext`` from a copy: generation, staleness, concurrency."""

    def assertShadowsInstalled(self, repo: Path) -> None:
        proc = run(
            repo,
            "-c",
            "import importlib.util; print(importlib.util.find_spec('torch_fsdp_ext').origin)",
        )
        self.assertSucceeds(proc)
        self.assertEqual(proc.stdout.strip(), str(repo / "torch_fsdp_ext" / "__init__.py"))

    def test_stale_copy_refused_at_import(self):
        """Tests that importing a copy generated from another series fails naming tools/patches.py vendor."""
        repo = self.new_repo(vendored=True)
        self.assertShadowsInstalled(repo)
        with open(repo / PDIR / "series", "a") as f:
            f.write("# a comment changes the series digest too\n")
        proc = run(repo, "-c", "import torch_fsdp_ext")
        self.assertFails(proc, "is stale", "python tools/patches.py vendor")

    def test_missing_copy_generated_at_import(self):
        """Tests that importing without a generated copy generates it and imports from it."""
        repo = self.new_repo()
        self.assertFalse((repo / VENDORED).exists())
        proc = run(
            repo,
            "-c",
            "import torch_fsdp_ext; print(torch_fsdp_ext.__file__); "
            "print(torch_fsdp_ext.fully_shard.__module__)",
        )
        self.assertSucceeds(proc)
        self.assertEqual(
            proc.stdout.split()[-2:],
            [
                str(repo / "torch_fsdp_ext" / "__init__.py"),
                "torch_fsdp_ext._fully_shard._fully_shard",
            ],
        )
        self.assertTreeComplete(repo / VENDORED)

    def test_concurrent_imports_generate_once(self):
        """Tests that 4 processes importing at once without a copy all succeed with a complete tree."""
        repo = self.new_repo()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", "import torch_fsdp_ext"],
                cwd=repo,
                env=_env(repo),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(4)
        ]
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            self.assertEqual(proc.returncode, 0, out)
        self.assertTreeComplete(repo / VENDORED)
        leftovers = [p.name for p in (repo / "torch_fsdp_ext").glob("._fully_shard-*")]
        self.assertEqual(leftovers, [])

    def test_hand_edited_generated_file_refused_at_import(self):
        """Tests that a generated file changed after generation fails import naming tools/patches.py vendor."""
        repo = self.new_repo(vendored=True)
        with open(repo / VENDORED / "_fsdp_collectives.py", "a") as f:
            f.write("DeterministicReduceScatter = None\n")
        proc = run(repo, "-c", "import torch_fsdp_ext")
        self.assertFails(
            proc, "VendorError", "['_fsdp_collectives.py']", "python tools/patches.py vendor"
        )

    def test_deleted_generated_file_refused_at_import(self):
        """Tests that a deleted generated file gives the VendorError naming tools/patches.py vendor, not an ImportError."""
        repo = self.new_repo(vendored=True)
        (repo / VENDORED / "_fsdp_api.py").unlink()
        proc = run(repo, "-c", "import torch_fsdp_ext")
        self.assertFails(proc, "VendorError", "['_fsdp_api.py']", "python tools/patches.py vendor")
        self.assertNotIn("ModuleNotFoundError", proc.stdout)

    def test_copy_without_stamp_refused_at_import(self):
        """Tests that a generated copy whose stamp is gone is refused, not silently regenerated."""
        repo = self.new_repo(vendored=True)
        (repo / VENDORED / "VENDORED.json").unlink()
        proc = run(repo, "-c", "import torch_fsdp_ext")
        self.assertFails(proc, "has no readable VENDORED.json", "python tools/patches.py vendor")

    def test_installed_package_names_removal_as_the_fix(self):
        """Tests that outside a source checkout (the series in _patches, as in a wheel)
        a stale copy names removing it as the fix, since reinstalling keeps it."""
        repo = self.new_repo(vendored=True)
        (repo / "patches").rename(repo / "torch_fsdp_ext" / "_patches")
        with open(repo / "torch_fsdp_ext" / "_patches" / INSTALLED / "series", "a") as f:
            f.write("# a comment changes the series digest too\n")
        proc = run(repo, "-c", "import torch_fsdp_ext")
        self.assertFails(proc, "is stale", f"Fix: remove {repo / VENDORED}")

    def test_unsupported_torch_lists_supported_versions(self):
        """Tests that a torch with no series fails import with the supported versions and pip command."""
        repo = self.new_repo()
        for pdir in (repo / "patches").glob("*/"):
            shutil.rmtree(pdir)
        shutil.copytree(REPO / PDIR, repo / "patches" / "9.9.9")
        bases = repo / "patches" / "bases.toml"
        bases.write_text(re.sub(r'primary = "[^"]+"', 'primary = "9.9.9"', bases.read_text()))
        proc = run(repo, "-c", "import torch_fsdp_ext")
        self.assertFails(
            proc,
            f"torch {torch.__version__} is not supported",
            "patch series for torch 9.9.9 only",
            "Fix: pip install torch==9.9.9",
        )

    def test_unwritable_package_names_permissions_fix(self):
        """Tests that failing to write the generated copy for lack of permission names a permissions fix."""
        repo = self.new_repo()
        # Tests run as root, which chmod cannot stop; fail the first write instead
        code = (
            "import tempfile; from unittest import mock\n"
            "denied = PermissionError(13, 'Permission denied')\n"
            "with mock.patch.object(tempfile, 'mkdtemp', side_effect=denied):\n"
            "    import torch_fsdp_ext\n"
        )
        proc = run(repo, "-c", code)
        self.assertFails(proc, "Permission denied", "as a user who can write to")
        self.assertNotIn("--no-build-isolation", proc.stdout)
        self.assertFalse((repo / VENDORED).exists())

    def test_failed_generation_keeps_previous_copy_and_leaves_nothing_behind(self):
        """Tests that a rename failing mid-replacement restores the old copy and removes the staging tree."""
        repo = self.new_repo(vendored=True)
        before = snapshot(repo / VENDORED)
        code = (
            "import pathlib, sys; from unittest import mock\n"
            "sys.path.insert(0, 'tools'); from patchlib.common import vendor\n"
            "real = pathlib.Path.rename\n"
            "def rename(self, target):\n"
            "    if self.name.startswith('._fully_shard-') and not self.name.endswith('-old'):\n"
            "        raise OSError(28, 'No space left on device')\n"
            "    return real(self, target)\n"
            "files = {'x.py': b'', 'VENDORED.json': b'{}'}\n"
            "with mock.patch.object(pathlib.Path, 'rename', rename):\n"
            "    vendor.write(vendor.VENDORED_DIR, files)\n"
        )
        proc = run(repo, "-c", code)
        self.assertFails(proc, "No space left on device")
        self.assertEqual(snapshot(repo / VENDORED), before)
        leftovers = [p.name for p in (repo / "torch_fsdp_ext").glob("._fully_shard-*")]
        self.assertEqual(leftovers, [])


class TestPatchToolingBases(_TempRepoTestCase):
    """Several torch bases side by side: selection, agreement between bases, porting."""

    # Every torch release published as of 2026-12-04 from 2.8 on (pip index versions torch)
    PUBLISHED = (
        "2.8.0",
        "2.9.0",
        "2.9.1",
        "2.10.0",
        "2.11.0",
        "2.12.0",
        "2.12.1",
        "2.13.0",
        "2.14.0",
        "2.14.1",
        "2.15.0",
    )

    def test_pyproject_range_is_exactly_the_supported_releases(self):
        """Tests that pip may choose a published torch release iff import supports it."""
        with open(REPO / "pyproject.toml", "rb") as f:
            deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
        (spec,) = [d.specifier for d in deps if d.name == "torch"]
        supported = {p.parent.name for p in (REPO / "patches").glob("*/base.toml")}
        self.assertIn(INSTALLED, supported)
        self.assertLessEqual(supported, set(self.PUBLISHED))
        for version in self.PUBLISHED:
            with self.subTest(version=version):
                self.assertEqual(version in spec, version in supported)

    def add_base(self, repo: Path, version: str) -> Path:
        """A copy of the installed torch's series (and its own test versions)
        under another version."""
        pdir = repo / "patches" / version
        shutil.copytree(repo / PDIR, pdir)
        base = pdir / "base.toml"
        base.write_text(
            re.sub(r'^version = "[^"]+"', f'version = "{version}"', base.read_text(), flags=re.M)
        )
        if (own_tests := repo / "test/upstream" / INSTALLED).is_dir():
            shutil.copytree(own_tests, repo / "test/upstream" / version)
        return pdir

    def test_base_missing_a_patch_needs_a_reason(self):
        """Tests that ``patches.py check`` fails, naming the patch and the fix,
        when a base lacks one of the primary base's patches, and passes once its
        base.toml gives the reason under ``[series.omitted]``; the tests that
        patch creates are then not required."""
        repo = self.new_repo(vendored=True)
        pdir = self.add_base(repo, "9.9.9")
        test = "test_fully_shard_cpu_offload.py"
        (patch,) = [p for p in series(repo, pdir.relative_to(repo)) if test in p.read_text()]
        subject = patch_subject(patch)
        names = (pdir / "series").read_text().splitlines(True)
        (pdir / "series").write_text("".join(n for n in names if n.strip() != patch.name))
        patch.unlink()
        proc = run(repo, "tools/patches.py", "check")
        self.assertFails(
            proc, f"patches/9.9.9 lacks the primary base's patch {subject!r}", "[series.omitted]"
        )
        base = pdir / "base.toml"
        entry = f'"{subject}" = "its premise does not exist in torch 9.9.9"\n'
        text = base.read_text()
        if "[series.omitted]\n" in text:
            text = text.replace("[series.omitted]\n", "[series.omitted]\n" + entry)
        else:
            text += "\n[series.omitted]\n" + entry
        base.write_text(text)
        self.assertSucceeds(run(repo, "tools/patches.py", "check"))
        # A reason must say something
        base.write_text(text.replace("its premise does not exist in torch 9.9.9", " "))
        proc = run(repo, "tools/patches.py", "check")
        self.assertFails(proc, f"omits [{subject!r}] without a reason")

    def base_defects(self, repo: Path) -> None:
        """A second base, 9.9.9, that disagrees with the primary one twice: its
        last patch has another subject, and its series carries a test (one
        every base carries) other than test/upstream/'s."""
        pdir = self.add_base(repo, "9.9.9")
        patch = series(repo, pdir.relative_to(repo))[-1]
        patch.write_text(
            patch.read_text().replace("Subject: [PATCH] ", "Subject: [PATCH] Renamed ", 1)
        )
        test = repo / "test/upstream/test_fully_shard_cpu_offload.py"
        own = repo / "test/upstream" / "9.9.9" / test.name
        own.parent.mkdir(exist_ok=True)
        own.write_text(test.read_text() + "# 9.9.9\n")

    def test_bases_with_other_subjects_fail(self):
        """Tests that ``patches.py check`` fails when one base's series has
        another patch subject (:meth:`base_defects`)."""
        proc = self.shared_check(self.base_defects, vendored=True)
        self.assertFails(proc, "patches/9.9.9 has other patch subjects", "Carrying a change")

    def test_diverged_upstream_test_fails(self):
        """Tests that ``patches.py check`` fails when a base's series carries a
        test other than test/upstream/ (:meth:`base_defects`)."""
        proc = self.shared_check(self.base_defects, vendored=True)
        self.assertFails(
            proc, "test_fully_shard_cpu_offload.py in patches/9.9.9 differs", "sync-tests"
        )
        self.assertNotIn(f"in patches/{INSTALLED} differs", proc.stdout)

    def fake_torch(self, name: str, version: str, edit: dict[str, tuple[str, str]]) -> Path:
        """A torch package directory holding the installed base's files with ``edit`` applied
        (file -> (old, new)), reporting ``version``: a stand-in for a new torch release."""
        root = self.tmp / name / "torch"
        (root / "distributed/fsdp").mkdir(parents=True)
        shutil.copytree(
            Path(torch.__file__).parent / "distributed/fsdp/_fully_shard",
            root / "distributed/fsdp/_fully_shard",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        for rel in OUTSIDE_FILES:
            (self.tmp / name / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(torch.__file__).parent.parent / rel, self.tmp / name / rel)
        for file, (old, new) in edit.items():
            path = root / "distributed/fsdp/_fully_shard" / file
            text = path.read_text()
            self.assertEqual(text.count(old), 1, old)
            path.write_text(text.replace(old, new))
        (root / "version.py").write_text(
            f"__version__ = '{version}'\ngit_version = '{'ab' * 20}'\n"
        )
        return root

    @pytest.mark.slow
    def test_port_stops_at_conflict_and_exports_after_continue(self):
        """Tests that ``patches.py port`` rebases the series onto a new torch, stops at a conflicting
        upstream change, and after the conflict is resolved writes a base that checks clean."""
        repo = self.new_repo(vendored=True)
        # An upstream rewrite of a line next to one the series adds (the
        # group_collectives check; torch 2.9 has no ``_validate_module``), and
        # an unrelated one
        fully_shard_py = (
            Path(torch.__file__).parent / "distributed/fsdp/_fully_shard/_fully_shard.py"
        )
        (line,) = [
            line
            for line in (
                '_validate_module(module, "fully_shard")\n',
                "mesh = mesh or _init_default_fully_shard_mesh()\n",
            )
            if line in fully_shard_py.read_text()
        ]
        new_torch = self.fake_torch(
            "new",
            "9.9.9",
            {
                "_fully_shard.py": (line, line.replace("\n", "  # upstream change\n")),
                "_fsdp_init.py": ("import itertools\n", "import itertools  # upstream change\n"),
            },
        )
        ws = self.tmp / "port"
        proc = run(
            repo, "tools/patches.py", "port", "start", "--to", str(new_torch), "--dir", str(ws)
        )
        self.assertFails(
            proc, "conflict while carrying", "_fully_shard.py", "tools/patches.py port continue"
        )
        self.assertFalse((repo / "patches/9.9.9/series").exists())
        # Staging the file with its conflict markers is refused
        git(ws, "add", "-A")
        proc = run(repo, "tools/patches.py", "port", "continue", "--dir", str(ws))
        self.assertFails(proc, "conflict markers are still staged")
        # Recreate the conflict and resolve it by keeping the patch's side
        conflicted = "torch/distributed/fsdp/_fully_shard/_fully_shard.py"
        git(ws, "checkout", "-m", conflicted)
        git(ws, "checkout", "--theirs", conflicted)
        git(ws, "add", "-A")
        proc = run(repo, "tools/patches.py", "port", "continue", "--dir", str(ws))
        self.assertSucceeds(proc)
        self.assertEqual(
            [p.name for p in series(repo, Path("patches/9.9.9"))], [p.name for p in series(repo)]
        )
        self.assertIn("ab" * 20, (repo / "patches/9.9.9/base.toml").read_text())
        # The port carries the installed base's own test versions, if any
        if (own_tests := repo / "test/upstream" / INSTALLED).is_dir():
            shutil.copytree(own_tests, repo / "test/upstream/9.9.9")
        proc = run(repo, "tools/patches.py", "check", "--base", "9.9.9", "--torch", str(new_torch))
        self.assertSucceeds(proc)
        self.assertIn("ok: bases", proc.stdout)
        self.assertIn("skipped: the generated copy", proc.stdout)

    def test_base_specific_upstream_test_replaces_the_common_one(self):
        """Tests that pytest collects test/upstream/<installed>/test_x.py instead of
        test/upstream/test_x.py, and never another base's version."""
        repo = self.new_repo(vendored=True)
        name = "test_fully_shard_backend.py"
        for version, test in ((INSTALLED, "test_this_base"), ("9.9.9", "test_other_base")):
            (repo / "test/upstream" / version).mkdir(exist_ok=True)
            (repo / "test/upstream" / version / name).write_text(f"def {test}():\n    pass\n")
        proc = run(
            repo, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "test/upstream"
        )
        self.assertSucceeds(proc)
        self.assertIn(f"test/upstream/{INSTALLED}/{name}::test_this_base", proc.stdout)
        self.assertNotIn("test_other_base", proc.stdout)
        self.assertNotIn(f"test/upstream/{name}::", proc.stdout)
        # A common test that no base has its own version of
        self.assertIn("test/upstream/test_fully_shard_cpu_offload.py::", proc.stdout)

    def test_rewrite_count_drift_fails_generation(self):
        """Tests that a rewrite whose target occurs another number of times fails generation loudly."""
        repo = self.new_repo()
        vendor_py = repo / "torch_fsdp_ext/_vendor.py"
        text = vendor_py.read_text()
        # The installed base's count of ``torch.ops.fsdp.`` in _fsdp_collectives.py
        match = re.search(rf'\("_fsdp_collectives.py", (\d+), \("{INSTALLED}",\)\)', text)
        self.assertIsNotNone(match)
        count = int(match.group(1))
        drifted = match.group(0).replace(f", {count},", f", {count + 1},")
        vendor_py.write_text(text.replace(match.group(0), drifted))
        proc = run(repo, "tools/patches.py", "vendor")
        self.assertFails(
            proc,
            f"expected {count + 1} occurrence(s) of 'torch.ops.fsdp.', found {count}",
            "REWRITES",
        )

    def test_rewrites_apply_per_base(self):
        """Tests that a rewrite limited to some bases applies there and nowhere else."""
        from torch_fsdp_ext import _vendor

        only = _vendor.Rewrite("_fully_shard.py", "a", "b", 1, "differs on 9.9.9", ("9.9.9",))
        installed = _vendor.rewrites_for(INSTALLED)
        with mock.patch.object(_vendor, "REWRITES", (*_vendor.REWRITES, only)):
            self.assertIn(only, _vendor.rewrites_for("9.9.9"))
            self.assertEqual(_vendor.rewrites_for(INSTALLED), installed)

    def test_torch_wheel_is_a_source_of_pristine_files(self):
        """Tests that --torch accepts a torch wheel: ``patches.py check`` passes with the
        installed torch's files packed as one, and the generated-copy check is skipped."""
        repo = self.new_repo()
        wheel = self.tmp / f"torch-{INSTALLED}-cp311-cp311-linux_x86_64.whl"
        site = Path(torch.__file__).parent.parent
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(site / "torch/version.py", "torch/version.py")
            for path in (site / "torch/distributed/fsdp/_fully_shard").glob("*.py"):
                zf.write(path, str(path.relative_to(site)))
            for rel in OUTSIDE_FILES:
                zf.write(site / rel, rel)
        proc = run(repo, "tools/patches.py", "check", "--torch", str(wheel))
        self.assertSucceeds(proc)
        self.assertIn("ok: export round trip is a no-op", proc.stdout)
        self.assertIn("skipped: the generated copy", proc.stdout)

    def test_base_other_than_torch_names_fix(self):
        """Tests that --base naming a release other than the given torch names --torch as the fix."""
        repo = self.new_repo()
        self.add_base(repo, "9.9.9")
        proc = run(
            repo,
            "tools/patches.py",
            "workspace",
            "init",
            "--base",
            "9.9.9",
            "--dir",
            str(self.tmp / "ws"),
        )
        self.assertFails(proc, "--base 9.9.9 needs the pristine files of torch 9.9.9", "--torch")


class TestPatchToolingStack(_TempRepoTestCase):
    def test_names_the_first_position_whose_tests_fail(self):
        """Tests that ``patches.py stack`` fails at the first patch whose upstream-path
        tests fail at its position, though the top of the series would pass:
        here 0001's test asserts the opposite and the next patch is ignored."""
        repo = self.new_repo()
        first = series(repo)[0]
        text = first.read_text()
        # The first assertTrue/assertFalse that the patch's test adds, negated
        match = re.search(r"^\+ +self\.assert(True|False)\(", text, re.M)
        self.assertIsNotNone(match)
        negated = match.group(0).replace(
            match.group(1), "False" if match.group(1) == "True" else "True"
        )
        first.write_text(text[: match.start()] + negated + text[match.end() :])
        proc = run(repo, "tools/patches.py", "stack")
        self.assertFails(proc, f"{first.name}: 1 failed", "tests fail at position 1 of patches/")
        self.assertNotIn(series(repo)[1].name, proc.stdout)


class TestPatchToolingApplyToPytorch(_TempRepoTestCase):
    def init_checkout(self, repo: Path, name: str) -> Path:
        """A git repo holding the pristine base files at upstream paths, via patchlib.common."""
        path = self.tmp / name
        code = (
            "import argparse, sys; from pathlib import Path; sys.path.insert(0, 'tools'); "
            "from patchlib.common import init_base_repo, resolve_target; "
            "target = resolve_target(argparse.Namespace(base=None, torch=None)); "
            "init_base_repo(Path(sys.argv[1]), target)"
        )
        self.assertSucceeds(run(repo, "-c", code, str(path)))
        return path

    def test_applies_one_commit_per_patch(self):
        """Tests that ``patches.py apply`` commits each series entry onto a base checkout."""
        repo = self.new_repo()
        checkout = self.init_checkout(repo, "pytorch")
        proc = run(repo, "tools/patches.py", "apply", str(checkout))
        self.assertSucceeds(proc)
        self.assertIn("note: HEAD is", proc.stdout)
        subjects = [
            email.message_from_bytes(p.read_bytes(), policy=email.policy.default)["Subject"]
            for p in series(repo)
        ]
        self.assertTrue(subjects)
        self.assertEqual(
            git(checkout, "log", "--reverse", "--format=%s", "base..HEAD").splitlines(),
            [s.removeprefix("[PATCH] ") for s in subjects],
        )
        self.assertEqual(git(checkout, "status", "--porcelain"), "")

    def test_refuses_checkout_not_at_base(self):
        """Tests that ``patches.py apply`` refuses a checkout whose base file differs, naming git checkout."""
        repo = self.new_repo()
        checkout = self.init_checkout(repo, "pytorch")
        with open(checkout / "torch/distributed/fsdp/_fully_shard/_fully_shard.py", "a") as f:
            f.write("# a later upstream change\n")
        git(checkout, "commit", "-qam", "later change")
        head = git(checkout, "rev-parse", "HEAD")
        proc = run(repo, "tools/patches.py", "apply", str(checkout))
        self.assertFails(proc, "is not at the base", "_fully_shard.py", "Fix: git checkout ")
        self.assertEqual(git(checkout, "rev-parse", "HEAD"), head)


class TestPatchToolingWheel(_TempRepoTestCase):
    def test_wheel_contains_generated_copy_and_series(self):
        """Tests that pip wheel --no-build-isolation ships the generated copy and
        the series, and not the test harness (slow, ~20 s)."""
        repo = self.new_repo(build=True)
        out = self.tmp / "dist"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "--disable-pip-version-check",
                "-w",
                str(out),
                str(repo),
            ],
            cwd=self.tmp,
            env=_env(repo),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.assertSucceeds(proc)
        (wheel,) = out.glob("torch_fsdp_ext-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            stamp = json.loads(zf.read("torch_fsdp_ext/_fully_shard/VENDORED.json"))
        for name in (
            "torch_fsdp_ext/__init__.py",
            "torch_fsdp_ext/_upstream_types.py",
            "torch_fsdp_ext/_vendor.py",
            "torch_fsdp_ext/_fully_shard/_fully_shard.py",
            "torch_fsdp_ext/_fully_shard/VENDORED.json",
            "torch_fsdp_ext/_patches/bases.toml",
            f"torch_fsdp_ext/_patches/{INSTALLED}/series",
            f"torch_fsdp_ext/_patches/{INSTALLED}/base.toml",
            *(f"torch_fsdp_ext/_patches/{INSTALLED}/{p.name}" for p in series(repo)),
            *(f"torch_fsdp_ext/_fully_shard/{n}" for n in stamp["files"]),
        ):
            self.assertIn(name, names)
        # The package holds only what users import: no test harness
        self.assertEqual([n for n in names if "fsdp_ext_testing" in n], [])


if __name__ == "__main__":
    run_tests()
