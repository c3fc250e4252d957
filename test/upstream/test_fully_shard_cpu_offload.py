# Owner(s): ["oncall: distributed"]

import torch
from torch_fsdp_ext import CPUOffloadPolicy, fully_shard
from torch.testing._internal.common_fsdp import FSDPTestMultiThread, MLP
from torch.testing._internal.common_utils import run_tests


class TestFullyShardCPUOffloadWithoutAccelerator(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_default_policy_trains_without_pinning(self):
        """Tests that the default ``CPUOffloadPolicy()`` trains on a machine
        without an accelerator, leaving the offloaded memory unpinned."""
        if torch.accelerator.is_available():
            self.skipTest("pinning is used when an accelerator is present")
        torch.manual_seed(42)
        model = fully_shard(MLP(8), offload_policy=CPUOffloadPolicy())
        model(torch.randn(4, 8)).sum().backward()
        for param in model.parameters():
            self.assertFalse(param.to_local().is_pinned())
            self.assertIsNotNone(param.grad)


if __name__ == "__main__":
    run_tests()
