"""A shield against a c10d abort at interpreter exit, for this package only.

``torch.autograd.graph._engine_run_backward`` stashes a ``contextvars.Context``
in thread-local state (``"context"``) for the whole backward. Every c10d work
created meanwhile captures that state, and gloo's worker thread drops its
references to a work only after completing it, so for the last collectives of
a backward it can drop the last reference after ``Py_FinalizeEx`` began; the
decref then takes the GIL and the process aborts ("terminate called without
an active exception"). The bug is c10d's, not FSDP's (a reproduction without
FSDP aborts too): docs/upstream-gloo-exit-abort.md has the report, ready to
file upstream.

Until c10d is fixed, the generated copy (torch 2.14 and 2.15; 2.9 stashes
nothing) runs ``FSDPParamGroup.unshard`` and ``post_backward`` through
:func:`outside_autograd_context` in both collective modes, by a rewrite in
``_vendor.py``; the patch series carries nothing of it. What it changes: code
that FSDP runs inside those two methods (post-accumulate-grad hooks, an
``all_reduce_hook``, custom comms, ``fsdp_pre_all_gather`` extensions) does
not see the stashed context. It can go once c10d releases a work's Python
state before its worker thread can outlive the interpreter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")

_KEY = "context"


def outside_autograd_context(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Runs ``method`` without autograd's stashed context object, and stashes
    the same object back after."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling() or not torch._C._is_key_in_tls(_KEY):
            return method(*args, **kwargs)
        context = torch._C._get_obj_in_tls(_KEY)
        torch._C._remove_obj_from_tls(_KEY)
        try:
            return method(*args, **kwargs)
        finally:
            torch._C._stash_obj_in_tls(_KEY, context)

    return wrapper
