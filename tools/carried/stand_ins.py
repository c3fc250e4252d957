"""The torch internals a copy generated for the primary base uses and an older
torch lacks, and :func:`install`, which supplies them (the GPU lane only).

``sitecustomize`` in this folder calls :func:`install` when
``torch_fsdp_ext`` is imported; ``tools/probes/probe_carried_base.py`` lists
what another torch lacks. Unsupported for training: it exists so that
``tools/gpu_check.sh`` can run on the lent machine's torch 2.11.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp._common_utils as fsdp_common_utils
from torch.utils._pytree import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)


def _requires_grad(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.requires_grad


# torch 2.15 walks containers itself (dataclasses too); torch 2.11's FSDP2 took
# the tensors from ``tree_flatten`` for the same hooks, which these follow
def _collect_grad_tensors(output: Any) -> tuple[torch.Tensor, ...]:
    return tuple(leaf for leaf in tree_flatten(output)[0] if _requires_grad(leaf))


def _replace_grad_tensors(output: Any, tensor_iter: Iterator[torch.Tensor]) -> Any:
    leaves, spec = tree_flatten(output)
    return tree_unflatten([next(tensor_iter) if _requires_grad(x) else x for x in leaves], spec)


def _chunk_cat_mixed_dtype(
    tensors: list[torch.Tensor], dim: int, num_chunks: int, *, out: torch.Tensor
) -> None:
    # Casting to the output dtype is exact, so this writes the bits of torch
    # 2.15's C++ kernel, which casts during the copy
    torch._chunk_cat([t.to(out.dtype) for t in tensors], dim, num_chunks, out=out)


class _PremulSum:
    """torch 2.15's ``ReduceOp.PREMUL_SUM``: equal to the op type and, called
    with a factor, the op (torch 2.11: ``_make_nccl_premul_sum``)."""

    def __init__(self, op_type: dist.ReduceOp.RedOpType):
        self.op_type = op_type

    def __call__(self, factor: float) -> dist.ReduceOp:
        return dist._make_nccl_premul_sum(factor)

    def __eq__(self, other: object) -> bool:
        return self.op_type == (other.op_type if isinstance(other, _PremulSum) else other)

    def __hash__(self) -> int:
        return hash(self.op_type)


_lib: torch.library.Library | None = None


def install() -> list[str]:
    """Adds each internal the carried copy uses that the installed torch lacks;
    returns their names."""
    global _lib
    added = []
    for owner, name, value in (
        # Nothing in an older torch type-checks SPMD code
        (dist, "_is_spmd_types_available", lambda: False),
        (dist, "_spmd_no_typecheck", contextlib.nullcontext),
        # torch 2.15's names for the single-tensor collectives, same signatures
        (dist, "all_gather_single", dist.all_gather_into_tensor),
        (dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
        # torch 2.15 tells an unset ``grad_dtype`` from one set to the
        # tensor's dtype; before, only a different one shows
        (torch.Tensor, "_has_grad_dtype_override", property(lambda t: t.grad_dtype != t.dtype)),
        (fsdp_common_utils, "collect_grad_tensors", _collect_grad_tensors),
        (fsdp_common_utils, "replace_grad_tensors", _replace_grad_tensors),
    ):
        if not hasattr(owner, name):
            setattr(owner, name, value)
            where = (
                f"{owner.__module__}.{owner.__qualname__}"
                if isinstance(owner, type)
                else owner.__name__
            )
            added.append(f"{where}.{name}")
    if not callable(dist.ReduceOp.PREMUL_SUM):
        dist.ReduceOp.PREMUL_SUM = _PremulSum(dist.ReduceOp.PREMUL_SUM)
        # The pickled state of a PREMUL_SUM op is (op type, factor)
        dist.ReduceOp.factor = property(lambda op: op.__getstate__()[1])
        added.append("torch.distributed.ReduceOp.PREMUL_SUM(factor) and .factor")
    if not hasattr(torch.ops.fsdp, "chunk_cat_mixed_dtype"):
        _lib = torch.library.Library("fsdp", "FRAGMENT")  # kept: the op lives as long as it
        _lib.define(
            "chunk_cat_mixed_dtype(Tensor[] tensors, int dim, int num_chunks, *, "
            "Tensor(a!) out) -> ()"
        )
        _lib.impl("chunk_cat_mixed_dtype", _chunk_cat_mixed_dtype, "CompositeExplicitAutograd")
        added.append("torch.ops.fsdp.chunk_cat_mixed_dtype")
    if added:
        log.warning(
            "carried lane: running a copy generated for another torch on torch %s, with %s "
            "supplied",
            torch.__version__,
            ", ".join(added),
        )
    return added
