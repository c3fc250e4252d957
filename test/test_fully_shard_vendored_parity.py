"""``torch_fsdp_ext.fully_shard`` (``group_collectives=True``) against torch's own
``torch.distributed.fsdp.fully_shard``: bitwise-equal losses, sharded gradients
and sharded parameters at every step, multi-process, at world sizes 2 and 4.

Upstream is the reference nobody here wrote: this proves that vendoring plus the
series leaves the default path byte-for-byte upstream.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream_fsdp
import torch.distributed.fsdp._fully_shard._fsdp_common as upstream_common
import torch.nn as nn
import torch.nn.functional as F
from common_fsdp_ext import FSDPExtTestMultiProcess, train_in_lockstep
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext

UPSTREAM = SimpleNamespace(
    fully_shard=upstream_fsdp.fully_shard,
    MixedPrecisionPolicy=upstream_fsdp.MixedPrecisionPolicy,
    FSDPMeshInfo=upstream_common.FSDPMeshInfo,
    ShardPlacementResult=upstream_common.ShardPlacementResult,
)
EXT = SimpleNamespace(
    fully_shard=torch_fsdp_ext.fully_shard,
    MixedPrecisionPolicy=torch_fsdp_ext.MixedPrecisionPolicy,
    FSDPMeshInfo=torch_fsdp_ext.FSDPMeshInfo,
    ShardPlacementResult=torch_fsdp_ext.ShardPlacementResult,
)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, num_blocks: int = 2):
        super().__init__()
        self.dim = dim
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(num_blocks))
        self.out = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class TestFullyShardVendoredParity(FSDPExtTestMultiProcess):
    """World size 2; :class:`TestFullyShardVendoredParityW4` reruns these at 4."""

    def _check_parity(
        self,
        *,
        dim: int = 16,
        hidden: int = 32,
        mesh: DeviceMesh | None = None,
        fsdp_kwargs=lambda impl: {},
        **train_kwargs,
    ) -> None:
        torch.manual_seed(42)
        base = Model(dim, hidden).to(self.device)
        mesh = mesh or init_device_mesh(self.device.type, (self.world_size,))
        models = []
        for impl in (EXT, UPSTREAM):
            model = copy.deepcopy(base)
            kwargs = fsdp_kwargs(impl)
            for block in model.blocks:
                impl.fully_shard(block, mesh=mesh, **kwargs)
            impl.fully_shard(model, mesh=mesh, **kwargs)
            models.append(model)
        # Same input on both models: seed 42 + rank, advanced per step
        gen = torch.Generator(self.device.type)

        def make_input(step: int) -> torch.Tensor:
            gen.manual_seed(42 + self.rank + 1000 * step)
            return torch.randn(4, dim, device=self.device, generator=gen)

        train_in_lockstep(self, models[0], models[1], make_input, **train_kwargs)

    def test_parity_with_upstream(self):
        """Tests bitwise parity with upstream ``fully_shard`` in every
        configuration of :meth:`_configs` (one process group, many subtests,
        since spawning ranks dominates the cost on CPU)."""
        self.run_subtests({"config": list(self._configs())}, self._test_parity_with_upstream)

    def _test_parity_with_upstream(self, config: str):
        self._check_parity(**self._configs()[config]())

    def _configs(self) -> dict[str, Callable[[], dict]]:
        configs = {
            "fp32": dict,
            "bf16_params_fp32_reduce": lambda: {
                "fsdp_kwargs": lambda impl: {
                    "mp_policy": impl.MixedPrecisionPolicy(
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                    )
                }
            },
            "shard_dim1_for_2d_params": lambda: {
                "fsdp_kwargs": lambda impl: {
                    "shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else None
                }
            },
            "per_param_mesh": self._per_param_mesh_config,
            "grad_accumulation_no_sync": lambda: {
                "microbatches": 3,
                "no_sync_microbatches": True,
            },
            # dim-0 sizes not divisible by the world size: padded shards
            "uneven_dim0": lambda: {"dim": 15, "hidden": 21},
        }
        if self.world_size == 4:
            configs["reshard_after_forward_2"] = lambda: {
                "fsdp_kwargs": lambda impl: {"reshard_after_forward": 2}
            }
            configs["hsdp_2x2"] = lambda: {
                "mesh": init_device_mesh(
                    self.device.type, (2, 2), mesh_dim_names=("replicate", "shard")
                )
            }
        return configs

    def _per_param_mesh_config(self) -> dict:
        # ``ShardPlacementResult`` puts each block's w1 on a second process group
        other_pg = dist.new_group(list(range(self.world_size)))
        other_mesh = DeviceMesh.from_group(other_pg, self.device.type)

        def fsdp_kwargs(impl):
            info = impl.FSDPMeshInfo(other_mesh, shard_mesh_dim=0)

            def shard_placement_fn(param: nn.Parameter):
                # w1's weight is (hidden, dim) and its bias is (hidden,)
                if param.shape[0] == 32:
                    return impl.ShardPlacementResult(Shard(0), info)
                return None

            return {"shard_placement_fn": shard_placement_fn}

        return {"fsdp_kwargs": fsdp_kwargs}


class TestFullyShardVendoredParityW4(TestFullyShardVendoredParity):
    """World size 4 adds ``reshard_after_forward=2`` and HSDP on a 2x2 mesh."""

    @property
    def world_size(self) -> int:
        return 4


if __name__ == "__main__":
    run_tests()
