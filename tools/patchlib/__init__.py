"""The patch tooling behind ``tools/patches.py``: one module per command and
:mod:`patchlib.common`, the library they share."""
