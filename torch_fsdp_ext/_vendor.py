"""Generate ``torch_fsdp_ext._fully_shard`` from the installed torch plus ``patches/``.

The vendored copy is *derived*, never edited: it is the installed torch's own
``torch/distributed/fsdp/_fully_shard/*.py`` at a supported base (checked by
sha256), with that base's ``git format-patch`` series
(``patches/<torch version>/``) applied by ``git apply`` and a small, fixed set
of rewrites (:data:`REWRITES`), plus ``_deterministic.py``: the one class the
series adds to FSDP's test utilities (:data:`TEST_UTILITY_SOURCE`), which the
package exports. A stamp file records what the copy was
generated from and the sha256 of every generated file, so a copy generated from
another series, or edited or damaged afterwards, is refused at import.

This module uses only the standard library: ``setup.py`` loads it by path in
build environments that may not have torch installed.
"""

from __future__ import annotations

import ast
import contextlib
import email
import email.policy
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "torch_fsdp_ext"
UPSTREAM_MODULE = "torch.distributed.fsdp._fully_shard"
UPSTREAM_DIR = "torch/distributed/fsdp/_fully_shard"
# Upstream keeps ``DeterministicReduceScatter`` with FSDP's test utilities;
# the package exports it, from a module generated out of that file
TEST_UTILITY_SOURCE = "torch/testing/_internal/common_fsdp.py"
# Upstream files the series also changes, outside UPSTREAM_DIR: pinned in each
# base.toml and linted like the rest, never generated into the package whole
# (``torch_fsdp_ext/__init__.py`` exports the same public names itself; of
# the test utilities only :data:`TEST_UTILITY_CLASS` is generated)
OUTSIDE_FILES = ("torch/distributed/fsdp/__init__.py", TEST_UTILITY_SOURCE)
TEST_UTILITY_CLASS = "DeterministicReduceScatter"
TEST_UTILITY_MODULE = "_deterministic.py"
TEST_UTILITY_HEADER = f'''"""``{TEST_UTILITY_CLASS}``, generated from ``{TEST_UTILITY_SOURCE}``
with the series applied (see ``torch_fsdp_ext._vendor``)."""

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from ._fsdp_api import _ReduceOp, ReduceScatter


'''
UPSTREAM_TEST_DIR = "test/distributed/_composable/fsdp"
VENDORED_NAME = "_fully_shard"
# The vendored copy registers its custom ops (upstream's ``fsdp::*``) here.
OPS_NAMESPACE = "fsdp_ext"
STAMP_NAME = "VENDORED.json"
# patches/bases.toml names the primary base; each base is patches/<version>/.
BASES_FILE = "bases.toml"

PACKAGE_DIR = Path(__file__).resolve().parent
VENDORED_DIR = PACKAGE_DIR / VENDORED_NAME


class VendorError(RuntimeError):
    """The vendored copy cannot be generated or is out of date; the message names the fix."""


@dataclass(frozen=True)
class Rewrite:
    """A literal replacement in one generated file, ``count`` times exactly (or
    any of the counts of a tuple, where positions of the series differ); on
    every base, or only on ``bases`` (where the upstream files differ)."""

    file: str
    old: str
    new: str
    count: int | tuple[int, ...]
    why: str
    bases: tuple[str, ...] | None = None


# Rewrites turn upstream's module into a relocated copy. Each has an exact count
# so that an upstream change that moves the target fails generation loudly
# instead of silently producing a different package.
# torch 2.9.0's FSDP2 predates per-parameter meshes (no ShardPlacementResult,
# no DataParallelMeshDims) and constructs the original class from a literal
# MRO index
_SINCE_2_14 = ("2.14.1", "2.15.0")

REWRITES: tuple[Rewrite, ...] = (
    Rewrite(
        "_fsdp_collectives.py",
        f"from {UPSTREAM_MODULE}.",
        f"from {PACKAGE}.{VENDORED_NAME}.",
        1,
        "absolute self-imports must resolve to the vendored copy",
    ),
    Rewrite(
        "_fsdp_param.py",
        f"from {UPSTREAM_MODULE}.",
        f"from {PACKAGE}.{VENDORED_NAME}.",
        1,
        "absolute self-imports must resolve to the vendored copy",
        _SINCE_2_14,
    ),
    *(
        Rewrite(
            file,
            'torch.library.Library("fsdp", "FRAGMENT")',
            f'torch.library.Library("{OPS_NAMESPACE}", "FRAGMENT")',
            1,
            "upstream already defines the fsdp:: ops; a second definition is an error",
        )
        for file in ("_fsdp_collectives.py", "_fsdp_param.py")
    ),
    *(
        Rewrite(
            file,
            "torch.ops.fsdp.",
            f"torch.ops.{OPS_NAMESPACE}.",
            count,
            "calls must reach the vendored copy's own ops",
            bases,
        )
        for file, count, bases in (
            ("_fsdp_collectives.py", 4, ("2.9.0",)),
            ("_fsdp_collectives.py", 4, ("2.14.1",)),
            ("_fsdp_collectives.py", 5, ("2.15.0",)),
            ("_fsdp_param.py", 2, _SINCE_2_14),
            ("_fsdp_param.py", 3, ("2.9.0",)),
        )
    ),
    Rewrite(
        "_fsdp_collectives.py",
        f"torch.ops.{OPS_NAMESPACE}.chunk_cat_mixed_dtype(",
        "torch.ops.fsdp.chunk_cat_mixed_dtype(",
        1,
        "a C++ op of torch's own fsdp namespace that the vendored copy does not define",
        bases=("2.15.0",),
    ),
    Rewrite(
        "_fully_shard.py",
        "\nclass FSDPModule:\n",
        "\nclass FSDPModule(_UpstreamFSDPModule):\n",
        1,
        "torch code checks isinstance(m, torch.distributed.fsdp.FSDPModule)",
    ),
    Rewrite(
        "_fully_shard.py",
        "    _orig_cls_mro_index: int = 2\n",
        "    _orig_cls_mro_index: int = 3\n",
        1,
        "the upstream base class adds one entry to the MRO: "
        "[FSDP<Orig>, FSDPModule, upstream FSDPModule, Orig, ...]",
        _SINCE_2_14,
    ),
    Rewrite(
        "_fully_shard.py",
        "        orig_cls = cls.__mro__[2]\n",
        "        orig_cls = cls.__mro__[3]\n",
        1,
        "the upstream base class adds one entry to the MRO: "
        "[FSDP<Orig>, FSDPModule, upstream FSDPModule, Orig, ...]",
        ("2.9.0",),
    ),
    Rewrite(
        "_fully_shard.py",
        "from torch.distributed._composable import contract\n",
        "from torch.distributed._composable import contract\n"
        "from torch.distributed.fsdp import FSDPModule as _UpstreamFSDPModule\n",
        1,
        "base class for the isinstance rewrite above",
    ),
    Rewrite(
        "_fsdp_common.py",
        '    raise ValueError(f"Invalid shard_placement_fn result: {result}")\n',
        f"    from {PACKAGE}._upstream_types import from_upstream_shard_placement_result\n\n"
        "    if (converted := from_upstream_shard_placement_result(result)) is not None:\n"
        "        return converted\n"
        '    raise ValueError(f"Invalid shard_placement_fn result: {result}")\n',
        1,
        "torchtitan-style code returns torch's own ShardPlacementResult",
        _SINCE_2_14,
    ),
    Rewrite(
        "_fully_shard.py",
        '    torch._C._log_api_usage_once("torch.distributed.fsdp.fully_shard")\n',
        '    torch._C._log_api_usage_once("torch.distributed.fsdp.fully_shard")\n'
        f"    from {PACKAGE}._upstream_types import from_upstream_fully_shard_args\n\n"
        "    mp_policy, offload_policy, dp_mesh_dims = from_upstream_fully_shard_args(\n"
        "        mp_policy, offload_policy, dp_mesh_dims\n"
        "    )\n",
        1,
        "torch's own CPUOffloadPolicy would fail the copy's isinstance checks and "
        "silently not offload; its MixedPrecisionPolicy and DataParallelMeshDims "
        "become ours too",
        _SINCE_2_14,
    ),
    Rewrite(
        "_fully_shard.py",
        '    torch._C._log_api_usage_once("torch.distributed.fsdp.fully_shard")\n',
        '    torch._C._log_api_usage_once("torch.distributed.fsdp.fully_shard")\n'
        f"    from {PACKAGE}._upstream_types import from_upstream_fully_shard_args\n\n"
        "    mp_policy, offload_policy, _ = from_upstream_fully_shard_args(\n"
        "        mp_policy, offload_policy, None\n"
        "    )\n",
        1,
        "torch's own CPUOffloadPolicy would fail the copy's isinstance checks and "
        "silently not offload; its MixedPrecisionPolicy becomes ours too",
        ("2.9.0",),
    ),
    *(
        # Innermost decorator, anchored on the def line alone: the decorators
        # above it differ between positions of the series (``tools/patches.py
        # stack`` generates the package at each one).
        Rewrite(
            "_fsdp_param_group.py",
            f"\n    def {method}(",
            f"\n    @_outside_autograd_context\n    def {method}(",
            # FSDPParamGroup's, and from the per-parameter PRs on, the
            # override of PerParamFSDPParamGroup
            (1, 2),
            "c10d's exit abort (docs/upstream-gloo-exit-abort.md): both "
            "collective modes issue their collectives without autograd's "
            "stashed context, see _exit_guard.py",
            _SINCE_2_14,
        )
        for method in ("unshard", "post_backward")
    ),
    Rewrite(
        "_fsdp_param_group.py",
        "\nimport torch\n",
        "\nimport torch\n"
        f"from {PACKAGE}._exit_guard import (\n"
        "    outside_autograd_context as _outside_autograd_context,\n"
        ")\n",
        1,
        "the decorator of the rewrite above",
        _SINCE_2_14,
    ),
    Rewrite(
        "_fsdp_init.py",
        "    device_handle = _get_device_handle(mesh.device_type)\n",
        '    if mesh.device_type == "xla":\n'
        f"        from {PACKAGE}.xla import _ensure_registered\n\n"
        "        _ensure_registered()\n"
        "    device_handle = _get_device_handle(mesh.device_type)\n",
        1,
        "torch has no device module for xla; the package's xla registration "
        "provides it, so it must run before FSDP asks for the device handle",
    ),
    Rewrite(
        "_fsdp_init.py",
        "        post_forward_mesh = DeviceMesh(\n"
        "            mesh_info.mesh.device_type, post_forward_mesh_tensor\n"
        "        )\n",
        '        if mesh_info.mesh.device_type == "xla":\n'
        f"            from {PACKAGE}.xla import _mesh_from_tensor\n\n"
        "            post_forward_mesh = _mesh_from_tensor(post_forward_mesh_tensor)\n"
        "        else:\n"
        "            post_forward_mesh = DeviceMesh(\n"
        "                mesh_info.mesh.device_type, post_forward_mesh_tensor\n"
        "            )\n",
        1,
        "DeviceMesh makes no process groups for xla; reshard_after_forward=<int> "
        "needs them for its post-forward mesh",
    ),
)

# Project tests that travel upstream import the package; in the series they
# import torch. Longest prefix first.
TEST_REWRITES: tuple[tuple[str, str], ...] = (
    # A test that also imports other test utilities names the class on the
    # line above their import, which upstream is one import
    (
        f"from {PACKAGE} import {TEST_UTILITY_CLASS}\n"
        f"from {TEST_UTILITY_SOURCE[:-3].replace('/', '.')} import (\n",
        f"from {TEST_UTILITY_SOURCE[:-3].replace('/', '.')} import (\n    {TEST_UTILITY_CLASS},\n",
    ),
    # A test imports the test utility on a line of its own
    (
        f"from {PACKAGE} import {TEST_UTILITY_CLASS}\n",
        f"from {TEST_UTILITY_SOURCE[:-3].replace('/', '.')} import {TEST_UTILITY_CLASS}\n",
    ),
    (f"{PACKAGE}.{VENDORED_NAME}", UPSTREAM_MODULE),
    (f"from {PACKAGE} import", "from torch.distributed.fsdp import"),
    (f"import {PACKAGE}\n", "import torch.distributed.fsdp\n"),
)


@dataclass(frozen=True)
class Base:
    """A pinned upstream base, read from ``patches/<version>/base.toml``."""

    torch_version: str
    commit: str
    files: dict[str, str]  # upstream path -> sha256
    # Subject -> reason, for each patch of the primary base's series that this
    # base leaves out (``[series.omitted]``; only a port to another release may)
    omitted: dict[str, str] = field(default_factory=dict)


def patches_root() -> Path:
    """``patches/`` in a source checkout, or the copy shipped inside a wheel."""
    checkout = PACKAGE_DIR.parent / "patches"
    if (checkout / BASES_FILE).is_file():
        return checkout
    return PACKAGE_DIR / "_patches"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def supported_versions(root: Path | None = None) -> list[str]:
    """The torch releases with a series, oldest first."""
    root = patches_root() if root is None else root
    return sorted((p.parent.name for p in root.glob("*/base.toml")), key=_version_key)


def primary_version(root: Path | None = None) -> str:
    """The base the upstream PR targets and the other bases are ported from."""
    root = patches_root() if root is None else root
    with open(root / BASES_FILE, "rb") as f:
        return tomllib.load(f)["primary"]


def rfc_stack_length(pdir: Path, root: Path | None = None) -> int:
    """How many patches of ``pdir``'s series form the RFC stack (bases.toml's
    ``rfc_stack_last`` and the patches before it); the rest are follow-ups."""
    root = patches_root() if root is None else root
    with open(root / BASES_FILE, "rb") as f:
        last = tomllib.load(f)["rfc_stack_last"]
    subjects = [patch_subject(patch) for patch in read_series(pdir)]
    if last not in subjects:
        raise VendorError(
            f"{pdir / 'series'} lacks {last!r}, the last patch of the RFC stack that "
            f"{root / BASES_FILE} names; every base carries it"
        )
    return subjects.index(last) + 1


def release(version: str) -> str:
    """``2.14.1+cu128`` -> ``2.14.1``: builds of one release share their Python files."""
    return version.split("+", 1)[0]


def patches_dir(version: str, root: Path | None = None) -> Path:
    """The series for torch ``version``; :class:`VendorError` listing the supported ones if none."""
    root = patches_root() if root is None else root
    pdir = root / release(version)
    if not (pdir / "base.toml").is_file():
        supported = supported_versions(root)
        raise VendorError(
            f"torch {version} is not supported: torch_fsdp_ext has patch series for "
            f"torch {', '.join(supported)} only. "
            f"Fix: pip install torch=={primary_version(root)} (the primary base)"
        )
    return pdir


def read_base(pdir: Path) -> Base:
    with open(pdir / "base.toml", "rb") as f:
        data = tomllib.load(f)
    return Base(
        data["torch"]["version"],
        data["torch"]["commit"],
        dict(data["files"]),
        dict(data.get("series", {}).get("omitted", {})),
    )


def read_series(pdir: Path) -> list[Path]:
    names = []
    for line in (pdir / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    missing = [n for n in names if not (pdir / n).is_file()]
    if missing:
        raise VendorError(f"{pdir / 'series'} lists missing patches: {missing}")
    return [pdir / n for n in names]


def patch_subject(patch: Path) -> str:
    """The ``Subject:`` of a ``git format-patch`` file, without ``[PATCH]``."""
    with open(patch, "rb") as f:
        subject = email.message_from_binary_file(f, policy=email.policy.default)["Subject"]
    return subject.removeprefix("[PATCH] ")


def created_test_files(patch: Path) -> list[str]:
    """The upstream-path tests that ``patch`` creates (``new file mode``)."""
    created = []
    for chunk in patch.read_text().split("\ndiff --git a/")[1:]:
        path = chunk.split(" ", 1)[0]
        header = chunk.split("\n@@", 1)[0]
        if path.startswith(f"{UPSTREAM_TEST_DIR}/") and "\nnew file mode" in header:
            created.append(path)
    return created


def omitted_tests(version: str, root: Path | None = None) -> dict[str, tuple[str, str]]:
    """Upstream test path -> (subject, reason), for each test created by a
    primary patch that the base ``version`` leaves out: that base neither
    carries nor runs it."""
    root = patches_root() if root is None else root
    omitted = read_base(patches_dir(version, root)).omitted
    if not omitted:
        return {}
    tests = {}
    for patch in read_series(patches_dir(primary_version(root), root)):
        subject = patch_subject(patch)
        if subject in omitted:
            for path in created_test_files(patch):
                tests[path] = (subject, omitted[subject])
    return tests


def torch_root() -> Path:
    """The installed torch package directory, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise VendorError(
            f"torch is not installed. Fix: pip install torch=={primary_version()} "
            f"(supported: {', '.join(supported_versions())})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _version_py_field(root: Path, name: str) -> str:
    match = re.search(rf"^{name} = '([^']+)'", (root / "version.py").read_text(), re.M)
    if match is None:
        raise VendorError(f"cannot read {name} from {root / 'version.py'}")
    return match.group(1)


def installed_torch_version(root: Path) -> str:
    return _version_py_field(root, "__version__")


def installed_release() -> str:
    """The release of the installed torch, e.g. ``2.14.1`` for ``2.14.1+cu130``."""
    return release(installed_torch_version(torch_root()))


def torch_commit(root: Path) -> str:
    """The upstream commit a torch build was made from."""
    return _version_py_field(root, "git_version")


def upstream_files(top: Path) -> list[str]:
    """The series' upstream paths present under ``top`` (a site-packages or a
    tree at upstream paths): ``UPSTREAM_DIR/*.py`` and :data:`OUTSIDE_FILES`."""
    return sorted(
        [f"{UPSTREAM_DIR}/{p.name}" for p in (top / UPSTREAM_DIR).glob("*.py")]
        + [rel for rel in OUTSIDE_FILES if (top / rel).is_file()]
    )


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_upstream(root: Path, base: Base) -> None:
    """Raise :class:`VendorError` unless ``root`` holds exactly the base files."""
    version = installed_torch_version(root)
    if release(version) != base.torch_version:
        raise VendorError(
            f"this series is for torch {base.torch_version}, but torch "
            f"{version} is installed at {root}. "
            f"Fix: pip install torch=={base.torch_version}"
        )
    site = root.parent
    upstream = site / UPSTREAM_DIR
    on_disk = {f"{UPSTREAM_DIR}/{p.name}" for p in upstream.glob("*.py")}
    unexpected = sorted(on_disk - base.files.keys())
    changed = sorted(
        path
        for path, digest in base.files.items()
        if not (site / path).is_file() or sha256((site / path).read_bytes()) != digest
    )
    if changed or unexpected:
        raise VendorError(
            f"the installed torch {version} at {root} does not match the pinned base "
            f"(torch {base.torch_version}, {base.commit[:12]}): "
            f"modified or missing {changed}, unexpected {unexpected}. "
            f"Fix: pip install --force-reinstall torch=={base.torch_version}"
        )


def rewrites_for(version: str) -> tuple[Rewrite, ...]:
    return tuple(rw for rw in REWRITES if rw.bases is None or version in rw.bases)


def series_digest(pdir: Path) -> str:
    """Digest of everything that determines the generated copy besides torch itself."""
    h = hashlib.sha256()
    for path in [pdir / "base.toml", pdir / "series", *read_series(pdir)]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr(rewrites_for(read_base(pdir).torch_version)).encode())
    return h.hexdigest()


def apply_series(root: Path, pdir: Path, workdir: Path) -> None:
    """Copy the pristine base files to ``workdir`` at upstream paths and ``git apply`` the series."""
    dest = workdir / UPSTREAM_DIR
    dest.mkdir(parents=True)
    for path in read_base(pdir).files:
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root.parent / path, workdir / path)
    for patch in read_series(pdir):
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch)],
            cwd=workdir,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise VendorError(
                f"{patch.name} does not apply to the pristine base files:\n"
                f"{proc.stderr.strip()}\n"
                "Fix: rebuild the series with tools/patches.py workspace (see CONTRIBUTING.md)"
            )


def rewrite(name: str, text: str, version: str) -> str:
    for rw in rewrites_for(version):
        if rw.file != name:
            continue
        found = text.count(rw.old)
        if found not in (rw.count if isinstance(rw.count, tuple) else (rw.count,)):
            raise VendorError(
                f"rewrite of {name} (torch {version}) expected {rw.count} "
                f"occurrence(s) of {rw.old!r}, "
                f"found {found}; the patch series or the base changed under it "
                f"({rw.why}). Fix: update REWRITES in {__file__}"
            )
        text = text.replace(rw.old, rw.new)
    return text


def rewrite_test(text: str) -> str:
    """The upstream-path form of a project test file."""
    for old, new in TEST_REWRITES:
        text = text.replace(old, new)
    return text


def test_utility(workdir: Path) -> dict[str, str]:
    """:data:`TEST_UTILITY_MODULE` and its text, from the patched
    :data:`TEST_UTILITY_SOURCE` under ``workdir``; nothing before the patch
    that adds the class."""
    source = workdir / TEST_UTILITY_SOURCE
    text = source.read_text() if source.is_file() else ""
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == TEST_UTILITY_CLASS:
            segment = ast.get_source_segment(text, node)
            return {TEST_UTILITY_MODULE: f"{TEST_UTILITY_HEADER}{segment}\n"}
    return {}


def render(root: Path, pdir: Path) -> dict[str, bytes]:
    """Return the generated package files, by file name, including the stamp."""
    base = read_base(pdir)
    check_upstream(root, base)
    with tempfile.TemporaryDirectory(prefix="torch_fsdp_ext-") as tmp:
        apply_series(root, pdir, Path(tmp))
        files = {
            p.name: rewrite(p.name, p.read_text(), base.torch_version).encode()
            for p in sorted((Path(tmp) / UPSTREAM_DIR).glob("*.py"))
        }
        files.update({name: text.encode() for name, text in test_utility(Path(tmp)).items()})
    stamp = {
        "torch_version": base.torch_version,
        "commit": base.commit,
        "series_digest": series_digest(pdir),
        "files": {name: sha256(data) for name, data in files.items()},
    }
    files[STAMP_NAME] = (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode()
    return files


def read_stamp(dest: Path) -> dict | None:
    try:
        return json.loads((dest / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    # Ranks started together by torchrun import concurrently; one generates,
    # the others wait and then see the finished copy.
    with open(dest.parent / f".{dest.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write(dest: Path, files: dict[str, bytes]) -> None:
    """Replace ``dest`` with ``files``. The new tree is built beside it and renamed in;
    on any failure the previous tree stays and nothing else is left behind."""
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    old = None
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        # mkdtemp creates 0700; the copy must be readable like the rest of the package
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)
        if dest.exists():
            old = dest.with_name(f"{staging.name}-old")
            dest.rename(old)
        staging.rename(dest)
    except BaseException:
        if old is not None and not dest.exists():
            old.rename(dest)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def installed_series() -> tuple[Path, Path]:
    """The installed torch and the series for it."""
    root = torch_root()
    return root, patches_dir(installed_torch_version(root))


def vendor(dest: Path = VENDORED_DIR, root: Path | None = None, pdir: Path | None = None) -> bool:
    """Regenerate ``dest`` if it differs from base + series. Returns whether it wrote.

    ``root`` and ``pdir`` default to the installed torch and its series.
    """
    if root is None or pdir is None:
        root, pdir = installed_series()
    with _locked(dest):
        files = render(root, pdir)
        if dest.is_dir() and _read_tree(dest) == files:
            return False
        write(dest, files)
        return True


def _read_tree(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()}


def diff(dest: Path, root: Path, pdir: Path) -> list[str]:
    """Names of files in ``dest`` that differ from ``root``'s base + ``pdir`` + rewrites."""
    want = render(root, pdir)
    have = _read_tree(dest) if dest.is_dir() else {}
    return sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))


def _damaged_files(dest: Path, stamp: dict) -> list[str]:
    """Generated files that are missing, changed or unexpected relative to the stamp."""
    want = {**stamp.get("files", {}), STAMP_NAME: None}
    have = {p.name for p in dest.iterdir() if p.is_file()}
    damaged = sorted((have - want.keys()) | (want.keys() - have))
    damaged += sorted(
        name
        for name, digest in want.items()
        if digest is not None and name in have and sha256((dest / name).read_bytes()) != digest
    )
    return damaged


def ensure_vendored() -> None:
    """Import-time check: generate a missing copy, refuse a stale or damaged one.

    A missing copy is generated (editable installs and builds without torch
    defer generation to first import). A copy generated from another series or
    base, or whose files no longer match the sha256 in its stamp, is never
    silently replaced: the error names the command to run.
    """
    root, pdir = installed_series()
    check_upstream(root, read_base(pdir))
    # A wheel built without torch, or an editable install, generates at first
    # import; such a copy is not in pip's RECORD, so reinstalling never replaces
    # it: outside a source checkout the fix is to remove it
    fix = (
        "Fix: python tools/patches.py vendor"
        if patches_root() != PACKAGE_DIR / "_patches"
        else f"Fix: remove {VENDORED_DIR} (the next import generates it again)"
    )
    if not VENDORED_DIR.exists():
        try:
            vendor(VENDORED_DIR, root, pdir)
        except PermissionError as e:
            raise VendorError(
                f"cannot generate {VENDORED_DIR}: {e}. torch_fsdp_ext generates it on "
                "first import when it was not generated at install time. Fix: import "
                "torch_fsdp_ext once as a user who can write to "
                f"{PACKAGE_DIR} (e.g. the one who installed it), or install "
                "torch_fsdp_ext into an environment you own"
            ) from e
        except OSError as e:
            raise VendorError(
                f"cannot generate {VENDORED_DIR} ({e}). Fix: reinstall torch_fsdp_ext "
                "with torch installed in the build environment: "
                "pip install --no-build-isolation ."
            ) from e
        return
    check_stamp(read_stamp(VENDORED_DIR), pdir, installed_release(), fix)


def check_stamp(stamp: dict | None, pdir: Path, torch_version: str, fix: str) -> None:
    """Refuse a copy without a stamp, from another series than ``pdir`` (for
    ``torch_version``), or edited after generation."""
    if stamp is None:
        raise VendorError(
            f"the generated {VENDORED_DIR} has no readable {STAMP_NAME}, so what it was "
            f"generated from cannot be checked. {fix}"
        )
    if stamp.get("series_digest") != series_digest(pdir):
        raise VendorError(
            f"the generated {VENDORED_DIR} is stale: it was generated for torch "
            f"{stamp.get('torch_version')} from another patch series than {pdir} "
            f"(torch {torch_version}). {fix}"
        )
    damaged = _damaged_files(VENDORED_DIR, stamp)
    if damaged:
        raise VendorError(
            f"the generated {VENDORED_DIR} was changed after generation: {damaged} "
            f"missing, edited or unexpected (it is derived and never edited by hand). {fix}"
        )
