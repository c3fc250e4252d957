"""Collect the upstream-path tests of the installed torch's base.

Every base carries ``test/upstream/test_*.py``; a base that needs its own version
of one puts it in ``test/upstream/<version>/`` (CONTRIBUTING.md). For the
installed release that version replaces the common file; other bases' versions
are never collected.
"""

from pathlib import Path

import torch

_UPSTREAM = Path(__file__).parent / "upstream"
_RELEASE = torch.__version__.split("+", 1)[0]


def _ignored() -> list[str]:
    ignored = []
    for base_dir in _UPSTREAM.glob("[0-9]*/"):
        for test in base_dir.glob("test_*.py"):
            ignored.append(str(_UPSTREAM / test.name if base_dir.name == _RELEASE else test))
    return ignored


collect_ignore = _ignored()
