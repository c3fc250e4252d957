# Owner(s): ["oncall: distributed"]
"""Tests for the patch tooling: tools/*.py and the import-time checks in _vendor.py.

Every test works on a throwaway copy of the repository layout in a temporary
directory and runs the tools there as subprocesses; the tools locate everything
relative to their own file, so the real patches/, the real generated copy and
the installed torch are never touched.
"""

import email
import email.policy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from torch.testing._internal.common_utils import TestCase, run_tests

REPO = Path(__file__).resolve().parent.parent
# What the tools and the package need; setup.py & co. only for building a wheel.
LAYOUT = (
    "patches",
    "tools",
    "torch_fsdp_ext/_vendor.py",
    "torch_fsdp_ext/__init__.py",
    "torch_fsdp_ext/_testing",
    "test/upstream",
)
BUILD_LAYOUT = ("setup.py", "pyproject.toml", "README.md")
TOOLS = sorted(p.name for p in (REPO / "tools").glob("*.py") if not p.name.startswith("_"))
VENDORED = Path("torch_fsdp_ext/_fully_shard")
# A fixed git identity, so apply_to_pytorch.py (which commits as the user) also
# works where no identity is configured.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.invalid",
}


def make_repo(dest: Path, *, vendored: bool = False, build: bool = False) -> Path:
    """Copy the repository layout to ``dest``; optionally generate the copy there."""
    for rel in LAYOUT + (BUILD_LAYOUT if build else ()):
        src, dst = REPO / rel, dest / rel
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
    if vendored:
        proc = run(dest, "tools/vendor.py")
        if proc.returncode != 0:
            raise RuntimeError(f"tools/vendor.py failed:\n{proc.stdout}")
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


def series(repo: Path) -> list[Path]:
    lines = (repo / "patches" / "series").read_text().splitlines()
    names = [line.split("#", 1)[0].strip() for line in lines]
    return [repo / "patches" / name for name in names if name]


class _TempRepoTestCase(TestCase):
    def setUp(self):
        super().setUp()
        tmp = tempfile.TemporaryDirectory(prefix="torch_fsdp_ext-test-")
        self.addCleanup(tmp.cleanup)
        self.tmp = Path(tmp.name)

    def new_repo(self, name: str = "repo", **kwargs) -> Path:
        return make_repo(self.tmp / name, **kwargs)

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
    """check_patches.py on a shared, unmodified copy and on copies with one defect each."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._shared_tmp = tempfile.TemporaryDirectory(prefix="torch_fsdp_ext-test-")
        cls.repo = make_repo(Path(cls._shared_tmp.name) / "repo", vendored=True)

    @classmethod
    def tearDownClass(cls):
        cls._shared_tmp.cleanup()
        super().tearDownClass()

    def test_unchanged_copy_passes(self):
        """Tests that check_patches.py passes on an unmodified copy of the repository."""
        proc = run(self.repo, "tools/check_patches.py")
        self.assertSucceeds(proc)
        self.assertIn("ok: export round trip is a no-op", proc.stdout)
        self.assertIn(str(self.repo / VENDORED), proc.stdout)

    @pytest.mark.slow
    def test_every_tool_answers_help(self):
        """Tests that every tools/*.py not starting with _ answers --help with exit 0."""
        self.assertIn("check_patches.py", TOOLS)
        for tool in TOOLS:
            with self.subTest(tool=tool):
                proc = run(self.repo, f"tools/{tool}", "--help")
                self.assertSucceeds(proc)
                self.assertIn("usage:", proc.stdout)

    def test_tampered_context_line(self):
        """Tests that a patch whose context no longer matches the base is named as not applying."""
        repo = self.new_repo()
        patch = series(repo)[0]
        lines = patch.read_text().splitlines(keepends=True)
        start = next(i for i, line in enumerate(lines) if line.startswith("diff --git a/torch/"))
        hunk = next(i for i in range(start, len(lines)) if lines[i].startswith("@@"))
        ctx = next(i for i in range(hunk, len(lines)) if lines[i].startswith(" "))
        lines[ctx] = lines[ctx].rstrip("\n") + "  # tampered\n"
        patch.write_text("".join(lines))
        proc = run(repo, "tools/check_patches.py")
        self.assertFails(proc, f"{patch.name} does not apply", "tools/workspace.py")

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
        proc = run(repo, "tools/check_patches.py")
        self.assertFails(proc, f"exporting again changes ['{patch.name}']", "workspace.py export")
        self.assertIn("patch(es) apply cleanly", proc.stdout)

    def test_modified_upstream_file(self):
        """Tests that an installed base file with another sha256 names pip install as the fix."""
        repo = self.new_repo(vendored=True)
        base = repo / "patches" / "base.toml"
        text = base.read_text()
        digest = re.search(r'= "([0-9a-f]{64})"', text).group(1)
        base.write_text(text.replace(digest, "0" * 64))
        proc = run(repo, "tools/check_patches.py")
        self.assertFails(proc, "does not match the pinned base", "pip install")

    def test_wrong_torch_version(self):
        """Tests that a torch version other than the base names pip install torch== as the fix."""
        repo = self.new_repo(vendored=True)
        base = repo / "patches" / "base.toml"
        text = base.read_text()
        text, n = re.subn(r'^version = "[^"]+"', 'version = "1.0.0"', text, flags=re.M)
        self.assertEqual(n, 1)
        base.write_text(text)
        proc = run(repo, "tools/check_patches.py")
        self.assertFails(proc, "pip install torch==1.0.0")

    def test_stale_generated_copy(self):
        """Tests that a hand-edited generated file fails the check and names tools/vendor.py."""
        repo = self.new_repo(vendored=True)
        with open(repo / VENDORED / "_fully_shard.py", "a") as f:
            f.write("# edited by hand\n")
        proc = run(repo, "tools/check_patches.py")
        self.assertFails(proc, "['_fully_shard.py']", "python tools/vendor.py")
        self.assertSucceeds(run(repo, "tools/vendor.py"))
        self.assertSucceeds(run(repo, "tools/check_patches.py"))


class TestPatchToolingWorkspace(_TempRepoTestCase):
    @pytest.mark.slow
    def test_export_round_trip_is_noop(self):
        """Tests that workspace.py init then export leaves every file in patches/ byte-identical."""
        repo = self.new_repo(vendored=True)
        before = snapshot(repo / "patches")
        generated = snapshot(repo / VENDORED)
        ws = self.tmp / "ws"
        self.assertSucceeds(run(repo, "tools/workspace.py", "init", "--dir", str(ws)))
        self.assertEqual(git(ws, "tag", "--list"), "base\n")
        self.assertSucceeds(run(repo, "tools/workspace.py", "export", "--dir", str(ws)))
        self.assertEqual(snapshot(repo / "patches"), before)
        self.assertEqual(snapshot(repo / VENDORED), generated)


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
        """Tests that importing a copy generated from another series fails naming tools/vendor.py."""
        repo = self.new_repo(vendored=True)
        self.assertShadowsInstalled(repo)
        with open(repo / "patches" / "series", "a") as f:
            f.write("# a comment changes the series digest too\n")
        proc = run(repo, "-c", "import torch_fsdp_ext")
        self.assertFails(proc, "is stale", "python tools/vendor.py")

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


class TestPatchToolingApplyToPytorch(_TempRepoTestCase):
    def init_checkout(self, repo: Path, name: str) -> Path:
        """A git repo holding the pristine base files at upstream paths, via _patchlib."""
        path = self.tmp / name
        code = (
            "import sys; from pathlib import Path; sys.path.insert(0, 'tools'); "
            "from _patchlib import init_base_repo; init_base_repo(Path(sys.argv[1]))"
        )
        self.assertSucceeds(run(repo, "-c", code, str(path)))
        return path

    def test_applies_one_commit_per_patch(self):
        """Tests that apply_to_pytorch.py commits each series entry onto a base checkout."""
        repo = self.new_repo()
        checkout = self.init_checkout(repo, "pytorch")
        proc = run(repo, "tools/apply_to_pytorch.py", str(checkout))
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
        """Tests that apply_to_pytorch.py refuses a checkout whose base file differs, naming git checkout."""
        repo = self.new_repo()
        checkout = self.init_checkout(repo, "pytorch")
        with open(checkout / "torch/distributed/fsdp/_fully_shard/_fully_shard.py", "a") as f:
            f.write("# a later upstream change\n")
        git(checkout, "commit", "-qam", "later change")
        head = git(checkout, "rev-parse", "HEAD")
        proc = run(repo, "tools/apply_to_pytorch.py", str(checkout))
        self.assertFails(proc, "is not at the base", "_fully_shard.py", "Fix: git checkout ")
        self.assertEqual(git(checkout, "rev-parse", "HEAD"), head)


class TestPatchToolingWheel(_TempRepoTestCase):
    def test_wheel_contains_generated_copy_and_series(self):
        """Tests that pip wheel --no-build-isolation ships the generated copy and the series (slow, ~20 s)."""
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
            "torch_fsdp_ext/_testing/moe.py",
            "torch_fsdp_ext/_vendor.py",
            "torch_fsdp_ext/_fully_shard/_fully_shard.py",
            "torch_fsdp_ext/_fully_shard/VENDORED.json",
            "torch_fsdp_ext/_patches/series",
            "torch_fsdp_ext/_patches/base.toml",
            *(f"torch_fsdp_ext/_patches/{p.name}" for p in series(repo)),
            *(f"torch_fsdp_ext/_fully_shard/{n}" for n in stamp["files"]),
        ):
            self.assertIn(name, names)


if __name__ == "__main__":
    run_tests()
