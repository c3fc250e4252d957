"""``group_collectives=False``: whether a group's per-parameter collectives go
out as one coalesced c10d op or one op per parameter, and that custom comms
are honored. FSDP's default comms go one by one on gloo (it does not report
``supports_coalescing``, and its coalesced ops copy every tensor of the op into
one temporary, which costs memory); ``fsdp_ext_testing.coalescing.COALESCED``
registers comms that coalesce on gloo too. Coalesced and one by one must give
the same bits.

Multi-process on CPU; the c10d ops are recorded at dispatch, where a coalesced
op list reaches the backend as a single op.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import (
    EXT,
    FSDPExtTestMultiProcess,
    Model,
    assert_models_bitwise_equal,
    fsdp_modules,
    registered_fsdp_backend,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.common_utils import run_tests
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_ext_testing.coalescing import COALESCED
from fsdp_ext_testing.comm_recorder import CommRecorder
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch_fsdp_ext._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

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


def _coalescing():
    return registered_fsdp_backend(DEVICE.type, COALESCED)


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
        (forward and backward) and reduce-scatters are one op per parameter on
        gloo, and one ``allgather_into_tensor_coalesced_`` /
        ``reduce_scatter_tensor_coalesced_`` per group with ``COALESCED``
        registered, where grouped
        collectives issue one ``_allgather_base_`` and one
        ``_reduce_scatter_base_`` over each group's flat buffer either way.

        All runs share the processes (one spawn); every rank runs the steps,
        rank 0 checks the traces."""
        per_param = self._record_step(group_collectives=False)
        grouped = self._record_step(group_collectives=True)
        with _coalescing():
            coalesced = self._record_step(group_collectives=False)
            grouped_coalescing = self._record_step(group_collectives=True)
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


class TestFullyShardPerParamCoalescingBits(FSDPExtTestMultiProcess):
    @property
    def world_size(self) -> int:
        return 4

    def test_coalesced_matches_one_by_one_bitwise(self):
        """Tests that at 4 ranks, where gloo's sums may depend on message size,
        per-parameter collectives coalesced and one by one (gloo's default)
        give bitwise equal parameters after three AdamW steps, padding
        included."""
        with _coalescing():
            coalesced = _build(group_collectives=False)
            _train(coalesced, self.rank, 3)
        one_by_one = _build(group_collectives=False)
        _train(one_by_one, self.rank, 3)
        assert_models_bitwise_equal(
            self, coalesced, one_by_one, "coalesced vs one by one", grads=False
        )


class _InFlightAllGather(DefaultAllGather):
    """Leaves a group's all-gathers in flight for ``async_op``: one plain
    asynchronous c10d all-gather per pair, returned as one work. gloo writes
    each output from its worker thread after ``foreach`` returns (gloo's
    coalesced works are not left in flight; see ``fsdp_ext_testing.coalescing``)."""

    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        works = [
            dist.all_gather_into_tensor(output, input, group=group, async_op=True)
            for output, input in zip(output_tensors, input_tensors, strict=True)
        ]
        work = torch._C._distributed_c10d._create_work_from_future(
            torch.futures.collect_all([w.get_future() for w in works])
        )
        if async_op:
            return work
        work.wait()
        return None


class TestFullyShardPerParamAsyncUnshard(FSDPExtTestMultiProcess):
    def test_async_unshard_matches_grouped_coalesced_or_not(self):
        """Tests that with ``_set_unshard_async_op(True)`` (prefetched
        all-gathers in flight while the previous block computes), per-parameter
        collectives, coalesced, one by one and with a comm that leaves them in
        flight, train bitwise like grouped ones over 5 steps. In flight, gloo
        writes each all-gather output from its own thread after the call
        returns; the outputs' version counters must still read as at issue, or
        autograd's saved-tensor check fails."""
        models = {}
        for name, group_collectives, coalescing in (
            ("grouped", True, False),
            ("one by one", False, False),
            ("coalesced", False, True),
            ("in flight", False, False),
        ):
            with _coalescing() if coalescing else contextlib.nullcontext():
                model = _build(group_collectives)
                model._set_unshard_async_op(True)
                if name == "in flight":
                    for module in fsdp_modules(model):
                        module.set_custom_all_gather(_InFlightAllGather())
                _train(model, self.rank, 5)
            models[name] = model
        for name in ("one by one", "coalesced", "in flight"):
            assert_models_bitwise_equal(
                self, models[name], models["grouped"], f"{name} vs grouped", grads=False
            )


class _CallCountingAllGather(DefaultAllGather):
    """Overrides ``__call__`` (counting, then the default's collective)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CallCountingReduceScatter(DefaultReduceScatter):
    def __init__(self):
        self.calls = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class _OwnMemoryMixin:
    """Overrides ``allocate``; remembers the storage of every tensor it made."""

    def __init__(self):
        self.allocated: list[torch.Tensor] = []

    def allocate(self, size, *, dtype, device):
        self.allocated.append(torch.empty(*size, dtype=dtype, device=device))
        return self.allocated[-1]

    def owns(self, tensor: torch.Tensor) -> bool:
        # Storage identity: a view of an allocated tensor counts
        storage = tensor.untyped_storage()._cdata
        return any(t.untyped_storage()._cdata == storage for t in self.allocated)


# A comm that places its memory itself derives from the interface, whose
# ``foreach`` copies through ``allocate``, not from the default comm, whose
# ``foreach`` hands ``__call__`` FSDP's own tensors
class _OwnMemoryAllGather(_OwnMemoryMixin, AllGather):
    __call__ = DefaultAllGather.__call__


class _OwnMemoryReduceScatter(_OwnMemoryMixin, ReduceScatter):
    __call__ = DefaultReduceScatter.__call__


class _CollectiveTensors(TorchDispatchMode):
    """The all-gather outputs and reduce-scatter inputs of c10d's ops."""

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        if "allgather" in name:
            self.tensors += args[0] if isinstance(args[0], list) else [args[0]]
        elif "reduce_scatter" in name:
            self.tensors += args[1] if isinstance(args[1], list) else [args[1]]
        return func(*args, **(kwargs or {}))


class TestFullyShardCustomCommsOnGloo(FSDPExtTestMultiProcess):
    def test_custom_comms_are_honored(self):
        """Tests that in both collective modes a default
        comm subclass that overrides ``__call__`` is called for every
        collective (one call per parameter per-parameter), and one that
        overrides ``allocate`` gets every all-gather output and reduce-scatter
        input from its ``allocate``, never a parameter's or gradient's own
        storage; either way training is bitwise the default comms'."""
        reference = _build(group_collectives=False)
        _train(reference, self.rank, 2)
        for group_collectives in (False, True):
            with self.subTest(group_collectives=group_collectives, comm="call"):
                model = _build(group_collectives)
                comms = [
                    (_CallCountingAllGather(), _CallCountingReduceScatter())
                    for _ in fsdp_modules(model)
                ]
                for module, (all_gather, reduce_scatter) in zip(
                    fsdp_modules(model), comms, strict=True
                ):
                    module.set_custom_all_gather(all_gather)
                    module.set_custom_reduce_scatter(reduce_scatter)
                _train(model, self.rank, 2)
                assert_models_bitwise_equal(
                    self, model, reference, "__call__ override", grads=False
                )
                for module, (all_gather, reduce_scatter) in zip(
                    fsdp_modules(model), comms, strict=True
                ):
                    # Two steps; the root is gathered once per step, a
                    # block twice (forward, backward); a reduce-scatter
                    # each per step
                    gathers = 2 if module is model else 4
                    per_call = (
                        1
                        if group_collectives
                        else len(list(module.parameters()))
                        - sum(len(list(b.parameters())) for b in getattr(module, "blocks", []))
                    )
                    self.assertEqual(all_gather.calls, gathers * per_call)
                    self.assertEqual(reduce_scatter.calls, 2 * per_call)
            with self.subTest(group_collectives=group_collectives, comm="allocate"):
                model = _build(group_collectives)
                all_gather, reduce_scatter = _OwnMemoryAllGather(), _OwnMemoryReduceScatter()
                for module in fsdp_modules(model):
                    module.set_custom_all_gather(all_gather)
                    module.set_custom_reduce_scatter(reduce_scatter)
                with _CollectiveTensors() as recorded:
                    _train(model, self.rank, 2)
                assert_models_bitwise_equal(
                    self, model, reference, "allocate override", grads=False
                )
                self.assertTrue(recorded.tensors)
                for tensor in recorded.tensors:
                    self.assertTrue(
                        all_gather.owns(tensor) or reduce_scatter.owns(tensor),
                        msg=f"{tuple(tensor.shape)} not from the comm's allocate",
                    )


if __name__ == "__main__":
    run_tests()
