"""Imported first by every demo: outside the project's venv, one line naming
the fix instead of a ``ModuleNotFoundError`` traceback; then puts ``test/`` on
the path for the models the demos share with the tests (``fsdp_ext_testing``)."""

import importlib.util
import sys
from pathlib import Path

_missing = [m for m in ("torch", "torch_fsdp_ext") if importlib.util.find_spec(m) is None]
if _missing:
    sys.exit(
        f"error: {' and '.join(_missing)} not installed for {sys.executable}. "
        "Fix: bash tools/setup_and_test.sh (sets up .venv), then run the demo "
        "with .venv/bin/python"
    )
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "test"))
