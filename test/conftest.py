"""Collect the upstream-path tests of the installed torch's base.

Every base carries ``test/upstream/test_*.py``; a base that needs its own version
of one puts it in ``test/upstream/<version>/`` (CONTRIBUTING.md). For the
installed release that version replaces the common file; other bases' versions
are never collected. A test created by a patch that the installed base leaves
out (``[series.omitted]`` in its ``base.toml``) is reported as one skip with
that reason, without importing it.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_UPSTREAM = Path(__file__).parent / "upstream"
_RELEASE = torch.__version__.split("+", 1)[0]


def _load_vendor():
    # By path: importing the package would check the generated copy first
    path = Path(__file__).parents[1] / "torch_fsdp_ext" / "_vendor.py"
    spec = importlib.util.spec_from_file_location("_torch_fsdp_ext_vendor_conftest", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _ignored() -> list[str]:
    ignored = []
    for base_dir in _UPSTREAM.glob("[0-9]*/"):
        for test in base_dir.glob("test_*.py"):
            ignored.append(str(_UPSTREAM / test.name if base_dir.name == _RELEASE else test))
    return ignored


def _omitted() -> dict[str, str]:
    """Test file name -> skip reason, for the tests of patches the base leaves out."""
    vendor = _load_vendor()
    if _RELEASE not in vendor.supported_versions():
        return {}
    return {
        Path(rel).name: f"torch {_RELEASE}'s series leaves out {subject!r}: {reason}"
        for rel, (subject, reason) in vendor.omitted_tests(_RELEASE).items()
    }


collect_ignore = _ignored()
_OMITTED = _omitted()


class _OmittedPatchTest(pytest.Item):
    def runtest(self) -> None:
        pytest.skip(_OMITTED[self.path.name])

    def reportinfo(self):
        return self.path, 0, self.name


class _OmittedPatchModule(pytest.File):
    def collect(self):
        yield _OmittedPatchTest.from_parent(self, name=self.path.stem)


def pytest_pycollect_makemodule(module_path: Path, parent):
    if module_path.parent == _UPSTREAM and module_path.name in _OMITTED:
        return _OmittedPatchModule.from_parent(parent, path=module_path)
    return None
