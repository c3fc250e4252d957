"""The GPU lane: run the copy generated here for the primary base on another torch.

The device machine this project can borrow has torch 2.11, which is no
supported base, and nothing can be installed there. With this folder first on
``PYTHONPATH`` (``TORCH_FSDP_EXT_CARRIED=1 bash tools/gpu_check.sh`` puts it
there), Python imports this module at the start of every process, rank
processes included. It makes ``torch_fsdp_ext`` accept a ``_fully_shard``
generated elsewhere and carried onto the machine with the working tree: the
copy is checked against the series of the torch its stamp names instead of the
installed torch, and :func:`stand_ins.install` supplies the internals it uses
that the installed torch lacks. The installed package itself never does this.

It touches nothing until ``torch_fsdp_ext`` is imported (torch is not imported
here) and sets ``TORCH_FSDP_EXT_CARRIED=1`` for the tools that adapt to the lane
(the bench leaves out its ``upstream`` mode: torch 2.11's FSDP2 is not the
copy's base).
"""

import importlib.util
import os
import sys

# ``fsdp_ext_testing.CARRIED_ENV``, which the bench reads
CARRIED_ENV = "TORCH_FSDP_EXT_CARRIED"


def _ensure_carried(vendor) -> None:
    """``torch_fsdp_ext._vendor.ensure_vendored`` for a carried copy."""
    # The package, importing now, found its submodule already loaded
    sys.modules["torch_fsdp_ext"]._vendor = vendor
    stamp = vendor.read_stamp(vendor.VENDORED_DIR)
    fix = (
        f"Fix: generate it where torch {vendor.primary_version()} is installed "
        f"(python tools/patches.py vendor) and carry {vendor.VENDORED_DIR.name}/ along"
    )
    version = (stamp or {}).get("torch_version", vendor.primary_version())
    vendor.check_stamp(stamp, vendor.patches_dir(version), version, fix)
    import stand_ins

    stand_ins.install()


def _activate() -> None:
    # ``torch_fsdp_ext/__init__`` takes ``ensure_vendored`` from its ``_vendor``
    # module: load that module (standard library only) under its own name
    # first, with the carried check in place, and the package imports it as is
    package = importlib.util.find_spec("torch_fsdp_ext")
    if package is None:
        return
    name = "torch_fsdp_ext._vendor"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(next(iter(package.submodule_search_locations)), "_vendor.py")
    )
    vendor = importlib.util.module_from_spec(spec)
    sys.modules[name] = vendor  # dataclasses look their module up here
    spec.loader.exec_module(vendor)
    vendor.ensure_vendored = lambda: _ensure_carried(vendor)
    os.environ[CARRIED_ENV] = "1"


_activate()
