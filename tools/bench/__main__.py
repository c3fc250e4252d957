"""Entry point of ``python tools/bench``: makes this folder importable as the
``bench`` package (its ranks import it too) and runs :func:`bench.cli.main`."""

import sys
from pathlib import Path

# Replaces this folder, which Python put first: its modules are only importable as bench.*
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
