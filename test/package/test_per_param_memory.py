"""Peak tensor memory of one training step, ``group_collectives=False``
against ``group_collectives=True``, on identically built models, on CUDA
when present, else on CPU.

Single process over the fake process group at world size 4: collectives move
no data, so the peaks count FSDP's own buffers (all-gather outputs,
reduce-scatter inputs and outputs) next to parameters, gradients and
activations. On CPU the peak is measured exactly with the profiler (DESIGN.md,
"Peak tensor memory of a CPU region"); on CUDA from the caching allocator's
statistics.
"""

import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import (
    DEVICE_TYPE,
    EXT,
    FakeProcessGroupTestCase,
    FSDPExtTestMultiProcess,
    Model,
)
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from fsdp_ext_testing.comm_recorder import CommRecorder
from fsdp_ext_testing.memory import StepPeaks, step_peak_bytes

WORLD_SIZE = FakeProcessGroupTestCase.world_size
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


def _build(group_collectives: bool, *, per_block: bool, **kwargs) -> nn.Module:
    torch.manual_seed(42)
    model = Model(DIM, HIDDEN, NUM_BLOCKS)
    if per_block:
        for block in model.blocks:
            EXT.fully_shard(block, group_collectives=group_collectives, **kwargs)
        EXT.fully_shard(model, group_collectives=group_collectives, **kwargs)
    else:
        # One group; parameters stay unsharded from step to step (ZeRO-2 style)
        EXT.fully_shard(model, group_collectives=group_collectives, **kwargs)
        model.set_reshard_after_backward(False)
    return model


class TestFullyShardPerParamMemory(FakeProcessGroupTestCase):
    def _peaks(self, group_collectives: bool, *, per_block: bool) -> StepPeaks:
        model = _build(group_collectives, per_block=per_block)
        return step_peak_bytes(model, torch.randn(BATCH, DIM, device=DEVICE_TYPE))

    def test_peaks_with_per_block_groups(self):
        """Tests that with one group per block and default resharding, neither
        the per-parameter path's forward peak nor its backward peak is higher
        than the grouped path's.

        Forward: with implicit prefetching the next block's all-gather runs on
        its own stream while the current stream still computes with this
        block, so the per-parameter path keeps a resharded block's unsharded
        storages until the next block's copy-out, exactly as long as the
        grouped path keeps that block's all-gather buffer (no
        ``record_stream``, on every device). The two peaks are thus each two
        blocks' worth of all-gathered parameters.

        Backward: the peak is reached during a block's weight-gradient
        matmuls. There, grouped mode holds the previous block's ``chunk_cat``
        buffer (``ReduceScatterState``, until the next reduce-scatter) and the
        per-parameter path holds the previous block's gradients, which it
        reduce-scattered in place, for exactly as long: a tensor handed to a
        collective stays referenced until its work or event has been waited
        on, on every device."""
        per_param_fwd, per_param_bwd, _ = self._peaks(False, per_block=True)
        grouped_fwd, grouped_bwd, _ = self._peaks(True, per_block=True)
        self.assertLessEqual(per_param_fwd, grouped_fwd)
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
        per_param_bwd = self._peaks(False, per_block=False).backward
        grouped_bwd = self._peaks(True, per_block=False).backward
        self.assertLessEqual(
            per_param_bwd,
            grouped_bwd - 0.9 * (input_bytes - output_bytes),
        )

    def test_reduction_peak_drops_reduce_scatter_copy_in_per_block(self):
        """Tests that with one group per block, where the backward peak comes
        before any reduction and is equal in both modes, the peak inside
        FSDP's gradient reductions (``StepPeaks.reduce``) drops by at least
        90% of a block's ``chunk_cat`` buffer less its reduce-scatter output,
        for the reason of the test above (CPU only: the profiler scopes it)."""
        if DEVICE_TYPE != "cpu":
            self.skipTest("the reduction peak is measured on CPU only")
        model = _build(True, per_block=True)
        model(torch.randn(BATCH, DIM, device=DEVICE_TYPE)).sum().backward()
        if not hasattr(model._get_fsdp_state()._comm_ctx, "reduce_scatter_states"):
            self.skipTest(
                "this FSDP2 (torch 2.9) releases the previous group's reduce-scatter "
                "input inside the next group's reduction, so there both modes hold "
                "two groups' gradients or buffers"
            )
        input_bytes = reduce_scatter_input_bytes(Model(DIM, HIDDEN, 1).blocks[0])
        output_bytes = input_bytes // WORLD_SIZE
        per_param = self._peaks(False, per_block=True).reduce
        grouped = self._peaks(True, per_block=True).reduce
        self.assertLessEqual(per_param, grouped - 0.9 * (input_bytes - output_bytes))


class TestFullyShardPerParamMemoryMixedPrecision(FakeProcessGroupTestCase):
    """bf16 parameters whose gradients are reduced in fp32: every gradient
    needs a cast, so per-parameter mode reads none in place and makes a
    temporary for each (the common torchtitan setting)."""

    @parametrize("reduce_dtype", [torch.float32, None])
    @parametrize("per_block", [True, False])
    def test_copies_and_backward_peak_not_above_grouped(
        self, reduce_dtype: torch.dtype | None, per_block: bool
    ):
        """Tests that the per-parameter path writes no more FSDP-side copy
        bytes in a forward+backward than the grouped path, and that its
        backward peak is not higher: it frees each bf16 gradient right after
        casting it into its fp32 reduce-scatter input, so gradients plus
        temporaries never exceed the grouped path's gradients plus its
        buffer. With ``reduce_dtype=None``, torch 2.15 reduces in the fp32
        ``grad_dtype``; earlier bases reduce in bf16."""
        mp_policy = EXT.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        inp = torch.randn(BATCH, DIM, device=DEVICE_TYPE)
        copy_bytes, bwd_peaks = {}, {}
        for group_collectives in (False, True):
            model = _build(group_collectives, per_block=per_block, mp_policy=mp_policy)
            bwd_peaks[group_collectives] = step_peak_bytes(model, inp).backward
            with CommRecorder() as recorder:
                model(inp).sum().backward()
            copy_bytes[group_collectives] = recorder.summary()["copy_bytes"]
        self.assertGreater(copy_bytes[True], 0)
        self.assertLessEqual(copy_bytes[False], copy_bytes[True])
        self.assertLessEqual(bwd_peaks[False], bwd_peaks[True])


instantiate_parametrized_tests(TestFullyShardPerParamMemoryMixedPrecision)


class TestFullyShardPeakMeasurement(TestCase):
    def test_counts_frees_on_other_threads(self):
        """Tests that ``step_peak_bytes`` counts a tensor as freed when another
        thread drops its last reference, as gloo's worker threads do with a
        collective's temporaries (its reduce-scatter input clone).

        c10's CPU allocator reports a free to the profiler only on a thread
        that the profiler follows; elsewhere it left the block in the running
        total for the rest of the profile, so every collective whose
        temporary a worker thread happened to free raised all later peaks, and
        per-parameter collectives (several per group) more often than grouped
        ones (the 1.27x reported on small many-block models)."""
        if DEVICE_TYPE != "cpu":
            self.skipTest("the CPU path profiles; CUDA reads the caching allocator")
        freed_elsewhere = 1 << 20

        def loss_fn(model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
            holder = [torch.ones(freed_elsewhere, dtype=torch.uint8)]
            thread = threading.Thread(target=holder.clear)
            thread.start()
            thread.join()
            self.assertEqual(holder, [])
            return model(inp).sum()

        torch.manual_seed(42)
        model = nn.Linear(8, 8)
        peaks = step_peak_bytes(model, torch.randn(4, 8), loss_fn)
        self.assertLess(peaks.backward, freed_elsewhere)


# A small many-block shape (dim, hidden, blocks): per-parameter mode issues six
# reduce-scatters (a LayerNorm and two Linears) for each block's 16.5 KiB of
# gradients
GLOO_SHAPE = (32, 64, 8)


class TestFullyShardPerParamMemoryGloo(FSDPExtTestMultiProcess):
    """gloo (one process per rank, W=2), where collectives go one by one and
    each gloo reduce-scatter clones its input into a temporary that a gloo
    worker thread may free."""

    def _backward_peak(self, shape: tuple[int, int, int], group_collectives: bool) -> int:
        dim, hidden, num_blocks = shape
        torch.manual_seed(42)
        model = Model(dim, hidden, num_blocks)
        for block in model.blocks:
            EXT.fully_shard(block, group_collectives=group_collectives)
        EXT.fully_shard(model, group_collectives=group_collectives)
        torch.manual_seed(42 + self.rank)
        return step_peak_bytes(model, torch.randn(8, dim)).backward

    def test_backward_peak_not_above_grouped_small_blocks(self):
        """Tests that on gloo, with one group per small block, per-parameter
        mode's backward peak is not above grouped mode's, as on the fake
        process group. A report measured 1.27x on such a model; the excess
        was the profiler's: gloo's reduce-scatter temporaries freed on its
        worker threads stayed in the running total (see
        ``TestFullyShardPeakMeasurement``). This measured 1.24x before that
        was fixed.

        gloo's worker threads free a collective's temporaries on their own
        schedule, which can only raise a peak, so each mode's minimum over
        repeats is compared."""
        if dist.get_backend() != "gloo":
            self.skipTest("gloo's worker threads are what this measures")
        peaks = {
            group_collectives: min(
                self._backward_peak(GLOO_SHAPE, group_collectives) for _ in range(2)
            )
            for group_collectives in (False, True)
        }
        self.assertLessEqual(peaks[False], peaks[True])


if __name__ == "__main__":
    run_tests()
