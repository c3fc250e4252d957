# Owner(s): ["oncall: distributed"]

import copy
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo import compiled_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch_fsdp_ext import FSDPModule, fully_shard, MixedPrecisionPolicy
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
    lib as fsdp_lib,
)
from torch_fsdp_ext._fully_shard._fsdp_common import (
    detect_compiled_autograd,
)
from torch_fsdp_ext._fully_shard._fsdp_param_group import (
    FSDPParamGroup,
    PerParamFSDPParamGroup,
)
from torch.distributed.tensor import Shard
from torch_fsdp_ext import DeterministicReduceScatter
from torch.testing._internal.common_fsdp import (
    FSDPTest,
    FSDPTestMultiThread,
    get_devtype,
    MLP,
)
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

device_type = torch.device(get_devtype())
# Parity needs real collectives: one process per accelerator on its default
# backend (NCCL on CUDA), as FSDP2's training tests do, skipped without enough
# accelerators; on CPU, the threaded process group
_ParityTestCase = FSDPTestMultiThread if device_type.type == "cpu" else FSDPTest


class _PairRecordingAllGather(AllGather):
    def __init__(self):
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.input_values: list[torch.Tensor] = []
        self.allocated: list[torch.Tensor] = []

    def allocate(self, size, *, dtype, device):
        self.allocated.append(torch.empty(*size, dtype=dtype, device=device))
        return self.allocated[-1]

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.pairs.append((output_tensor, input_tensor))
        self.input_values.append(input_tensor.clone())
        output_tensor.copy_(torch.arange(output_tensor.numel()))


class _PairRecordingReduceScatter(ReduceScatter):
    def __init__(self):
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocated: list[torch.Tensor] = []

    def allocate(self, size, *, dtype, device):
        self.allocated.append(torch.empty(*size, dtype=dtype, device=device))
        return self.allocated[-1]

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.pairs.append((output_tensor, input_tensor))


class TestFullyShardGroupCollectivesCommAPI(TestCase):
    def setUp(self):
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def test_base_foreach_copies_through_allocate(self):
        """Tests that the base classes' ``foreach`` calls ``__call__`` once per
        pair, in order, on buffers from ``allocate`` (the all-gather input at
        this rank's offset of its output), copies the results out, and returns
        no work."""
        group = dist.distributed_c10d._get_default_group()
        outputs = [torch.zeros(4) for _ in range(3)]
        inputs = [torch.full((2,), float(i + 1)) for i in range(3)]
        all_gather = _PairRecordingAllGather()
        self.assertIsNone(all_gather.foreach(outputs, inputs, group))
        for (output, input), value, ref_input in zip(
            all_gather.pairs, all_gather.input_values, inputs, strict=True
        ):
            self.assertTrue(any(output is t for t in all_gather.allocated))
            self.assertEqual(input.untyped_storage().data_ptr(), output.data_ptr())
            self.assertEqual(input.storage_offset(), 2)
            self.assertEqual(value, ref_input, atol=0, rtol=0)
        for output, (comm_output, _) in zip(outputs, all_gather.pairs, strict=True):
            self.assertEqual(output, comm_output, atol=0, rtol=0)
        reduce_scatter = _PairRecordingReduceScatter()
        self.assertIsNone(
            reduce_scatter.foreach(inputs, outputs, group, dist.ReduceOp.SUM)
        )
        for output, input in reduce_scatter.pairs:
            self.assertTrue(any(output is t for t in reduce_scatter.allocated))
            self.assertTrue(any(input is t for t in reduce_scatter.allocated))
        with self.assertRaises(ValueError):
            all_gather.foreach(outputs, inputs[:2], group)

    def test_default_foreach_passes_fsdp_tensors(self):
        """Tests that the default comms' ``foreach`` hands FSDP's own tensors
        to ``__call__``, once per pair, in order, and returns no work."""
        group = dist.distributed_c10d._get_default_group()
        outputs = [torch.zeros(4) for _ in range(3)]
        inputs = [torch.ones(2) for _ in range(3)]
        for comm, args in (
            (_RecordingDefaultAllGather(), ()),
            (_RecordingDefaultReduceScatter(), (dist.ReduceOp.SUM,)),
        ):
            self.assertIsNone(comm.foreach(outputs, inputs, group, *args))
            self.assertEqual(
                comm.pairs,
                [(id(o), id(i)) for o, i in zip(outputs, inputs, strict=True)],
            )


class _RecordingDefaultAllGather(DefaultAllGather):
    def __init__(self):
        self.pairs: list[tuple[int, int]] = []

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.pairs.append((id(output_tensor), id(input_tensor)))


class _RecordingDefaultReduceScatter(DefaultReduceScatter):
    def __init__(self):
        self.pairs: list[tuple[int, int]] = []

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.pairs.append((id(output_tensor), id(input_tensor)))


_COLLECTIVES = {
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
}
# Ops that copy parameter or gradient data on FSDP's side
_COPIES = {
    "copy_",
    "_foreach_copy_",
    "cat",
    "_chunk_cat",
    "split_with_sizes_copy",
    "_to_copy",
}


class _CommAndCopyRecorder(TorchDispatchMode):
    """Records each collective (phase, kind, input numels) and counts copy ops."""

    def __init__(self):
        super().__init__()
        self.collectives: list[str] = []
        self.copies: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        if func.namespace == "c10d" and name in _COLLECTIVES:
            inputs = args[1] if "coalesced" in name else [args[1]]
            if name.startswith("allreduce"):
                inputs = args[0]
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            numels = "+".join(str(t.numel()) for t in inputs)
            self.collectives.append(f"{phase} {_COLLECTIVES[name]} {numels}")
        # FSDP's own ops, and torch's C++ ``fsdp::chunk_cat_mixed_dtype`` copy-in
        elif func.namespace in (fsdp_lib.ns, "fsdp") or (
            func.namespace == "aten" and name in _COPIES
        ):
            self.copies[name] += 1
        return func(*args, **(kwargs or {}))


class _FakeProcessGroupTestCase(TestCase):
    """Single-process tests over the fake process group at world size 2:
    collectives do not move data, so every recorded op is FSDP's own."""

    world_size = 2

    def setUp(self):
        super().setUp()
        dist.init_process_group(
            "fake", store=FakeStore(), rank=0, world_size=self.world_size
        )

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def _record_step(self, model: nn.Module, inp: torch.Tensor) -> _CommAndCopyRecorder:
        model(inp).sum().backward()  # lazy init outside of the recording
        with _CommAndCopyRecorder() as recorder:
            model(inp).sum().backward()
        return recorder


class TestFullyShardGroupCollectivesInit(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_group_collectives_default_is_grouped(self):
        """Tests that ``group_collectives`` defaults to ``True`` on every parameter group."""
        model = MLP(8)
        fully_shard(model)
        groups = _groups(model)
        self.assertEqual([g.group_collectives for g in groups], [True])

    def test_group_collectives_stored_on_the_param_group(self):
        """Tests that the flag reaches the parameter group."""
        for group_collectives in (False, True):
            torch.manual_seed(42)
            mesh = init_device_mesh(device_type.type, (self.world_size,))
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            fully_shard(model, mesh=mesh, group_collectives=group_collectives)
            groups = _groups(model)
            self.assertEqual(len(groups), 1)
            self.assertIs(groups[0].group_collectives, group_collectives)

    def test_group_collectives_rejects_non_bool(self):
        """Tests that a non-bool ``group_collectives`` raises a ``TypeError``
        naming the value instead of being coerced by truthiness."""
        for bad in ("no", 0, 1, torch.tensor(True)):
            with self.assertRaisesRegex(TypeError, "group_collectives.*bool") as cm:
                fully_shard(MLP(8), group_collectives=bad)
            self.assertIn(repr(bad), str(cm.exception))


def _two_block_model(group_collectives: bool = True, **kwargs) -> nn.Module:
    torch.manual_seed(42)
    model = nn.Sequential(MLP(8), MLP(8))
    for mlp in model:
        fully_shard(mlp, **kwargs)
    fully_shard(model, **kwargs)
    _set_group_collectives(model, group_collectives)
    return model


class TestFullyShardGroupCollectivesUserGradients(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_kept_gradient_unchanged(self):
        """Tests that per-parameter reduce-scatters leave a gradient that the
        user keeps (here from a post-accumulate-grad hook on the unsharded
        parameter) as autograd computed it, also where FSDP divides the
        reduce-scatter input in place before the reduction (an fp16 reduce
        dtype), as grouped mode divides only its own buffer; and that the
        reduced gradients are bitwise grouped mode's."""
        self.run_subtests(
            {
                "mp_policy": [
                    MixedPrecisionPolicy(),
                    MixedPrecisionPolicy(
                        param_dtype=torch.float16, reduce_dtype=torch.float16
                    ),
                ]
            },
            self._test_kept_gradient_unchanged,
        )

    def _test_kept_gradient_unchanged(self, mp_policy: MixedPrecisionPolicy):
        models = _copies_of_two_block_model(8, [False, True], mp_policy=mp_policy)
        torch.manual_seed(42 + self.rank)
        inp = torch.randn(4, 8, device=device_type)
        for model in models:
            model(inp).sum().backward()  # lazy init
            model.zero_grad()
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []

        def keep(param: torch.Tensor) -> None:
            kept.append((param.grad, param.grad.detach().clone()))

        for block in models[0]:
            for fsdp_param in _groups(block)[0].fsdp_params:
                fsdp_param.unsharded_param.register_post_accumulate_grad_hook(keep)
        for model in models:
            model(inp).sum().backward()
        self.assertEqual(len(kept), 8)
        for grad, as_computed in kept:
            self.assertTrue(torch.equal(grad, as_computed))
        for param, ref_param in zip(
            models[0].parameters(), models[1].parameters(), strict=True
        ):
            self.assertTrue(
                torch.equal(param.grad.to_local(), ref_param.grad.to_local())
            )


class TestFullyShardGroupCollectivesReduceScatter(_FakeProcessGroupTestCase):
    def test_reduce_scatter_per_param_without_copies(self):
        """Tests that ``group_collectives=False`` reduce-scatters each gradient
        by itself and, for contiguous, evenly divisible fp32 gradients, reads
        the gradients in place: no ``chunk_cat`` and no other copy."""
        model = _two_block_model(group_collectives=False)
        recorder = self._record_step(model, torch.randn(4, 8, device=device_type))
        reduce_scatters = [c for c in recorder.collectives if "reduce_scatter" in c]
        # in_proj (32, 8) + bias, out_proj (8, 32) + bias, for each of 2 blocks
        self.assertEqual(
            reduce_scatters,
            [
                "backward reduce_scatter 256",
                "backward reduce_scatter 32",
                "backward reduce_scatter 256",
                "backward reduce_scatter 8",
            ]
            * 2,
        )
        self.assertNotIn("chunk_cat", recorder.copies)
        self.assertNotIn("copy_", recorder.copies)

    def test_reduce_scatter_per_param_copies_only_ineligible_grads(self):
        """Tests that a gradient that is not evenly divisible on dim-0, or not
        in the reduce dtype, is copied into a temporary of its own: one copy
        per such gradient, never a group-wide ``chunk_cat``."""
        torch.manual_seed(42)
        # dim-0 of 7 and 3 do not divide by 2; 8 does
        model = nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 3), nn.Linear(3, 8))
        fully_shard(model)
        _set_group_collectives(model, False)
        recorder = self._record_step(model, torch.randn(4, 8, device=device_type))
        self.assertNotIn("chunk_cat", recorder.copies)
        self.assertEqual(recorder.copies["copy_"], 4)

    def test_grouped_reduce_scatter_uses_chunk_cat(self):
        """Tests that grouped mode (the default) keeps one copy-in
        (``fsdp::chunk_cat``) and one reduce-scatter per group."""
        model = _two_block_model()
        recorder = self._record_step(model, torch.randn(4, 8, device=device_type))
        reduce_scatters = [c for c in recorder.collectives if "reduce_scatter" in c]
        self.assertEqual(reduce_scatters, ["backward reduce_scatter 552"] * 2)
        self.assertEqual(recorder.copies["chunk_cat"], 2)


class TestFullyShardGroupCollectivesAllGather(_FakeProcessGroupTestCase):
    def test_all_gather_per_param_without_copies(self):
        """Tests that ``group_collectives=False`` all-gathers each parameter by
        itself straight into its unsharded storage: no ``all_gather_copy_in``,
        no ``split_with_sizes_copy`` and no other copy in forward."""
        model = _two_block_model(group_collectives=False)
        recorder = self._record_step(model, torch.randn(4, 8, device=device_type))
        all_gathers = [c for c in recorder.collectives if "all_gather" in c]
        per_block = [
            "all_gather 128",
            "all_gather 16",
            "all_gather 128",
            "all_gather 4",
        ]
        self.assertEqual(
            all_gathers,
            [
                f"{phase} {c}"
                for phase in ("forward", "backward")
                for c in per_block * 2
            ],
        )
        self.assertEqual(recorder.copies, Counter())

    def test_all_gather_per_param_recreates_outputs_under_compiled_autograd(self):
        """Tests that once FSDP has detected compiled autograd, every all-gather
        builds new all-gather outputs in both modes (grouped's
        ``force_recreate``), also where an eager step left outputs to reuse, so
        that under compile they are created inside the graph instead of
        captured from that step."""
        for group_collectives in (True, False):
            outputs, eager_outputs = self._all_gather_outputs_after_eager_step(
                group_collectives
            )
            self.assertEqual(len(outputs), len(eager_outputs))
            self.assertFalse(
                any(o is e for o, e in zip(outputs, eager_outputs, strict=True)),
                msg=f"group_collectives={group_collectives}",
            )

    def _all_gather_outputs_after_eager_step(
        self, group_collectives: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Returns the first block's all-gather outputs of a forward run after
        FSDP detected compiled autograd, and those an eager step left."""
        model = _two_block_model(group_collectives=group_collectives)
        inp = torch.randn(4, 8, device=device_type)
        model(inp).sum().backward()  # eager: the outputs are kept
        fsdp_params = model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params
        eager_outputs = [p.all_gather_outputs[0] for p in fsdp_params]
        outputs: list[torch.Tensor] = []
        handle = model[0].in_proj.register_forward_pre_hook(
            lambda *_: outputs.extend(p.all_gather_outputs[0] for p in fsdp_params)
        )
        # What the lazy init of a root that first runs under compiled autograd
        # does (the flag is per process, e.g. set by another model's root)
        with compiled_autograd._enable(lambda gm: gm):
            detect_compiled_autograd()
        try:
            with torch.no_grad():
                model(inp)
        finally:
            detect_compiled_autograd()
            handle.remove()
        return outputs, eager_outputs

    def test_all_gather_per_param_casts_per_param(self):
        """Tests that with ``param_dtype`` each parameter is cast by itself
        (one copy each) into an all-gather input of its own, and gathered in
        that dtype."""
        torch.manual_seed(42)
        model = MLP(8)
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        fully_shard(model, mp_policy=mp_policy)
        _set_group_collectives(model, False)
        recorder = self._record_step(model, torch.randn(4, 8, device=device_type))
        self.assertNotIn("all_gather_copy_in", recorder.copies)
        self.assertNotIn("_foreach_copy_", recorder.copies)
        # The forward input cast and 4 parameter casts to bf16 (``_to_copy``;
        # the root all-gathers once), then the 4 bf16 gradients, each cast
        # into its own fp32 reduce-scatter input (``copy_``), with no cast
        # after
        self.assertEqual(recorder.copies, Counter({"_to_copy": 5, "copy_": 4}))

    def test_all_gather_per_param_storage_freed_at_reshard(self):
        """Tests that the per-parameter path frees a block's unsharded storage
        at its reshard, in forward and backward, and that every
        ``_to_sharded*()`` caller reaches the per-parameter group's own,
        which orders the storage's reuse after the current stream."""
        model = _two_block_model(group_collectives=False)
        inp = torch.randn(4, 8, device=device_type)
        model(inp).sum().backward()  # lazy init
        group = _groups(model[0])[0]
        self.assertIsInstance(group, PerParamFSDPParamGroup)
        for name in ("_to_sharded", "_to_sharded_post_forward"):
            self.assertIsNot(getattr(type(group), name), getattr(FSDPParamGroup, name))

        def allocated(block: nn.Module) -> list[bool]:
            return [
                t.untyped_storage().size() > 0
                for fsdp_param in _groups(block)[0].fsdp_params
                for t in fsdp_param.all_gather_outputs
            ]

        seen = {}

        def record(*_) -> None:
            seen["after block 0 forward"] = allocated(model[0])

        model[0].register_forward_hook(record)
        out = model(inp)
        self.assertEqual(seen["after block 0 forward"], [False] * 4)
        self.assertEqual(allocated(model[1]), [False] * 4)
        out.sum().backward()
        self.assertEqual(allocated(model[0]) + allocated(model[1]), [False] * 8)

    def test_trace_two_blocks(self):
        """Tests the exact collective sequence of one training step of a
        two-block model in both modes."""
        traces = {}
        for group_collectives in (True, False):
            model = _two_block_model(group_collectives=group_collectives)
            recorder = self._record_step(model, torch.randn(4, 8, device=device_type))
            traces[group_collectives] = "\n".join(recorder.collectives)
        self.assertExpectedInline(
            traces[True],
            """\
forward all_gather 276
forward all_gather 276
backward all_gather 276
backward all_gather 276
backward reduce_scatter 552
backward reduce_scatter 552""",
        )
        self.assertExpectedInline(
            traces[False],
            """\
forward all_gather 128
forward all_gather 16
forward all_gather 128
forward all_gather 4
forward all_gather 128
forward all_gather 16
forward all_gather 128
forward all_gather 4
backward all_gather 128
backward all_gather 16
backward all_gather 128
backward all_gather 4
backward all_gather 128
backward all_gather 16
backward all_gather 128
backward all_gather 4
backward reduce_scatter 256
backward reduce_scatter 32
backward reduce_scatter 256
backward reduce_scatter 8
backward reduce_scatter 256
backward reduce_scatter 32
backward reduce_scatter 256
backward reduce_scatter 8""",
        )


class _TwiceCalledBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.block = MLP(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(x)))


class TestFullyShardGroupCollectivesRepeatedBlock(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_block_called_twice_in_forward(self):
        """Tests that a block run twice in one forward, whose unsharded
        storages are still held from its first reshard when it all-gathers
        again, trains bitwise as in grouped mode."""
        torch.manual_seed(42)
        base = _TwiceCalledBlock(8)
        models = []
        for group_collectives in (False, True):
            model = copy.deepcopy(base)
            fully_shard(model.block)
            fully_shard(model)
            _set_group_collectives(model, group_collectives)
            models.append(model)
        _train_and_compare(self, models, 8)


class _WorkList(dist.Work):
    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self.works = works

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait()
        return True


class _BatchingAllGather(DefaultAllGather):
    """Issues a group's all-gathers asynchronously and, for ``async_op``,
    returns one work for all of them, as a backend that batches them may:
    the all-gathers are in flight until the copy-out waits on it."""

    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        work = _WorkList(
            [
                dist.all_gather_into_tensor(output, inp, group, async_op=True)
                for output, inp in zip(output_tensors, input_tensors, strict=True)
            ]
        )
        if async_op:
            return work
        work.wait()
        return None


class TestFullyShardGroupCollectivesAsyncUnshard(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_unshard_async_op_matches_grouped(self):
        """Tests that per-parameter ``unshard(async_op=True)`` gathers the same
        bits as grouped mode and leaves the unsharded parameters' version
        counters as they were before the unshard once waited on (autograd may
        have saved the parameters), with the default comm and with one that
        returns its all-gathers in flight."""
        self.run_subtests(
            {"comm_cls": [None, _BatchingAllGather]},
            self._test_unshard_async_op_matches_grouped,
        )

    def _test_unshard_async_op_matches_grouped(self, comm_cls):
        models = _copies_of_two_block_model(8, [False, True])
        if comm_cls is not None:
            for module in (*models[0], models[0]):
                module.set_custom_all_gather(comm_cls())
        torch.manual_seed(42 + self.rank)
        inp = torch.randn(4, 8, device=device_type)
        unsharded = []
        for model in models:
            model(inp).sum().backward()  # lazy init
            for block in model:
                fsdp_params = _groups(block)[0].fsdp_params
                versions = [p.unsharded_param._version for p in fsdp_params]
                handle = block.unshard(async_op=True)
                handle.wait()
                self.assertEqual(
                    [p.unsharded_param._version for p in fsdp_params], versions
                )
                unsharded.append(
                    [p.unsharded_param.detach().clone() for p in fsdp_params]
                )
                block.reshard()
        num_blocks = len(models[0])
        for params, ref_params in zip(
            unsharded[:num_blocks], unsharded[num_blocks:], strict=True
        ):
            for param, ref_param in zip(params, ref_params, strict=True):
                self.assertTrue(torch.equal(param, ref_param))

    def test_set_unshard_async_op_matches_grouped(self):
        """Tests that with ``_set_unshard_async_op(True)`` per-parameter
        all-gathers train bitwise as grouped ones, with the default comm and
        with one that returns its all-gathers in flight. Resharding after
        forward, backward all-gathers again into the parameters that autograd
        saved in forward, so their version counters must not change."""
        self.run_subtests(
            {
                "comm_cls": [None, _BatchingAllGather],
                "reshard_after_forward": [True, False],
            },
            self._test_set_unshard_async_op_matches_grouped,
        )

    def _test_set_unshard_async_op_matches_grouped(
        self, comm_cls, reshard_after_forward: bool
    ):
        models = _copies_of_two_block_model(
            8, [False, True], reshard_after_forward=reshard_after_forward
        )
        for model in models:
            model._set_unshard_async_op(True)
        if comm_cls is not None:
            for module in (*models[0], models[0]):
                module.set_custom_all_gather(comm_cls())
        _train_and_compare(self, models, 8)


class TestFullyShardGroupCollectivesParity(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_per_param_matches_grouped(self):
        """Tests that per-parameter collectives give bitwise-equal losses,
        sharded parameters and sharded gradients to grouped ones."""
        self.run_subtests(
            {
                "mp_policy": [
                    MixedPrecisionPolicy(),
                    MixedPrecisionPolicy(
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                    ),
                ],
                "dim": [8, 7],  # evenly and unevenly sharded
                "reshard_after_forward": [True, False],
            },
            self._test_per_param_matches_grouped,
        )

    def _test_per_param_matches_grouped(
        self, mp_policy: MixedPrecisionPolicy, dim: int, reshard_after_forward: bool
    ):
        models = _copies_of_two_block_model(
            dim,
            [False, True],
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
        )
        _train_and_compare(self, models, dim)

    def test_all_gather_comm_through_allocate(self):
        """Tests that a custom all-gather comm that defines only ``allocate``
        and ``__call__`` gets every output from its own ``allocate`` (the base
        ``foreach`` copies out after), in ``Shard(0)`` and ``Shard(1)``, with
        bitwise the same training as the default comm."""
        self.run_subtests(
            {"placement": [Shard(0), Shard(1)]},
            self._test_all_gather_comm_through_allocate,
        )

    def _test_all_gather_comm_through_allocate(self, placement: Shard):
        comm = _AllocatingAllGather()
        models = _copies_of_two_block_model(
            8,
            [False, False],
            shard_placement_fn=lambda p: placement if p.ndim == 2 else None,
        )
        for module in (*models[0], models[0]):
            module.set_custom_all_gather(comm)
        _train_and_compare(self, models, 8)
        self.assertTrue(comm.output_data_ptrs)
        allocated = {t.data_ptr() for t in comm.allocated}
        self.assertLessEqual(set(comm.output_data_ptrs), allocated)

    def test_foreach_gets_tensors_of_their_own(self):
        """Tests that ``foreach`` gets each cast parameter as an all-gather
        input apart from its output, and reduce-scatter outputs that view no
        buffer (no all-reduce follows), with bitwise the same training as the
        default comms: what a backend whose tensors are values (XLA) needs."""
        self.run_subtests({"dim": [8, 7]}, self._test_foreach_gets_tensors_of_their_own)

    def _test_foreach_gets_tensors_of_their_own(self, dim: int):
        all_gather, reduce_scatter = _OwnInputsAllGather(), _OwnOutputsReduceScatter()
        models = _copies_of_two_block_model(
            dim,
            [False, False],
            mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
        )
        for module in (*models[0], models[0]):
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        _train_and_compare(self, models, dim)
        for own in (all_gather.own_inputs, reduce_scatter.own_outputs):
            self.assertTrue(own)
            self.assertTrue(all(own))


class _OwnInputsAllGather(DefaultAllGather):
    """Records whether each input is a bf16 tensor apart from its output."""

    def __init__(self):
        self.own_inputs: list[bool] = []

    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        self.own_inputs.extend(
            i.dtype == torch.bfloat16
            and i.untyped_storage().data_ptr() != o.untyped_storage().data_ptr()
            for o, i in zip(output_tensors, input_tensors, strict=True)
        )
        return super().foreach(output_tensors, input_tensors, group, async_op)


class _OwnOutputsReduceScatter(DefaultReduceScatter):
    """Records whether each output is a tensor of its own, not a view."""

    def __init__(self):
        self.own_outputs: list[bool] = []

    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        self.own_outputs.extend(o._base is None for o in output_tensors)
        return super().foreach(output_tensors, input_tensors, group, op, async_op)


class _AllocatingAllGather(AllGather):
    """Records the output of each call and keeps every buffer it allocates."""

    def __init__(self):
        self.allocated: list[torch.Tensor] = []
        self.output_data_ptrs: list[int] = []

    def allocate(self, size, *, dtype, device):
        self.allocated.append(torch.empty(*size, dtype=dtype, device=device))
        return self.allocated[-1]

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.output_data_ptrs.append(output_tensor.data_ptr())
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class TestFullyShardGroupCollectivesRuntimeSwitch(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_set_group_collectives_between_iterations(self):
        """Tests that switching ``set_group_collectives`` every iteration
        keeps bitwise parity with a model that always groups, and that the
        switch reaches every parameter group (``recurse=True``) or only the
        module's own (``recurse=False``)."""
        models = _copies_of_two_block_model(8, [True, True])
        model = models[0]

        def before_step(step: int):
            model.set_group_collectives(step % 2 == 1)
            flags = {g.group_collectives for m in (*model, model) for g in _groups(m)}
            self.assertEqual(flags, {step % 2 == 1})

        _train_and_compare(self, models, 8, before_step=before_step)
        model.set_group_collectives(False, recurse=False)
        self.assertEqual(
            [g.group_collectives for g in _groups(model)], [False] * len(_groups(model))
        )
        self.assertEqual([g.group_collectives for g in _groups(model[0])], [True])

    def test_set_group_collectives_rejects_non_bool(self):
        """Tests that ``set_group_collectives`` raises a ``TypeError`` for a
        non-bool and leaves the flag unchanged."""
        model = MLP(8)
        fully_shard(model)
        with self.assertRaisesRegex(
            TypeError, "group_collectives must be a bool but got 'no'"
        ):
            model.set_group_collectives("no")
        self.assertTrue(_groups(model)[0].group_collectives)


class TestFullyShardGroupCollectivesRuntimeSwitchHSDP(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 4

    def test_set_group_collectives_with_pending_partial_reduce(self):
        """Tests that switching modes while an HSDP partial reduction
        (``set_requires_all_reduce(False)``) is pending gives the same
        gradients as staying in one mode: both modes lay out the partial
        reduce output the same way."""
        mesh = init_device_mesh(
            device_type.type, (2, 2), mesh_dim_names=("replicate", "shard")
        )
        torch.manual_seed(42)
        base = MLP(8)
        models = [copy.deepcopy(base) for _ in range(2)]
        for model in models:
            fully_shard(model, mesh=mesh)
        torch.manual_seed(42 + self.rank)
        inps = [torch.randn(4, 8, device=device_type) for _ in range(2)]
        for model, switch_to in zip(models, (False, None), strict=True):
            model.set_requires_all_reduce(False)
            model(inps[0]).sum().backward()
            if switch_to is not None:
                model.set_group_collectives(switch_to)
            model.set_requires_all_reduce(True)
            model(inps[1]).sum().backward()
        self.assertFalse(_groups(models[0])[0].group_collectives)
        for param, ref_param in zip(
            models[0].parameters(), models[1].parameters(), strict=True
        ):
            self.assertTrue(
                torch.equal(param.grad.to_local(), ref_param.grad.to_local())
            )


class TestFullyShardDeterministicReduceScatter(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 4

    def test_sums_in_rank_order(self):
        """Tests that each output element is the rank-order sum ``x_0 + x_1 +
        ... + x_{W-1}`` of that element's inputs, for SUM, AVG and PREMUL_SUM,
        and for a chunk size that packs differently than one tensor."""
        self.run_subtests(
            {
                "op": [
                    dist.ReduceOp.SUM,
                    dist.ReduceOp.AVG,
                    dist._make_nccl_premul_sum(0.3),
                ],
                "dtype": [torch.float32, torch.bfloat16],
            },
            self._test_sums_in_rank_order,
        )

    def _test_sums_in_rank_order(self, op, dtype: torch.dtype):
        group = dist.distributed_c10d._get_default_group()
        torch.manual_seed(42 + self.rank)
        inp = torch.randn(self.world_size * 37, dtype=dtype, device=device_type)
        out = torch.empty(37, dtype=dtype, device=device_type)
        self.assertIsNone(DeterministicReduceScatter()(out, inp.clone(), group, op))
        gathered = torch.empty(
            self.world_size * inp.numel(), dtype=dtype, device=device_type
        )
        dist.all_gather_into_tensor(gathered, inp, group=group)
        chunks = gathered.view(self.world_size, self.world_size, -1)[:, self.rank]
        if getattr(op, "op", op) == dist.ReduceOp.PREMUL_SUM:
            chunks = chunks * op.__getstate__()[1]  # (op type, factor)
        expected = chunks[0].clone()
        for chunk in chunks[1:]:
            expected += chunk
        if op == dist.ReduceOp.AVG:
            expected /= self.world_size
        self.assertEqual(out, expected, atol=0, rtol=0)

    def test_rejects_unsupported_op(self):
        """Tests that ops other than SUM, AVG and PREMUL_SUM raise."""
        group = dist.distributed_c10d._get_default_group()
        with self.assertRaisesRegex(
            NotImplementedError, "supports SUM, AVG and PREMUL_SUM"
        ):
            DeterministicReduceScatter()(
                torch.empty(2), torch.zeros(8), group, dist.ReduceOp.MAX
            )

    def test_rejects_input_not_divisible_by_world_size(self):
        """Tests that an input that does not split into one chunk per rank
        raises naming both sizes, instead of a failed reshape."""
        group = dist.distributed_c10d._get_default_group()
        with self.assertRaisesRegex(ValueError, "input of 5 elements.*world size 4"):
            DeterministicReduceScatter()(
                torch.empty(1), torch.zeros(5), group, dist.ReduceOp.SUM
            )

    def test_per_param_matches_grouped(self):
        """Tests that with ``DeterministicReduceScatter`` on both sides,
        per-parameter and grouped reduce-scatters give bitwise-equal training
        at world size 4, with uneven sharding and a divide factor."""
        models = _copies_of_two_block_model(7, [False, True])
        for model in models:
            for module in (*model, model):
                module.set_custom_reduce_scatter(DeterministicReduceScatter())
                module.set_gradient_divide_factor(3.0)
        _train_and_compare(self, models, 7)


def _groups(module: nn.Module) -> list:
    # One parameter group per ``fully_shard`` call (no per-parameter meshes)
    group = module._get_fsdp_state()._fsdp_param_group
    return [] if group is None else [group]


def _set_group_collectives(model: nn.Module, group_collectives: bool) -> None:
    """Sets whether every parameter group of ``model`` groups its collectives."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in _groups(module):
                group._set_group_collectives(group_collectives)


def _copies_of_two_block_model(
    dim: int, group_collectives: list[bool], **kwargs
) -> list[nn.Module]:
    """Identically initialized two-block models, one per ``group_collectives``
    value, sharded with ``kwargs``."""
    torch.manual_seed(42)
    base = nn.Sequential(MLP(dim), MLP(dim))
    models = []
    for model_group_collectives in group_collectives:
        model = copy.deepcopy(base)
        for module in (*model, model):
            fully_shard(module, **kwargs)
        _set_group_collectives(model, model_group_collectives)
        models.append(model)
    return models


def _train_and_compare(
    test: TestCase, models: list[nn.Module], dim: int, before_step=lambda step: None
) -> None:
    """Trains ``models`` in lockstep for 4 steps and requires bitwise-equal
    losses, sharded gradients and sharded parameters to ``models[-1]``."""
    optims = [torch.optim.Adam(model.parameters(), lr=1e-2) for model in models]
    torch.manual_seed(42 + test.rank)
    for step in range(4):
        before_step(step)
        inp = torch.randn(4, dim, device=device_type)
        losses = [model(inp).sum() for model in models]
        for loss in losses:
            loss.backward()
        for loss in losses[:-1]:
            test.assertEqual(loss, losses[-1], atol=0, rtol=0)
        params = [list(model.parameters()) for model in models]
        for model_params in params[:-1]:
            for param, ref_param in zip(model_params, params[-1], strict=True):
                test.assertEqual(
                    param.grad.to_local(), ref_param.grad.to_local(), atol=0, rtol=0
                )
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)
        for model_params in params[:-1]:
            for param, ref_param in zip(model_params, params[-1], strict=True):
                test.assertEqual(param.to_local(), ref_param.to_local(), atol=0, rtol=0)


if __name__ == "__main__":
    run_tests()
