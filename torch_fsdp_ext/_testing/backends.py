"""Registering an FSDP backend for the duration of a test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch_fsdp_ext


@contextlib.contextmanager
def registered_fsdp_backend(
    device_type: str, backend: torch_fsdp_ext.FSDPBackend
) -> Iterator[None]:
    """Registers ``backend`` for ``device_type``, then restores the previous
    registration (or none). The upstream-path test keeps its own copy, since it
    travels in the patch series without this package's test helpers."""
    previous = torch_fsdp_ext.get_fsdp_backend(device_type)
    torch_fsdp_ext.register_fsdp_backend(device_type, backend, override=True)
    try:
        yield
    finally:
        torch_fsdp_ext.unregister_fsdp_backend(device_type)
        if previous is not None:
            torch_fsdp_ext.register_fsdp_backend(device_type, previous)
