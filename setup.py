"""Build torch_fsdp_ext: generate ``_fully_shard`` from the build environment's torch.

When torch is importable at build time (``pip install --no-build-isolation``),
the generated copy goes into the wheel or the editable tree. Otherwise
generation is deferred to the first ``import torch_fsdp_ext``. Either way the
series travels inside the package as ``_patches`` so an installed wheel can
check and regenerate itself.
"""

import importlib.util
import logging
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _load_vendor():
    spec = importlib.util.spec_from_file_location(
        "_torch_fsdp_ext_vendor", HERE / "torch_fsdp_ext" / "_vendor.py"
    )
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class BuildPyWithVendoring(build_py):
    def run(self):
        vendor = _load_vendor()
        if importlib.util.find_spec("torch") is None:
            logging.warning(
                "torch is not importable in the build environment; torch_fsdp_ext "
                "will generate its _fully_shard copy on first import"
            )
        else:
            vendor.vendor()
        if vendor.VENDORED_DIR.is_dir():
            self.packages = [*self.packages, f"{vendor.PACKAGE}.{vendor.VENDORED_NAME}"]
            self.package_data.setdefault(f"{vendor.PACKAGE}.{vendor.VENDORED_NAME}", []).append(
                vendor.STAMP_NAME
            )
        super().run()
        if not self.editable_mode:
            shutil.copytree(
                HERE / "patches",
                Path(self.build_lib) / vendor.PACKAGE / "_patches",
                dirs_exist_ok=True,
            )


setup(
    packages=["torch_fsdp_ext"],
    cmdclass={"build_py": BuildPyWithVendoring},
)
