"""torch_fsdp_ext.clip_grad_norm_ over parameters sharded on different meshes.

The total norm and the clipped gradients are checked against an unsharded model
trained on every rank's input (float tolerance: the reduction order differs),
and against the full gradients of an expert-parallel layout, in both collective
modes (which must agree bitwise).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import (
    EXT,
    assert_matches_reference,
    assert_model_matches_reference,
    requires_per_param_meshes,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.common_fsdp import FSDPTestMultiThread
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext import clip_grad_norm_, fully_shard

DIM = 8


class TinyMoE(nn.Module):
    """A dense layer, then grouped experts ``(num_experts, dim, dim)`` summed over
    the experts this rank holds (all of them unless ``w`` is an EP DTensor)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.w = nn.Parameter(torch.empty(4, DIM, DIM))
        # The same values on every rank: threads of the threaded process group
        # share the global RNG
        gen = torch.Generator().manual_seed(42)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) / DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.to_local() if isinstance(self.w, DTensor) else self.w
        return torch.einsum("bd,edh->bh", torch.relu(self.dense(x)), w)


def _experts_on(mesh: DeviceMesh):
    return lambda p: EXT.ShardPlacementResult(Shard(1), mesh=mesh) if p.ndim == 3 else None


@requires_per_param_meshes
class TestClipGradNormAcrossMeshes(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def _inputs(self) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(43)
        return [torch.randn(3, DIM, generator=gen) for _ in range(self.world_size)]

    @pytest.mark.reference
    def test_matches_unsharded_reference(self):
        """Tests that the total norm and the clipped gradients of a model with
        dense params on one mesh and experts on another equal those of the
        unsharded model on all ranks' inputs, for the 2-norm and the inf-norm."""
        for norm_type in (2.0, float("inf")):
            ref = TinyMoE()
            model = copy.deepcopy(ref)
            dp_mesh = init_device_mesh("cpu", (self.world_size,))
            pg = dist.new_group(list(range(self.world_size)))
            expert_mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("efsdp",))
            fully_shard(model, mesh=dp_mesh, shard_placement_fn=_experts_on(expert_mesh))
            self.assertNotEqual(model.w.device_mesh, model.dense.weight.device_mesh)
            inputs = self._inputs()
            model(inputs[self.rank]).sum().backward()
            # FSDP averages gradients over ranks
            (sum(ref(x).sum() for x in inputs) / self.world_size).backward()

            max_norm = 0.1
            norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
            self.assertGreater(ref_norm.item(), max_norm)  # clipping took effect
            self.assertNotIsInstance(norm, DTensor)
            # The largest reordered sum: all ranks' inputs times the width
            reduction_size = self.world_size * 3 * DIM
            assert_matches_reference(
                self, norm, ref_norm, reduction_size=reduction_size, msg=f"{norm_type}-norm"
            )
            assert_model_matches_reference(
                self,
                model,
                ref,
                grads=True,
                reduction_size=reduction_size,
                what=f"{norm_type}-norm clipped",
            )

    @pytest.mark.reference
    def test_expert_parallel_layout(self):
        """Tests clipping with experts that are EP DTensors on ("efsdp", "ep")
        and dense params on the flattened dp mesh: the norm is the norm of the
        full gradients, the gradients are scaled by the clip coefficient, and
        both collective modes give the same bits."""
        world_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        dp_mesh = world_mesh["efsdp", "ep"]._flatten("dp")
        base = TinyMoE()
        norms = []
        for group_collectives in (True, False):
            model = copy.deepcopy(base)
            model.w = nn.Parameter(
                distribute_tensor(model.w.detach(), world_mesh["ep"], [Shard(0)])
            )
            fully_shard(
                model,
                mesh=dp_mesh,
                group_collectives=group_collectives,
                shard_placement_fn=_experts_on(world_mesh["efsdp"]),
            )
            self.assertEqual(model.w.device_mesh, world_mesh)
            model(self._inputs()[self.rank]).sum().backward()
            full_grads = [p.grad.full_tensor() for p in model.parameters()]
            with self.assertRaisesRegex(RuntimeError, "must have the same mesh"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full_grads]))
            max_norm = expected.item() / 2
            norm = clip_grad_norm_(model.parameters(), max_norm)
            # Per-mesh norms, then their norm: the squares are summed in
            # another order than one norm over all elements
            numel = sum(g.numel() for g in full_grads)
            assert_matches_reference(self, norm, expected, reduction_size=numel, msg="norm")
            coef = max_norm / (norm + 1e-6)
            for param, full_grad in zip(model.parameters(), full_grads, strict=True):
                assert_matches_reference(
                    self,
                    param.grad.full_tensor(),
                    full_grad * coef,
                    reduction_size=numel,
                    msg="clipped grad",
                )
            norms.append(norm)
        self.assertTrue(torch.equal(norms[0], norms[1]))


if __name__ == "__main__":
    run_tests()
