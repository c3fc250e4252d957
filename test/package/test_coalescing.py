"""``group_collectives=False``: whether a group's per-parameter collectives go
out as one coalesced c10d op or one op per parameter. gloo coalesces by
default (it implements the coalesced all-gather and reduce-scatter, though it
does not report ``supports_coalescing``); an FSDP backend registered with
``supports_coalescing=False`` turns it off. Coalesced and one by one must give
the same bits, and a group of several dtypes must go one by one (gloo's
coalesced all-gather writes wrong values for some dtype mixes).

Multi-process on CPU; the c10d ops are recorded at dispatch, where a coalesced
op list reaches the backend as a single op.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import (
    EXT,
    FSDPExtTestMultiProcess,
    Model,
    assert_models_bitwise_equal,
    registered_fsdp_backend,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext import FSDPBackend
from torch_fsdp_ext._testing.comm_recorder import CommRecorder

DEVICE = torch.device("cpu")


def _build(group_collectives: bool) -> nn.Module:
    mesh = DeviceMesh.from_group(dist.group.WORLD, DEVICE.type)
    torch.manual_seed(42)
    # 16 x 32 blocks: unevenly sharded at 3 ranks, padded at 4 (the bias
    # of 16 at 3 ranks)
    model = Model(16, 32).to(DEVICE)
    for block in model.blocks:
        EXT.fully_shard(block, mesh=mesh, group_collectives=group_collectives)
    EXT.fully_shard(model, mesh=mesh, group_collectives=group_collectives)
    return model


def _train(model: nn.Module, rank: int, steps: int) -> None:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank)
    for _ in range(steps):
        model(torch.randn(4, 16, device=DEVICE)).sum().backward()
        optim.step()
        optim.zero_grad()


def _one_by_one():
    return registered_fsdp_backend(DEVICE.type, FSDPBackend(supports_coalescing=False))


class TestFullyShardPerParamCoalescing(FSDPExtTestMultiProcess):
    def _record_step(self, group_collectives: bool) -> str:
        model = _build(group_collectives)
        _train(model, self.rank, 1)  # warm-up: lazy init
        with CommRecorder() as recorder:
            _train(model, self.rank, 1)
        return "\n".join(
            f"{c.phase} {c.op} {'+'.join(map(str, c.input_numels))}" for c in recorder.collectives
        )

    def test_coalescing_follows_the_process_group(self):
        """Tests that with ``group_collectives=False`` each group's all-gathers
        (forward and backward) and reduce-scatters are one
        ``allgather_into_tensor_coalesced_`` / ``reduce_scatter_tensor_coalesced_``
        per group on gloo, and one op per parameter with an FSDP backend
        registered with ``supports_coalescing=False``, where grouped
        collectives issue one ``_allgather_base_`` and one
        ``_reduce_scatter_base_`` over each group's flat buffer either way.

        All runs share the processes (one spawn); every rank runs the steps,
        rank 0 checks the traces."""
        coalesced = self._record_step(group_collectives=False)
        grouped = self._record_step(group_collectives=True)
        with _one_by_one():
            per_param = self._record_step(group_collectives=False)
            grouped_one_by_one = self._record_step(group_collectives=True)
        if self.rank != 0:
            return
        self.assertEqual(grouped_one_by_one, grouped)
        # Forward: root (inp, out), blocks 0, 1; backward: all-gathers of
        # blocks 1, 0, then reduce-scatters of blocks 1, 0 and root. Numels:
        # shards for all-gathers, unsharded gradients for reduce-scatters
        self.assertExpectedInline(
            coalesced,
            """\
forward allgather_into_tensor_coalesced_ 128+8+64+4
forward allgather_into_tensor_coalesced_ 8+8+256+16+256+8
forward allgather_into_tensor_coalesced_ 8+8+256+16+256+8
backward allgather_into_tensor_coalesced_ 8+8+256+16+256+8
backward allgather_into_tensor_coalesced_ 8+8+256+16+256+8
backward reduce_scatter_tensor_coalesced_ 16+16+512+32+512+16
backward reduce_scatter_tensor_coalesced_ 16+16+512+32+512+16
backward reduce_scatter_tensor_coalesced_ 256+16+128+8""",
        )
        self.assertExpectedInline(
            per_param,
            """\
forward _allgather_base_ 128
forward _allgather_base_ 8
forward _allgather_base_ 64
forward _allgather_base_ 4
forward _allgather_base_ 8
forward _allgather_base_ 8
forward _allgather_base_ 256
forward _allgather_base_ 16
forward _allgather_base_ 256
forward _allgather_base_ 8
forward _allgather_base_ 8
forward _allgather_base_ 8
forward _allgather_base_ 256
forward _allgather_base_ 16
forward _allgather_base_ 256
forward _allgather_base_ 8
backward _allgather_base_ 8
backward _allgather_base_ 8
backward _allgather_base_ 256
backward _allgather_base_ 16
backward _allgather_base_ 256
backward _allgather_base_ 8
backward _allgather_base_ 8
backward _allgather_base_ 8
backward _allgather_base_ 256
backward _allgather_base_ 16
backward _allgather_base_ 256
backward _allgather_base_ 8
backward _reduce_scatter_base_ 16
backward _reduce_scatter_base_ 16
backward _reduce_scatter_base_ 512
backward _reduce_scatter_base_ 32
backward _reduce_scatter_base_ 512
backward _reduce_scatter_base_ 16
backward _reduce_scatter_base_ 16
backward _reduce_scatter_base_ 16
backward _reduce_scatter_base_ 512
backward _reduce_scatter_base_ 32
backward _reduce_scatter_base_ 512
backward _reduce_scatter_base_ 16
backward _reduce_scatter_base_ 256
backward _reduce_scatter_base_ 16
backward _reduce_scatter_base_ 128
backward _reduce_scatter_base_ 8""",
        )
        self.assertExpectedInline(
            grouped,
            """\
forward _allgather_base_ 204
forward _allgather_base_ 552
forward _allgather_base_ 552
backward _allgather_base_ 552
backward _allgather_base_ 552
backward _reduce_scatter_base_ 1104
backward _reduce_scatter_base_ 1104
backward _reduce_scatter_base_ 408""",
        )


class TestFullyShardPerParamCoalescingBits(FSDPExtTestMultiProcess):
    @property
    def world_size(self) -> int:
        return 4

    def test_coalesced_matches_one_by_one_bitwise(self):
        """Tests that at 4 ranks, where gloo's sums may depend on message size,
        per-parameter collectives coalesced (gloo's default) and one by one
        give bitwise equal parameters after three AdamW steps, padding
        included."""
        coalesced = _build(group_collectives=False)
        _train(coalesced, self.rank, 3)
        with _one_by_one():
            one_by_one = _build(group_collectives=False)
            _train(one_by_one, self.rank, 3)
        assert_models_bitwise_equal(
            self, coalesced, one_by_one, "coalesced vs one by one", grads=False
        )

    def test_group_of_several_dtypes_gathers_exact_values(self):
        """Tests that a group holding bf16, fp32 and fp64 parameters (frozen,
        which FSDP allows without mixed precision) all-gathers each
        parameter's exact values: such a group goes out one op per
        parameter, as gloo's coalesced all-gather writes wrong values for
        these mixes."""
        torch.manual_seed(42)
        model = nn.Sequential(
            nn.Linear(8, 8, dtype=torch.bfloat16),
            nn.Linear(8, 8, dtype=torch.float32),
            nn.Linear(8, 8, dtype=torch.float64),
        )
        model.requires_grad_(False)
        expected = [p.detach().clone() for p in model.parameters()]
        mesh = DeviceMesh.from_group(dist.group.WORLD, DEVICE.type)
        EXT.fully_shard(model, mesh=mesh, group_collectives=False)
        with CommRecorder() as recorder:
            model.unshard()
        self.assertNotIn("coalesced", " ".join(c.op for c in recorder.collectives))
        for param, full in zip(model.parameters(), expected, strict=True):
            self.assertTrue(torch.equal(param, full), msg=str(full.dtype))


if __name__ == "__main__":
    run_tests()
