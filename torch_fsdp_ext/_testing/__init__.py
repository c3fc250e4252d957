"""Helpers shared by this project's tests, demos and benchmark; not public API.

Like ``torch.testing._internal``: importable from an installed package, so
``test/`` and ``tools/`` use one copy and neither imports the other.
"""

# Set by the GPU lane (tools/carried/sitecustomize.py) when this checkout's copy,
# generated for the primary base, runs on another torch: there torch's own
# FSDP2 is not the copy's base, so nothing is compared with it (the bench
# leaves out its ``upstream`` mode)
CARRIED_ENV = "TORCH_FSDP_EXT_CARRIED"
