# Owner(s): ["oncall: distributed"]

import copy

import torch
import torch.nn as nn
from torch_fsdp_ext import fully_shard
from torch.testing._internal.common_fsdp import FSDPTestMultiThread, get_devtype
from torch.testing._internal.common_utils import run_tests

device_type = torch.device(get_devtype())


class TestFullyShardSingleRankReduceScatter(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 1

    def test_gradient_divide_factor_applied_once(self):
        """Tests that on a 1-rank mesh, where FSDP skips the reduce-scatter, a
        gradient divide factor divides the gradient exactly once, also when
        the pre/post divides apply it (force-sum)."""
        self.run_subtests(
            {"force_sum": [True, False]},
            self._test_gradient_divide_factor_applied_once,
        )

    def test_gradient_divide_factor_applied_once_per_param(self):
        """Tests the same with ``group_collectives=False``."""
        self.run_subtests(
            {"force_sum": [True, False], "group_collectives": [False]},
            self._test_gradient_divide_factor_applied_once,
        )

    def _test_gradient_divide_factor_applied_once(
        self, force_sum: bool, **fully_shard_kwargs
    ):
        torch.manual_seed(42)
        ref = nn.Linear(8, 8, device=device_type)
        model = copy.deepcopy(ref)
        fully_shard(model, **fully_shard_kwargs)
        model.set_gradient_divide_factor(4.0)
        model.set_force_sum_reduction_for_comms(force_sum)
        inp = torch.randn(2, 8, device=device_type)
        model(inp).sum().backward()
        ref(inp).sum().backward()
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            self.assertTrue(torch.equal(param.grad.to_local(), ref_param.grad / 4))


if __name__ == "__main__":
    run_tests()
