#!/usr/bin/env python3
"""Find out how far the real ``torch_tpu`` loads on this machine, without a TPU.

Installs ``torch-tpu`` (and its dependencies, ``libtpu`` among them, but not
torch) plus ``examples/fsdp_backend_tpu`` into a target folder with pip, then
runs each check in a fresh interpreter of this Python with that folder on
``PYTHONPATH``, so this environment is left as it was:

  1. ``import torch_tpu``
  2. ``import torch`` autoloads it through the ``torch.backends`` entry point
  3. the PrivateUse1 backend is renamed "tpu" and ``torch.tpu`` exists
  4. a "tpu" device can be made (needs a TPU)
  5. the example's ``torch.backends`` entry point (autoloaded with
     torch_tpu's) registers its FSDP backend for "tpu"
  6. 3 to 5 again after forcing torch_tpu's device init (its loader only
     renames PrivateUse1 when it counts a TPU)

Prints one line per check (ok, or the exact error) and exits 0. Heavy (about
100 MB of wheels for torch-tpu alone), so it is not part of the test suite;
docs/backends.md records its output.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("torch_fsdp_ext.probe_torch_tpu")

_FORCE_INIT = "import torch, torch_tpu._loader as loader; loader._init_device('tpu')"
CHECKS = {
    "import torch_tpu": "import torch_tpu; print(torch_tpu.__file__)",
    "import torch autoloads torch_tpu": (
        "import sys, torch; print('torch_tpu' in sys.modules, torch.__version__)"
    ),
    "PrivateUse1 is 'tpu' and torch.tpu exists": (
        "import torch; name = torch._C._get_privateuse1_backend_name(); "
        "print(name, hasattr(torch, 'tpu')); assert name == 'tpu' and hasattr(torch, 'tpu')"
    ),
    "a tpu tensor": "import torch; print(torch.ones(2, device='tpu'))",
    "the example registers its FSDP backend for 'tpu'": (
        "import torch, torch_fsdp_ext; b = torch_fsdp_ext.get_fsdp_backend('tpu'); "
        "print(b); assert b is not None"
    ),
    # torch_tpu's loader renames PrivateUse1 only when it counts a TPU; its
    # device init (private) can be called without one
    "forced device init without a TPU, then PrivateUse1 is 'tpu'": (
        f"{_FORCE_INIT}; print(torch._C._get_privateuse1_backend_name(), hasattr(torch, 'tpu'))"
    ),
    "forced device init, then a tpu tensor": f"{_FORCE_INIT}; print(torch.ones(2, device='tpu'))",
    "forced device init, then the example registers its FSDP backend for 'tpu'": (
        f"{_FORCE_INIT}; import torch_fsdp_ext; b = torch_fsdp_ext.get_fsdp_backend('tpu'); "
        "print(b); assert b is not None"
    ),
}


def _install(target: Path, version: str) -> None:
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}
    pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target)]
    log.info("installing torch-tpu==%s and its dependencies except torch into %s", version, target)
    subprocess.run([*pip, "--no-deps", f"torch-tpu=={version}"], check=True, env=env)
    (dist,) = importlib.metadata.distributions(name="torch_tpu", path=[str(target)])
    requires = [r for r in dist.requires or [] if not r.startswith("torch")]
    subprocess.run([*pip, *requires], check=True, env=env)
    log.info("installing examples/fsdp_backend_tpu (no dependencies: torch_fsdp_ext is here)")
    # Built from a copy: setuptools leaves build/ and *.egg-info in the source
    with tempfile.TemporaryDirectory() as tmp:
        example = shutil.copytree(REPO / "examples" / "fsdp_backend_tpu", Path(tmp) / "example")
        subprocess.run(
            [*pip, "--no-deps", "--no-build-isolation", str(example)], check=True, env=env
        )


def _check(target: Path, name: str, code: str, timeout: int) -> None:
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(target)},
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        log.info("FAIL  %s: no result within %d s (it hangs)", name, timeout)
        return
    if result.returncode == 0:
        log.info("ok    %s: %s", name, result.stdout.strip().splitlines()[-1:])
        return
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    log.info("FAIL  %s: %s", name, lines[-1] if lines else f"exit {result.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", default="0.2.0", help="torch-tpu release")
    parser.add_argument(
        "--target", type=Path, help="install folder (default: a temporary one, removed)"
    )
    parser.add_argument("--timeout", type=int, default=60, help="seconds per check")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="torch_tpu-") as tmp:
        target = args.target or Path(tmp)
        _install(target, args.version)
        for name, code in CHECKS.items():
            _check(target, name, code, args.timeout)


if __name__ == "__main__":
    main()
