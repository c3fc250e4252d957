"""Peak CPU tensor memory of one training step, ``group_collectives=False``
against ``group_collectives=True``, on identically built models.

Single process over the fake process group at world size 4: collectives move
no data, so the peaks count FSDP's own buffers (all-gather outputs,
reduce-scatter inputs and outputs) next to parameters, gradients and
activations. The peak is measured exactly with the profiler (DESIGN.md, "Peak
tensor memory of a CPU region").
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import EXT, Model
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed.fake_pg import FakeStore

from torch_fsdp_ext._testing.memory import step_peak_bytes

WORLD_SIZE = 4
FP32_BYTES = 4
# Every dim-0 divides by the world size: Shard(0) without padding
DIM, HIDDEN, NUM_BLOCKS, BATCH = 256, 1024, 3, 4


def reduce_scatter_input_bytes(module: nn.Module) -> int:
    """Bytes of the fp32 reduce-scatter input (``chunk_cat`` buffer) of a group
    holding ``module``'s parameters: the sum of the padded unsharded gradient
    numels, with no padding as every dim-0 divides by the world size."""
    params = list(module.parameters())
    assert all(p.size(0) % WORLD_SIZE == 0 for p in params)
    return sum(p.numel() for p in params) * FP32_BYTES


class TestFullyShardPerParamMemory(TestCase):
    def setUp(self):
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def _peaks(self, group_collectives: bool, *, per_block: bool) -> tuple[int, int]:
        torch.manual_seed(42)
        model = Model(DIM, HIDDEN, NUM_BLOCKS)
        if per_block:
            for block in model.blocks:
                EXT.fully_shard(block, group_collectives=group_collectives)
            EXT.fully_shard(model, group_collectives=group_collectives)
        else:
            # One group; parameters stay unsharded from step to step (ZeRO-2 style)
            EXT.fully_shard(model, group_collectives=group_collectives)
            model.set_reshard_after_backward(False)
        return step_peak_bytes(model, torch.randn(BATCH, DIM))

    def test_peaks_with_per_block_groups(self):
        """Tests that with one group per block and default resharding, the
        per-parameter path's forward peak is lower than the grouped path's by
        at least 90% of a block's all-gather buffer, and its backward peak is
        not higher.

        The backward peak is reached during a block's weight-gradient
        matmuls. There, grouped mode holds the previous block's ``chunk_cat``
        buffer (``ReduceScatterState``, until the next reduce-scatter) and the
        per-parameter path holds the previous block's gradients, which it
        reduce-scattered in place, for exactly as long: a tensor handed to a
        collective stays referenced until its work or event has been waited
        on, on every device."""
        per_param_fwd, per_param_bwd = self._peaks(False, per_block=True)
        grouped_fwd, grouped_bwd = self._peaks(True, per_block=True)
        block_buffer_bytes = reduce_scatter_input_bytes(Model(DIM, HIDDEN, 1).blocks[0])
        self.assertLessEqual(per_param_fwd, grouped_fwd - 0.9 * block_buffer_bytes)
        self.assertLessEqual(per_param_bwd, grouped_bwd)

    def test_backward_peak_drops_reduce_scatter_copy_in(self):
        """Tests that where the reduce-scatter copy-in is the backward peak
        (one group, parameters kept unsharded through backward), the
        per-parameter path lowers that peak by at least 90% of the grouped
        ``chunk_cat`` buffer less the reduce-scatter output.

        Grouped mode holds the group's gradients and its reduce-scatter input
        at once, and allocates the output after freeing the gradients; the
        per-parameter path reduce-scatters the gradients in place, so only
        the outputs (1 / world size of the input) sit next to them."""
        input_bytes = reduce_scatter_input_bytes(Model(DIM, HIDDEN, NUM_BLOCKS))
        output_bytes = input_bytes // WORLD_SIZE
        _, per_param_bwd = self._peaks(False, per_block=False)
        _, grouped_bwd = self._peaks(True, per_block=False)
        self.assertLessEqual(
            per_param_bwd,
            grouped_bwd - 0.9 * (input_bytes - output_bytes),
        )


if __name__ == "__main__":
    run_tests()
