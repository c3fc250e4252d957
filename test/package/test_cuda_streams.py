# Owner(s): ["oncall: distributed"]
"""CUDA stream safety of FSDP's own copies and buffers, on one GPU.

The fake process group on ``cuda:0`` issues no collective kernels, so what the
CUDA sanitizer (CSAN) sees is FSDP's own work on its streams: all-gather
copy-in/copy-out, reduce-scatter inputs and outputs, casts and frees, against
the compute stream. A tensor used on one stream and then written, freed and
reused on another without an event between them raises ``CUDASanitizerErrors``.
Run by ``tools/gpu_check.sh``; skipped without CUDA.
"""

import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

import torch_fsdp_ext
from torch_fsdp_ext import MixedPrecisionPolicy, fully_shard


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class TestFullyShardCUDAStreams(TestCase):
    world_size = 4

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # CSAN must see every kernel from the start; it cannot be turned off again
        torch.cuda._sanitizer.enable_cuda_sanitizer()

    def setUp(self):
        super().setUp()
        torch.cuda.set_device(0)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def test_sanitizer_catches_an_unsynchronized_write(self):
        """Tests that CSAN is active here: a write on a side stream racing with a
        read on the current stream raises (the control for the test below)."""
        x = torch.ones(1 << 20, device="cuda")
        x.sum()  # a read on the current stream
        side = torch.cuda.Stream()
        with self.assertRaises(torch.cuda._sanitizer.CUDASanitizerErrors):
            with torch.cuda.stream(side):
                x.mul_(2)  # no wait_stream: races with the read
        torch.cuda.synchronize()

    @parametrize("group_collectives", [False, True])
    @parametrize("mixed_precision", [False, True])
    def test_training_steps_have_no_stream_race(
        self, group_collectives: bool, mixed_precision: bool
    ):
        """Tests that forward, backward (with prefetching and resharding) and the
        optimizer step raise no CSAN error, per-parameter and grouped, with and
        without a bf16 parameter cast."""
        torch.manual_seed(42)
        model = nn.Sequential(*(MLP(64, torch.device("cuda")) for _ in range(3)))
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision
            else MixedPrecisionPolicy()
        )
        for block in model:
            fully_shard(block, group_collectives=group_collectives, mp_policy=mp_policy)
        fully_shard(model, group_collectives=group_collectives, mp_policy=mp_policy)
        self.assertIsInstance(model, torch_fsdp_ext.FSDPModule)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inp = torch.randn(8, 64, device="cuda")
        for _ in range(3):
            model(inp).sum().backward()
            optim.step()
            optim.zero_grad()
        torch.cuda.synchronize()


instantiate_parametrized_tests(TestFullyShardCUDAStreams)

if __name__ == "__main__":
    run_tests()
