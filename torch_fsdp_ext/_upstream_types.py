"""Accept torch's own per-parameter mesh types in ``torch_fsdp_ext.fully_shard``.

torchtitan-style code builds ``ShardPlacementResult`` and ``FSDPMeshInfo`` /
``HSDPMeshInfo`` from ``torch.distributed.fsdp._fully_shard._fsdp_common``. The
generated copy has its own classes, which its ``isinstance`` checks use, so it
would reject them ("Invalid shard_placement_fn result"). Converting them here
keeps switching a model to ``torch_fsdp_ext`` a change of the ``fully_shard``
import only. The generated ``resolve_shard_placement`` calls this (see
``_vendor.REWRITES``).
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
    if isinstance(dims := kwargs["dp_mesh_dims"], upstream_api.DataParallelMeshDims):
        kwargs["dp_mesh_dims"] = _fsdp_api.DataParallelMeshDims(dims.shard, dims.replicate)
    return _fsdp_common.ShardPlacementResult(result.placement, mesh_info_cls(**kwargs))
