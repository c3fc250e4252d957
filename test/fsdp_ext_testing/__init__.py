"""Helpers shared by this project's tests, demos and benchmark: the models,
``CommRecorder``, ``step_peak_bytes`` and the torchtitan CPU harness.

Not part of the package, which holds only what users import. pytest puts
``test/`` on ``sys.path`` (``pythonpath`` in ``pyproject.toml``); the demos
(``tools/demos/_venv.py``), the bench (``tools/bench/__init__.py``) and the
probes add it themselves (one line each).
"""

# Set by the GPU lane (tools/carried/sitecustomize.py) when this checkout's copy,
# generated for the primary base, runs on another torch: there torch's own
# FSDP2 is not the copy's base, so nothing is compared with it (the bench
# leaves out its ``upstream`` mode)
CARRIED_ENV = "TORCH_FSDP_EXT_CARRIED"
