"""``group_collectives=False`` on gloo: a group's per-parameter collectives are
issued as one coalesced c10d op per group (``dist._coalescing_manager``), not
one op per parameter.

Multi-process at world size 2; the c10d ops are recorded at dispatch, where a
coalesced op list reaches the backend as a single op.
"""

import torch
from common_fsdp_ext import DEVICE_TYPE, EXT, FSDPExtTestMultiProcess, Model
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext._testing.comm_recorder import CommRecorder


class TestFullyShardPerParamCoalescing(FSDPExtTestMultiProcess):
    def _record_step(self, group_collectives: bool) -> str:
        device = torch.device("cuda", self.rank) if DEVICE_TYPE == "cuda" else torch.device("cpu")
        torch.manual_seed(42)
        model = Model(16, 32).to(device)
        for block in model.blocks:
            EXT.fully_shard(block, group_collectives=group_collectives)
        EXT.fully_shard(model, group_collectives=group_collectives)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank)
        inp = torch.randn(4, 16, device=device)

        def step():
            model(inp).sum().backward()
            optim.step()
            optim.zero_grad()

        step()  # warm-up: lazy init
        with CommRecorder() as recorder:
            step()
        return "\n".join(
            f"{c.phase} {c.op} {'+'.join(map(str, c.input_numels))}" for c in recorder.collectives
        )

    def test_one_coalesced_op_per_group(self):
        """Tests that with ``group_collectives=False`` each group's all-gathers
        (forward and backward) are issued as one ``allgather_into_tensor_coalesced_``
        over its parameters' shards and its reduce-scatters as one
        ``reduce_scatter_tensor_coalesced_`` over its gradients, where grouped
        collectives issue one ``_allgather_base_`` and one
        ``_reduce_scatter_base_`` over each group's flat buffer.

        Both modes run in the same processes (one spawn); every rank runs the
        steps, rank 0 checks the traces."""
        per_param = self._record_step(group_collectives=False)
        grouped = self._record_step(group_collectives=True)
        if self.rank != 0:
            return
        # Forward: root (inp, out), blocks 0, 1; backward: all-gathers of
        # blocks 1, 0, then reduce-scatters of blocks 1, 0 and root. Numels:
        # shards for all-gathers, unsharded gradients for reduce-scatters
        self.assertExpectedInline(
            per_param,
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


if __name__ == "__main__":
    run_tests()
