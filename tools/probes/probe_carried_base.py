#!/usr/bin/env python3
"""Find out whether the generated copy for this checkout's torch runs on another torch.

The device machine this project can borrow has torch 2.11 and no way to
install the primary base. The idea of carrying the primary base's generated
``torch_fsdp_ext/_fully_shard`` (pristine files plus the series) onto that
torch stands or falls with the torch internals the copy uses. This tool copies
the generated copy into a temporary package and, in a child process of
``--python`` (an interpreter with the other torch), imports it. Each name the
other torch lacks (``cannot import name`` or ``has no attribute``) is listed
and stubbed so that the import can go on. The ``torch.ops.fsdp`` ops the copy
calls are then looked up too. Prints the list and exits 0; nothing is
installed or changed. ``tools/carried/stand_ins.py`` supplies what this
found for torch 2.11 and what running the tests there found after it.

Example (a venv with torch 2.11 on CPU)::

    python3 -m venv /tmp/venv211
    PIP_CONSTRAINT=/dev/null /tmp/venv211/bin/python -m pip install torch==2.11.0 numpy
    .venv/bin/python tools/probes/probe_carried_base.py --python /tmp/venv211/bin/python
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "torch_fsdp_ext" / "_fully_shard"
PACKAGE = "carried_fully_shard"

# Runs in the child: import the carried copy, stubbing each missing name
_CHILD = r"""
import importlib, re, sys
import torch
print(f"torch {torch.__version__}")
missing = []
for _ in range(50):
    for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        del sys.modules[name]
    try:
        importlib.import_module(PACKAGE)
        break
    except (ImportError, AttributeError) as e:
        match = re.match(r"cannot import name '(\w+)' from '([\w.]+)'", str(e))
        if match is not None:
            name, module = match.groups()
        elif (match := re.match(r"module '([\w.]+)' has no attribute '(\w+)'", str(e))):
            module, name = match.groups()
        else:
            print(f"import fails: {e}")
            sys.exit(0)
        # A class stands in for an imported name, a no-op for a called one
        stub = type(name, (), {}) if isinstance(e, ImportError) else lambda *a, **k: None
        setattr(importlib.import_module(module), name, stub)
        missing.append(f"{module}.{name}")
for name in missing:
    print(f"missing: {name}")
print(f"imports with {len(missing)} stub(s)")
for op in OPS:
    print(f"torch.ops.fsdp.{op}: {'ok' if hasattr(torch.ops.fsdp, op) else 'missing'}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--python", required=True, help="interpreter whose torch to try the generated copy on"
    )
    args = parser.parse_args()
    python = shutil.which(args.python)
    if python is None:
        sys.exit(f"error: no interpreter at {args.python}")
    if not (GENERATED / "__init__.py").is_file():
        sys.exit(f"error: no generated copy at {GENERATED}. Fix: python tools/patches.py vendor")
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / PACKAGE
        shutil.copytree(GENERATED, target, ignore=shutil.ignore_patterns("__pycache__"))
        ops = set()
        for path in target.glob("*.py"):
            text = path.read_text()
            ops.update(re.findall(r"torch\.ops\.fsdp\.(\w+)", text))
            path.write_text(text.replace("torch_fsdp_ext._fully_shard.", f"{PACKAGE}."))
        child = f"PACKAGE = {PACKAGE!r}\nOPS = {sorted(ops)!r}\n{_CHILD}"
        proc = subprocess.run(
            [str(Path(python).absolute()), "-c", child], cwd=tmp, capture_output=True, text=True
        )
    print(proc.stdout, end="")
    if proc.returncode != 0:
        print(f"child exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")


if __name__ == "__main__":
    main()
