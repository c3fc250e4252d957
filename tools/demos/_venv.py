"""Imported first by every demo: outside the project's venv, one line naming
the fix instead of a ``ModuleNotFoundError`` traceback."""

import importlib.util
import sys

_missing = [m for m in ("torch", "torch_fsdp_ext") if importlib.util.find_spec(m) is None]
if _missing:
    sys.exit(
        f"error: {' and '.join(_missing)} not installed for {sys.executable}. "
        "Fix: bash tools/setup_and_test.sh (sets up .venv), then run the demo "
        "with .venv/bin/python"
    )
