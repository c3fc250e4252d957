"""Helpers shared by this project's tests, demos and benchmark; not public API.

Like ``torch.testing._internal``: importable from an installed package, so
``test/`` and ``tools/`` use one copy and neither imports the other.
"""
