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
from torch._C._profiler import _EventType
from torch.profiler import record_function
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZE = 4
FP32_BYTES = 4
# Every dim-0 divides by the world size: Shard(0) without padding
DIM, HIDDEN, NUM_BLOCKS, BATCH = 256, 1024, 3, 4


def _walk(events):
    stack = list(events)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        yield event


def profile_step(model: nn.Module, inp: torch.Tensor) -> torch.profiler.profile:
    """Profiles memory over a warm-up step (lazy init) and one measured step,
    marked ``{warmup,measured}_{forward,backward}`` with ``record_function``."""
    with torch.profiler.profile(profile_memory=True) as prof:
        for step in ("warmup", "measured"):
            with record_function(f"{step}_forward"):
                loss = model(inp).sum()
            with record_function(f"{step}_backward"):
                loss.backward()
            del loss
            for param in model.parameters():
                param.grad = None
    return prof


def step_peak_bytes(model: nn.Module, inp: torch.Tensor) -> tuple[int, int]:
    """Runs a warm-up step (lazy init), then one measured forward and backward.

    Returns the peak allocated bytes during the measured forward and during
    the measured backward, each counted from the allocated bytes at the start
    of the measured step. Both steps run under one profiler: the CPU allocator
    reports a free only for a block it saw allocated while profiling, and its
    running total carries over from earlier profiler sessions, hence the
    baseline taken from the measured step's first allocation.
    """
    prof = profile_step(model, inp)
    events = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    spans = {e.name: (e.start_time_ns, e.end_time_ns) for e in events}
    allocations = sorted(
        (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated)
        for e in events
        if e.tag == _EventType.Allocation
    )
    fwd_start, fwd_end = spans["measured_forward"]
    bwd_start, bwd_end = spans["measured_backward"]
    _, first_size, first_total = next(a for a in allocations if a[0] >= fwd_start)
    baseline = first_total - first_size

    def peak(start: int, end: int) -> int:
        return max(total for t, _, total in allocations if start <= t <= end) - baseline

    return peak(fwd_start, fwd_end), peak(bwd_start, bwd_end)


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

    def test_peaks_drop_with_per_block_groups(self):
        """Tests that with one group per block and default resharding, the
        per-parameter path's forward peak is not higher than the grouped
        path's, and its backward peak is lower by at least 90% of a block's
        reduce-scatter buffer.

        The backward peak is reached during a block's weight-gradient
        matmuls. Grouped mode still holds the previous block's ``chunk_cat``
        buffer there (``ReduceScatterState``, until the next reduce-scatter);
        on CPU the per-parameter path has already freed the gradients it
        reduce-scattered in place."""
        per_param_fwd, per_param_bwd = self._peaks(False, per_block=True)
        grouped_fwd, grouped_bwd = self._peaks(True, per_block=True)
        block_buffer_bytes = reduce_scatter_input_bytes(Model(DIM, HIDDEN, 1).blocks[0])
        self.assertLessEqual(per_param_fwd, grouped_fwd)
        self.assertLessEqual(per_param_bwd, grouped_bwd - 0.9 * block_buffer_bytes)

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
