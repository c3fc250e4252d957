"""Accept torch's own FSDP2 argument types in ``torch_fsdp_ext.fully_shard``.

torchtitan-style code builds ``ShardPlacementResult`` and ``FSDPMeshInfo`` /
``HSDPMeshInfo`` from ``torch.distributed.fsdp._fully_shard._fsdp_common``, and
passes ``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and
``DataParallelMeshDims`` from ``torch.distributed.fsdp``. The generated copy has
its own classes, which its ``isinstance`` checks use, so it would reject torch's
placement results ("Invalid shard_placement_fn result") and silently not
offload with torch's ``CPUOffloadPolicy`` (``FSDPParam.offload_to_cpu`` is
``isinstance(offload_policy, CPUOffloadPolicy)``). Converting them here keeps
switching a model to ``torch_fsdp_ext`` a change of the ``fully_shard`` import
only. The generated ``resolve_shard_placement`` and ``fully_shard`` call this
(see ``_vendor.REWRITES``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed.fsdp._fully_shard._fsdp_api as upstream_api
import torch.distributed.fsdp._fully_shard._fsdp_common as upstream_common

from ._fully_shard import _fsdp_api, _fsdp_common

_MESH_INFO_CLASSES = {
    upstream_common.FSDPMeshInfo: _fsdp_common.FSDPMeshInfo,
    upstream_common.HSDPMeshInfo: _fsdp_common.HSDPMeshInfo,
}


def from_upstream_shard_placement_result(
    result: Any,
) -> _fsdp_common.ShardPlacementResult | None:
    """Returns torch's ``ShardPlacementResult`` as ours, or ``None`` for anything else."""
    if not isinstance(result, upstream_common.ShardPlacementResult):
        return None
    mesh_info = result.mesh_info
    mesh_info_cls = _MESH_INFO_CLASSES.get(type(mesh_info))
    if mesh_info_cls is None:
        raise TypeError(
            "ShardPlacementResult.mesh_info must be an FSDPMeshInfo or HSDPMeshInfo "
            f"but got {type(mesh_info).__qualname__}"
        )
    kwargs = {f.name: getattr(mesh_info, f.name) for f in dataclasses.fields(mesh_info) if f.init}
    kwargs["dp_mesh_dims"] = _from_upstream_dp_mesh_dims(kwargs["dp_mesh_dims"])
    return _fsdp_common.ShardPlacementResult(result.placement, mesh_info_cls(**kwargs))


def _init_fields(value: Any, cls: type) -> dict[str, Any]:
    # ``cls``'s own fields: a subclass of torch's class converts to what torch
    # would read from it
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(cls) if f.init}


def _from_upstream_dp_mesh_dims(dims: Any) -> Any:
    # torch 2.9's FSDP2 has no DataParallelMeshDims
    upstream_cls = getattr(upstream_api, "DataParallelMeshDims", None)
    if upstream_cls is not None and isinstance(dims, upstream_cls):
        return _fsdp_api.DataParallelMeshDims(**_init_fields(dims, upstream_cls))
    return dims


def from_upstream_fully_shard_args(mp_policy: Any, offload_policy: Any, dp_mesh_dims: Any) -> tuple:
    """Returns ``fully_shard``'s ``mp_policy``, ``offload_policy`` and
    ``dp_mesh_dims`` with torch's classes replaced by ours (same fields);
    anything else, ours included, unchanged.

    An ``OffloadPolicy`` of torch's that is not a ``CPUOffloadPolicy`` offloads
    nothing in torch, so it becomes our ``OffloadPolicy()``.
    """
    if isinstance(mp_policy, upstream_api.MixedPrecisionPolicy):
        mp_policy = _fsdp_api.MixedPrecisionPolicy(
            **_init_fields(mp_policy, upstream_api.MixedPrecisionPolicy)
        )
    if isinstance(offload_policy, upstream_api.CPUOffloadPolicy):
        offload_policy = _fsdp_api.CPUOffloadPolicy(
            **_init_fields(offload_policy, upstream_api.CPUOffloadPolicy)
        )
    elif isinstance(offload_policy, upstream_api.OffloadPolicy):
        offload_policy = _fsdp_api.OffloadPolicy()
    return mp_policy, offload_policy, _from_upstream_dp_mesh_dims(dp_mesh_dims)
