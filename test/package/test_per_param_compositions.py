"""``group_collectives=False`` composes with the rest of FSDP2: for each feature,
per-parameter and grouped collectives give bitwise-equal losses, sharded
gradients and sharded parameters at every step.

Threaded process group (fast, many configurations); the multi-process gloo
proof is ``test_fully_shard_per_param_parity.py``.
"""

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import (  # noqa: F401  (TestUnexpressibleConfigs: run here too)
    EXT,
    Block,
    Model,
    ParityConfig,
    ParityMixin,
    TestUnexpressibleConfigs,
    on_fsdp_modules,
    unexpressible_configs,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_fsdp import FSDPTestMultiThread
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter

PER_PARAM = (EXT, {"group_collectives": False})
GROUPED = (EXT, {"group_collectives": True})


class PlainAllGather(AllGather):
    """A user comm: plain allocation, one c10d all-gather per call."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class PlainReduceScatter(ReduceScatter):
    """A user comm: plain allocation, one c10d reduce-scatter per call."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)


class BlockWithUnusedParam(Block):
    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden)
        self.unused = nn.Linear(dim, dim)


class ModelWithUnusedParams(Model):
    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden)
        self.blocks = nn.ModuleList(BlockWithUnusedParam(dim, hidden) for _ in range(2))


def _explicit_prefetching(model: nn.Module) -> None:
    blocks = list(model.blocks)
    for i, block in enumerate(blocks[:-1]):
        block.set_modules_to_forward_prefetch([blocks[i + 1]])
    for i, block in enumerate(blocks[1:], start=1):
        block.set_modules_to_backward_prefetch([blocks[i - 1]])


class TestFullyShardPerParamCompositions(ParityMixin, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def composition_configs(self) -> dict[str, Callable[[], ParityConfig]]:
        configs = self.base_parity_configs()
        configs.update(
            {
                "fp16_sum_reduction": lambda: ParityConfig(
                    fsdp_kwargs=lambda impl: {
                        "mp_policy": impl.MixedPrecisionPolicy(
                            param_dtype=torch.float16, reduce_dtype=torch.float16
                        )
                    }
                ),
                "gradient_divide_factor_force_sum": lambda: ParityConfig(
                    after_shard=on_fsdp_modules(
                        lambda m: (
                            m.set_gradient_divide_factor(3.0),
                            m.set_force_sum_reduction_for_comms(True),
                        )
                    )
                ),
                "cpu_offload": lambda: ParityConfig(
                    fsdp_kwargs=lambda impl: {
                        "offload_policy": impl.CPUOffloadPolicy(pin_memory=False)
                    }
                ),
                "post_accumulate_grad_hooks": lambda: ParityConfig(
                    after_shard=lambda model: (
                        [
                            p.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))
                            for p in model.parameters()
                        ]
                        and None
                    )
                ),
                "reshard_after_forward_false": lambda: ParityConfig(
                    fsdp_kwargs=lambda impl: {"reshard_after_forward": False}
                ),
                "custom_comms": lambda: ParityConfig(
                    after_shard=on_fsdp_modules(
                        lambda m: (
                            m.set_custom_all_gather(PlainAllGather()),
                            m.set_custom_reduce_scatter(PlainReduceScatter()),
                        )
                    )
                ),
                "unused_params_reduce_scattered": lambda: ParityConfig(
                    model_fn=ModelWithUnusedParams,
                    after_shard=lambda model: model.set_reduce_scatter_unused_params(True),
                ),
                "unused_params_skipped": lambda: ParityConfig(model_fn=ModelWithUnusedParams),
                "reduce_scatter_max_input_buffers_2": lambda: ParityConfig(
                    after_shard=lambda model: model.set_reduce_scatter_max_input_buffers(2)
                ),
                "explicit_prefetching": lambda: ParityConfig(after_shard=_explicit_prefetching),
                "unshard_async": lambda: ParityConfig(
                    train_kwargs={
                        "before_forward": lambda model: model.blocks[0].unshard(async_op=True)
                    }
                ),
            }
        )
        if self.world_size == 4:
            configs["hsdp_partial_reduce_accumulation"] = lambda: ParityConfig(
                mesh=init_device_mesh(
                    self.device.type, (2, 2), mesh_dim_names=("replicate", "shard")
                ),
                train_kwargs={"microbatches": 3, "no_all_reduce_microbatches": True},
            )
        # Settings that the base's FSDP2 does not have (torch 2.9) have
        # nothing to compose with (reported by test_unexpressible_configs)
        for name in unexpressible_configs():
            configs.pop(name, None)
        return configs

    def test_per_param_matches_grouped_with_every_feature(self):
        """Tests that per-parameter collectives give the same bits as grouped
        ones with each FSDP2 feature: mixed precision, divide factors, CPU
        offload, hooks, resharding, custom comms, unused parameters, buffer
        caps, explicit prefetching, async unshard, ``Shard(1)``, per-parameter
        meshes, HSDP and gradient accumulation."""
        self.run_subtests(
            {"config": list(self.composition_configs())},
            self._test_per_param_matches_grouped,
        )

    def _test_per_param_matches_grouped(self, config: str):
        self.check_parity(self.composition_configs()[config](), PER_PARAM, GROUPED)


@pytest.mark.slow
class TestFullyShardPerParamCompositionsW4(TestFullyShardPerParamCompositions):
    """World size 4 adds ``reshard_after_forward=2``, HSDP and HSDP partial
    reduce accumulation."""

    @property
    def world_size(self) -> int:
        return 4


if __name__ == "__main__":
    run_tests()
