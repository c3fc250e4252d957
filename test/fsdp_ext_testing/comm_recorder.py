"""One recorder of collectives and copies, shared by the tests, the MoE demo and the benchmark.

It is a ``TorchDispatchMode``, so it sees the c10d ops that any FSDP
implementation (upstream's or the generated copy) dispatches, and the copy ops
around them. Helpers that patch upstream module paths would not reach the
generated copy.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that copy data; FSDP's custom ops (fsdp:: upstream, fsdp_ext:: here)
# are counted whole (their inner aten ops are not seen by the mode)
_COPY_OPS = {
    "copy_",
    "_foreach_copy_",
    "cat",
    "_chunk_cat",
    "split_with_sizes_copy",
    "_to_copy",
    "clone",
}
_FSDP_NAMESPACES = {"fsdp", "fsdp_ext"}
# c10d op -> (kind, index of the argument whose bytes are the payload):
# all-gather output, reduce-scatter and all-to-all input, all-reduce tensors
_COLLECTIVES = {
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    total = 0
    for t in _tensors(value):
        if isinstance(t, DTensor):
            t = t._local_tensor
        total += t.numel() * t.element_size()
    return total


def _fsdp_dirs() -> tuple[str, ...]:
    import torch.distributed.fsdp._fully_shard as upstream_pkg

    import torch_fsdp_ext._fully_shard as ext_pkg

    return tuple(str(Path(p.__file__).resolve().parent) + os.sep for p in (upstream_pkg, ext_pkg))


@dataclass(frozen=True)
class Collective:
    """One c10d collective as dispatched; a coalesced op list is one entry."""

    phase: str  # "forward" or "backward" (inside autograd's backward)
    op: str  # the c10d op, e.g. "allgather_into_tensor_coalesced_"
    kind: str  # "all_gather", "reduce_scatter", "all_reduce" or "all_to_all"
    group: dist.ProcessGroup
    input_numels: tuple[int, ...]  # one per tensor
    nbytes: int  # payload, see ``_COLLECTIVES``
    labels: tuple[str, ...]  # the enclosing ``record_function`` labels, outermost first


class CommRecorder(TorchDispatchMode):
    """Records the collectives of a region in order (:attr:`collectives`) and
    sums the bytes written by copy ops.

    A copy is FSDP-side when FSDP's own Python code (upstream's
    ``torch/distributed/fsdp/_fully_shard`` or the generated
    ``torch_fsdp_ext/_fully_shard``) is on the stack when it is dispatched;
    other copies (the model's own, autograd's) go to ``model_copy_bytes``, and
    copies dispatched inside ``Work.wait()`` (the backend's, e.g. gloo's
    reduce-scatter copy-out) to ``backend_copies``.
    Bytes written: the mutated arguments of an in-place or ``out=`` op, else
    the outputs; for ``all_gather_copy_in``, the copied-in slice (its first
    output), not the all-gather output that the collective fills.
    """

    def __init__(self):
        super().__init__()
        self.copies: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # op -> [count, bytes]
        self.backend_copies: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.model_copy_bytes = 0
        # kind -> [ops issued, tensors, bytes]
        self.collectives: list[Collective] = []
        self._labels: list[str] = []
        self._fsdp_dirs = _fsdp_dirs()
        self._in_wait = 0
        self._saved_waits: list[tuple[type, Any]] = []

    def __enter__(self):
        # Copies that a backend dispatches when a collective completes (gloo's
        # reduce-scatter copies its result out in ``Work.wait()``) are the
        # backend's, not FSDP's, though FSDP's frame is on the stack
        from torch._C import _distributed_c10d as c10d

        for cls in (c10d.Work, c10d.FakeWork):
            wait = cls.wait
            self._saved_waits.append((cls, wait))
            cls.wait = self._counting_wait(wait)
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, wait in self._saved_waits:
            cls.wait = wait
        self._saved_waits.clear()
        return super().__exit__(*exc)

    def _counting_wait(self, wait):
        def counting_wait(work, *args, **kwargs):
            self._in_wait += 1
            try:
                return wait(work, *args, **kwargs)
            finally:
                self._in_wait -= 1

        return counting_wait

    def _from_fsdp(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self._fsdp_dirs):
                return True
            frame = frame.f_back
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func._schema.name.split("::")[1]
        if namespace == "profiler" and name == "_record_function_enter_new":
            self._labels.append(args[0])
        elif namespace == "profiler" and name == "_record_function_exit" and self._labels:
            self._labels.pop()
        elif namespace == "c10d" and name in _COLLECTIVES:
            kind, index = _COLLECTIVES[name]
            # The c10d ops take the group boxed as a ScriptObject
            boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
            self.collectives.append(
                Collective(
                    phase="backward" if torch._C._current_graph_task_id() != -1 else "forward",
                    op=name,
                    kind=kind,
                    group=dist.ProcessGroup.unbox(boxed),
                    # (outputs, inputs, group, ...) for the plain and coalesced ops
                    input_numels=tuple(t.numel() for t in _tensors(args[1])),
                    nbytes=_nbytes(args[index]),
                    labels=tuple(self._labels),
                )
            )
        elif namespace in _FSDP_NAMESPACES or (namespace == "aten" and name in _COPY_OPS):
            nbytes = self._bytes_written(func, name, args, kwargs, out)
            if self._in_wait:
                record = self.backend_copies[f"{namespace}::{name}"]
            elif self._from_fsdp():
                record = self.copies[f"{namespace}::{name}"]
            else:
                self.model_copy_bytes += nbytes
                return out
            record[0] += 1
            record[1] += nbytes
        return out

    @staticmethod
    def _bytes_written(func, name: str, args, kwargs, out) -> int:
        if name == "all_gather_copy_in":
            return _nbytes(out[0])
        written, mutates = 0, False
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                mutates = True
                value = (
                    kwargs.get(arg.name)
                    if arg.kwarg_only
                    else (args[i] if i < len(args) else kwargs.get(arg.name))
                )
                written += _nbytes(value)
        return written if mutates else _nbytes(out)

    def summary(self) -> dict[str, Any]:
        """Totals for the benchmark's JSON: copy ops and bytes, collectives by kind."""
        by_kind: dict[str, list[Collective]] = defaultdict(list)
        for c in self.collectives:
            by_kind[c.kind].append(c)
        return {
            "copy_bytes": sum(b for _, b in self.copies.values()),
            "copy_ops": {k: {"count": c, "bytes": b} for k, (c, b) in sorted(self.copies.items())},
            "backend_copy_bytes": sum(b for _, b in self.backend_copies.values()),
            "backend_copy_ops": {
                k: {"count": c, "bytes": b} for k, (c, b) in sorted(self.backend_copies.items())
            },
            "model_copy_bytes": self.model_copy_bytes,
            "collectives": {
                "ops": len(self.collectives),
                "tensors": sum(len(c.input_numels) for c in self.collectives),
                "bytes": sum(c.nbytes for c in self.collectives),
                "by_kind": {
                    kind: {
                        "ops": len(colls),
                        "tensors": sum(len(c.input_numels) for c in colls),
                        "bytes": sum(c.nbytes for c in colls),
                    }
                    for kind, colls in sorted(by_kind.items())
                },
            },
        }
