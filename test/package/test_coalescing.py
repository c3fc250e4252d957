"""``group_collectives=False``: whether a group's per-parameter collectives go
out as one coalesced c10d op (``dist._coalescing_manager``) or one op per
parameter follows the process group: its backend's ``supports_coalescing``.
gloo does not report it; a gloo backend that does (registered below as
``"coalescing_gloo"``) coalesces.

Multi-process at world size 2 on CPU; the c10d ops are recorded at dispatch,
where a coalesced op list reaches the backend as a single op.
"""

import torch
import torch.distributed as dist
from common_fsdp_ext import EXT, FSDPExtTestMultiProcess, Model
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext._testing.comm_recorder import CommRecorder


class _CoalescingGloo(dist.ProcessGroupGloo):
    """gloo, reporting that it supports coalescing (it implements the
    coalesced all-gather and reduce-scatter that the coalescing manager's fast
    path calls, but does not say so)."""

    @property
    def supports_coalescing(self) -> bool:
        return True


dist.Backend.register_backend(
    "coalescing_gloo",
    lambda store, rank, size, timeout: _CoalescingGloo(store, rank, size, timeout),
    devices=["cpu"],
)


class TestFullyShardPerParamCoalescing(FSDPExtTestMultiProcess):
    def _record_step(self, group_collectives: bool, backend: str = "gloo") -> str:
        device = torch.device("cpu")
        group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend=backend)
        mesh = DeviceMesh.from_group(group, device.type)
        torch.manual_seed(42)
        model = Model(16, 32).to(device)
        for block in model.blocks:
            EXT.fully_shard(block, mesh=mesh, group_collectives=group_collectives)
        EXT.fully_shard(model, mesh=mesh, group_collectives=group_collectives)
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

    def test_coalescing_follows_the_process_group(self):
        """Tests that with ``group_collectives=False`` each group's all-gathers
        (forward and backward) and reduce-scatters are one op per parameter on
        gloo, which does not report ``supports_coalescing``, and one
        ``allgather_into_tensor_coalesced_`` / ``reduce_scatter_tensor_coalesced_``
        per group on a gloo backend that reports it, where grouped collectives
        issue one ``_allgather_base_`` and one ``_reduce_scatter_base_`` over
        each group's flat buffer on either.

        All runs share the processes (one spawn); every rank runs the steps,
        rank 0 checks the traces."""
        per_param = self._record_step(group_collectives=False)
        coalesced = self._record_step(group_collectives=False, backend="coalescing_gloo")
        grouped = self._record_step(group_collectives=True)
        grouped_coalescing = self._record_step(group_collectives=True, backend="coalescing_gloo")
        if self.rank != 0:
            return
        self.assertEqual(grouped_coalescing, grouped)
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


if __name__ == "__main__":
    run_tests()
