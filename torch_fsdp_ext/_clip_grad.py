"""Gradient clipping for parameters sharded on more than one mesh.

With per-parameter meshes (``ShardPlacementResult``), a model's gradients are
DTensors on several meshes, e.g. dense params on the dp mesh and experts on the
("efsdp", "ep") mesh. ``torch.nn.utils.clip_grad_norm_`` stacks the norms of
all of them and fails: "All operands in aten.stack.default must have the same
mesh". Norms combine across meshes as ``||(n_1, ..., n_k)||_p``, so we reduce
each mesh's norm over its own mesh and combine the resulting plain tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clips the gradient norm of parameters that may live on different meshes.

    Same contract as :func:`torch.nn.utils.clip_grad_norm_`: the total norm is
    over all gradients viewed as one vector, and gradients are scaled in place
    by ``max_norm / (total_norm + 1e-6)`` if that is below 1. The total norm
    returned is a plain tensor, equal on every rank that holds the same
    parameters. Gradients that are plain tensors count as local to the rank.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    mesh_to_params: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is None:
            continue
        mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
        mesh_to_params.setdefault(mesh, []).append(param)
    if not mesh_to_params:
        return torch.tensor(0.0)
    mesh_norms = []
    for mesh_params in mesh_to_params.values():
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in mesh_params], norm_type, foreach=foreach
        )
        # A norm over sharded gradients is a partial DTensor: reduce it on its mesh
        mesh_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = torch.nn.utils.get_total_norm(mesh_norms, norm_type, error_if_nonfinite, foreach)
    for mesh, mesh_params in mesh_to_params.items():
        # In-place DTensor ops need an operand on the gradients' own mesh
        norm = total_norm
        if mesh is not None:
            norm = DTensor.from_local(total_norm, mesh, run_check=False)
        torch.nn.utils.clip_grads_with_norm_(mesh_params, max_norm, norm, foreach)
    return total_norm
