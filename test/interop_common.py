"""Builds :class:`Model` the way torchtitan-style trainers do, for the interop tests.

Order per block: activation checkpointing, then ``torch.compile``, then
``fully_shard``; then the root; then, for meta-device init, ``to_empty`` and
``reset_parameters`` under seed 42. The same function builds the upstream and
the vendored model, so any difference comes from the implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
from common_fsdp_ext import Model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

# How a block is checkpointed:
# - "checkpoint_wrapper": ``checkpoint_wrapper(block)`` (non-reentrant), FSDP on the wrapper
# - "utils_checkpoint": ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)``
#   in a parent module, FSDP on that parent (FSDP outside AC, as torchtitan)
# - "fsdp_inside_checkpoint": FSDP on the block, checkpoint around it (the FSDP
#   hooks run again in the recompute)
AC_KINDS = ("none", "checkpoint_wrapper", "utils_checkpoint", "fsdp_inside_checkpoint")


class CheckpointedBlock(nn.Module):
    """Runs ``inner`` under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def reset_parameters(model: nn.Module) -> None:
    """Re-initializes every parameter in module order (the meta-init step)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.reset_parameters()


def shard_titan_style(
    model: nn.Module,
    impl: SimpleNamespace,
    mesh: DeviceMesh,
    *,
    ac: str = "none",
    compile_blocks: bool = False,
    fullgraph: bool = False,
    fsdp_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Checkpoints, compiles and shards each block of ``model``, then the root."""
    if ac not in AC_KINDS:
        raise ValueError(f"{ac=} is not one of {AC_KINDS}")
    kwargs = {"mesh": mesh, **(fsdp_kwargs or {})}
    for i, block in enumerate(model.blocks):
        shard_target: nn.Module
        if ac == "checkpoint_wrapper":
            block = shard_target = checkpoint_wrapper(block)
        elif ac == "utils_checkpoint":
            block = shard_target = CheckpointedBlock(block)
        elif ac == "fsdp_inside_checkpoint":
            shard_target = block
            block = CheckpointedBlock(block)
        else:
            shard_target = block
        if compile_blocks:
            block.compile(fullgraph=fullgraph)
        impl.fully_shard(shard_target, **kwargs)
        model.blocks[i] = block
    impl.fully_shard(model, **kwargs)
    return model


def build_titan_style(
    impl: SimpleNamespace,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    meta_init: bool = False,
    dim: int = 16,
    hidden: int = 32,
    **shard_kwargs: Any,
) -> nn.Module:
    """Builds :class:`Model` (seed 42), on the meta device if ``meta_init``, and
    shards it with :func:`shard_titan_style`. Uses the global RNG: not for the
    threaded process group, whose ranks share it."""
    torch.manual_seed(42)
    with torch.device("meta" if meta_init else device):
        model = Model(dim, hidden)
    shard_titan_style(model, impl, mesh, **shard_kwargs)
    if meta_init:
        model.to_empty(device=device)
        torch.manual_seed(42)
        reset_parameters(model)
    return model


def make_input_fn(rank: int, device: torch.device, dim: int = 16) -> Callable[[int], torch.Tensor]:
    """Deterministic per-step inputs, seeded with 42 + rank."""
    gen = torch.Generator(device.type)

    def make_input(step: int) -> torch.Tensor:
        gen.manual_seed(42 + rank + 1000 * step)
        return torch.randn(4, dim, device=device, generator=gen)

    return make_input
