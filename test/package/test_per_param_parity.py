"""``group_collectives=False`` against ``group_collectives=True``: bitwise-equal
losses, sharded gradients and sharded parameters at every step, multi-process.

At world size 2 a sum of two values does not depend on how tensors are packed,
so the default comms give identical bits (DESIGN.md, "Numerics"). At world size
4 gloo sums in an order that depends on message size, so both sides use
``DeterministicReduceScatter``.
"""

import copy

import pytest
import torch
from common_fsdp_ext import (
    EXT,
    FSDPExtTestMultiProcess,
    Model,
    ParityConfig,
    ParityMixin,
    assert_model_matches_reference,
    on_fsdp_modules,
    param_groups,
)
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext import DeterministicReduceScatter

PER_PARAM = (EXT, {"group_collectives": False})
GROUPED = (EXT, {"group_collectives": True})


class TestFullyShardPerParamParity(ParityMixin, FSDPExtTestMultiProcess):
    def test_per_param_matches_grouped(self):
        """Tests that per-parameter collectives give the same bits as grouped
        ones in every configuration of ``base_parity_configs``."""
        self.run_subtests(
            {"config": list(self.base_parity_configs())}, self._test_per_param_matches_grouped
        )

    def _test_per_param_matches_grouped(self, config: str):
        self.check_parity(self.base_parity_configs()[config](), PER_PARAM, GROUPED)

    @pytest.mark.reference
    def test_per_param_matches_unsharded_reference(self):
        """Tests, as a sanity check, that per-parameter FSDP trains like one
        unsharded model fed every rank's input (FSDP averages gradients over
        ranks, so the reference averages the losses): gradients and
        parameters within the rounding bound of the largest reordered sum.
        SGD, as Adam would turn rounding-level gradient differences into
        parameter differences of about ``lr``."""
        torch.manual_seed(42)
        ref_model = Model(16, 32).to(self.device)
        model = copy.deepcopy(ref_model)
        for block in model.blocks:
            EXT.fully_shard(block, group_collectives=False)
        EXT.fully_shard(model, group_collectives=False)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        gen = torch.Generator(self.device.type)
        batch, hidden = 4, 32
        reduction_size = self.world_size * batch * hidden
        for step in range(4):
            inputs = []
            for rank in range(self.world_size):
                gen.manual_seed(42 + rank + 1000 * step)
                inputs.append(torch.randn(batch, 16, device=self.device, generator=gen))
            loss = model(inputs[self.rank]).sum()
            loss.backward()
            ref_loss = sum(ref_model(inp).sum() for inp in inputs) / self.world_size
            ref_loss.backward()
            assert_model_matches_reference(
                self,
                model,
                ref_model,
                grads=True,
                reduction_size=reduction_size,
                what=f"step {step}",
            )
            for o in (optim, ref_optim):
                o.step()
                o.zero_grad()
            assert_model_matches_reference(
                self,
                model,
                ref_model,
                grads=False,
                reduction_size=reduction_size,
                what=f"step {step}",
            )


def _set_deterministic_reduce_scatter(module) -> None:
    # Set per group: set_custom_reduce_scatter refuses modules with several
    # groups (per-parameter meshes), but this comm is stateless
    for group in param_groups(module):
        group._reduce_scatter_comm = DeterministicReduceScatter()


_use_deterministic_reduce_scatter = on_fsdp_modules(_set_deterministic_reduce_scatter)


@pytest.mark.slow
class TestFullyShardPerParamParityDeterministicW4(ParityMixin, FSDPExtTestMultiProcess):
    @property
    def world_size(self) -> int:
        return 4

    def test_per_param_matches_grouped_deterministic(self):
        """Tests that with ``DeterministicReduceScatter`` on both sides,
        per-parameter collectives give the same bits as grouped ones at world
        size 4 in every configuration of ``base_parity_configs``."""
        self.run_subtests(
            {"config": list(self.base_parity_configs())},
            self._test_per_param_matches_grouped_deterministic,
        )

    def _test_per_param_matches_grouped_deterministic(self, config: str):
        base = self.base_parity_configs()[config]()
        after_shard = base.after_shard

        def after_shard_deterministic(model):
            after_shard(model)
            _use_deterministic_reduce_scatter(model)

        config = ParityConfig(**{**vars(base), "after_shard": after_shard_deterministic})
        self.check_parity(config, PER_PARAM, GROUPED)


if __name__ == "__main__":
    run_tests()
