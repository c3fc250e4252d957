"""The five ways the bench shards a model (upstream, grouped, per-parameter
coalesced or not, deterministic): what each mode is, how it applies
``fully_shard`` to a dense model or to the MoE transformer, and the coalescing
choice a per-parameter mode makes through the public FSDP backend registry's
default comms."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed.fsdp as upstream_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import torch_fsdp_ext
from fsdp_ext_testing import CARRIED_ENV, moe
from fsdp_ext_testing.coalescing import COALESCED, ONE_BY_ONE


@dataclass(frozen=True)
class Mode:
    name: str
    upstream: bool = False
    group_collectives: bool = True
    # None: not a per-parameter mode; True/False: coalesce a group's collectives
    coalesce: bool | None = None
    deterministic: bool = False


MODES = [
    Mode("upstream", upstream=True),
    Mode("grouped"),
    Mode("per-param", group_collectives=False, coalesce=True),
    Mode("per-param-nocoalesce", group_collectives=False, coalesce=False),
    Mode("deterministic", group_collectives=False, coalesce=True, deterministic=True),
]
MODES_BY_NAME = {m.name: m for m in MODES}
SWEEP_MODES = ["grouped", "per-param", "per-param-nocoalesce"]


def model_modes() -> list[str]:
    """The modes a model runs in: all, less ``upstream`` for a copy carried onto
    another torch (``tools/carried/``), whose own FSDP2 is
    not the copy's base."""
    carried = os.environ.get(CARRIED_ENV) == "1"
    return [m.name for m in MODES if not (carried and m.upstream)]


# ``MixedPrecisionPolicy`` fields by ``--mp`` name. With ``reduce_dtype=None``,
# torch 2.15 reduces bf16 parameters' gradients in their fp32 ``grad_dtype``
MIXED_PRECISION = {
    "fp32": {},
    "bf16-fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "bf16-none": {"param_dtype": torch.bfloat16},
}


@contextlib.contextmanager
def coalescing(mode: Mode, device_type: str) -> Iterator[None]:
    """For a per-parameter mode, registers for ``device_type`` a copy of its
    FSDP backend (or of the defaults if none) whose default comms coalesce a
    group's collectives or issue them one by one, as ``mode.coalesce`` says,
    and restores the previous registration on exit.

    FSDP reads the registration at ``fully_shard``: shard inside it. On CUDA
    FSDP's own comms coalesce (NCCL reports it), so a coalesced mode keeps
    them; elsewhere the comms of ``fsdp_ext_testing.coalescing`` coalesce on
    any process group, the fake one and gloo included. A comm set after
    sharding (``deterministic``'s reduce-scatter) replaces them.
    """
    if mode.coalesce is None or (mode.coalesce and device_type == "cuda"):
        yield
        return
    comms = COALESCED if mode.coalesce else ONE_BY_ONE
    previous = torch_fsdp_ext.get_fsdp_backend(device_type)
    backend = dataclasses.replace(
        previous or torch_fsdp_ext.FSDPBackend(),
        all_gather_comm=comms.all_gather_comm,
        reduce_scatter_comm=comms.reduce_scatter_comm,
    )
    torch_fsdp_ext.register_fsdp_backend(device_type, backend, override=True)
    try:
        yield
    finally:
        if previous is None:
            torch_fsdp_ext.unregister_fsdp_backend(device_type)
        else:
            torch_fsdp_ext.register_fsdp_backend(device_type, previous, override=True)


def shard(
    model: nn.Module, mode: Mode, wrap: list[nn.Module], mesh: DeviceMesh, mp: str = "fp32"
) -> nn.Module:
    """Applies ``fully_shard`` to each of ``wrap`` (modules of ``model``), then to
    ``model``, with the mixed precision that ``MIXED_PRECISION[mp]`` names."""
    fsdp = upstream_fsdp if mode.upstream else torch_fsdp_ext
    fully_shard = fsdp.fully_shard
    kwargs = {"mp_policy": fsdp.MixedPrecisionPolicy(**MIXED_PRECISION[mp])}
    if not mode.upstream:
        kwargs["group_collectives"] = mode.group_collectives
    for module in wrap:
        fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    if mode.deterministic:
        moe.set_deterministic_reduce_scatter(model)
    return model


def shard_moe(model: moe.MoETransformer, mode: Mode, meshes: moe.MoEMeshes) -> nn.Module:
    """Shards the MoE transformer: upstream with the separate experts module
    (``moe``'s "old" wrapping), the other modes with one ``fully_shard`` per
    block and expert parameters on the efsdp mesh."""
    if mode.upstream:
        moe.shard_model(model, "old", meshes, upstream=True)
    else:
        moe.shard_model(model, "grouped" if mode.group_collectives else "per-param", meshes)
    if mode.deterministic:
        moe.set_deterministic_reduce_scatter(model)
    return model
