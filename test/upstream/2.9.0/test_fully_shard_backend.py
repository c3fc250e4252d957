# Owner(s): ["oncall: distributed"]

import contextlib
import warnings
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch_fsdp_ext import (
    FSDPBackend,
    FSDPModule,
    fully_shard,
    get_fsdp_backend,
    register_fsdp_backend,
    unregister_fsdp_backend,
)
from torch_fsdp_ext._fully_shard import _fsdp_collectives
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
    lib as fsdp_lib,
)
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_fsdp import get_devtype, MLP
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

device_type = torch.device(get_devtype())


@contextlib.contextmanager
def _registered(device_type: str, backend: FSDPBackend) -> Iterator[None]:
    """Registers ``backend`` for the duration, then restores the previous one."""
    previous = get_fsdp_backend(device_type)
    register_fsdp_backend(device_type, backend, override=True)
    try:
        yield
    finally:
        unregister_fsdp_backend(device_type)
        if previous is not None:
            register_fsdp_backend(device_type, previous)


class RecordingAllGather(AllGather):
    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class RecordingReduceScatter(ReduceScatter):
    """Records the storage of each input and every allocation it makes (and
    keeps the allocated tensors, so that no two share an address)."""

    def __init__(self):
        self.input_data_ptrs: list[int] = []
        self.allocations: list[torch.Size] = []
        self.allocated: list[torch.Tensor] = []

    def allocate(self, size, *, dtype, device):
        self.allocations.append(torch.Size(size))
        self.allocated.append(torch.empty(*size, dtype=dtype, device=device))
        return self.allocated[-1]

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.input_data_ptrs.append(input_tensor.data_ptr())
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op, group, async_op
        )


class GradientReadingReduceScatter(RecordingReduceScatter):
    """Takes FSDP's tensors: its ``foreach`` skips the copy through
    ``allocate``."""

    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        for output_tensor, input_tensor in zip(
            output_tensors, input_tensors, strict=True
        ):
            self(output_tensor, input_tensor, group, op)


class ForeachAllGather(RecordingAllGather):
    """Records the pairs of each ``foreach`` call; the base issues them."""

    def __init__(self):
        super().__init__()
        self.foreach_pairs: list[int] = []

    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        self.foreach_pairs.append(len(output_tensors))
        return super().foreach(output_tensors, input_tensors, group, async_op)


class ForeachReduceScatter(RecordingReduceScatter):
    def __init__(self):
        super().__init__()
        self.foreach_pairs: list[int] = []

    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        self.foreach_pairs.append(len(output_tensors))
        return super().foreach(output_tensors, input_tensors, group, op, async_op)


class TestFullyShardBackendRegistry(TestCase):
    def test_register_and_unregister(self):
        """Tests that a registered backend is returned for its device type and
        that unregistering restores the previous state."""
        self.assertIsNone(get_fsdp_backend("meta"))
        backend = FSDPBackend(group_collectives=False)
        register_fsdp_backend("meta", backend)
        try:
            self.assertIs(get_fsdp_backend("meta"), backend)
        finally:
            self.assertIs(unregister_fsdp_backend("meta"), backend)
        self.assertIsNone(get_fsdp_backend("meta"))

    def test_register_twice_raises(self):
        """Tests that registering a device type twice names the fix, and that
        ``override=True`` replaces the backend."""
        with _registered("meta", FSDPBackend()):
            with self.assertRaisesRegex(
                RuntimeError, "already registered for 'meta'.*override=True"
            ):
                register_fsdp_backend("meta", FSDPBackend())
            replacement = FSDPBackend(force_sum_reduction_for_comms=True)
            register_fsdp_backend("meta", replacement, override=True)
            self.assertIs(get_fsdp_backend("meta"), replacement)

    def test_bad_input_raises(self):
        """Tests clear errors for an unknown device type, a device with an
        index, a non-backend, bad field values and unregistering an unknown
        device type."""
        with self.assertRaisesRegex(ValueError, "Unknown device type 'not_a_device'"):
            register_fsdp_backend("not_a_device", FSDPBackend())
        with self.assertRaisesRegex(ValueError, "without index"):
            register_fsdp_backend("cpu:0", FSDPBackend())
        with self.assertRaisesRegex(TypeError, "Expected an FSDPBackend"):
            register_fsdp_backend("meta", {"group_collectives": False})
        with self.assertRaisesRegex(
            TypeError, "group_collectives must be a bool or None"
        ):
            FSDPBackend(group_collectives="no")
        with self.assertRaisesRegex(
            TypeError, "force_sum_reduction_for_comms must be a bool but got 'no'"
        ):
            FSDPBackend(force_sum_reduction_for_comms="no")
        with self.assertRaisesRegex(
            TypeError, "reduce_scatter_comm must be a zero-argument"
        ):
            FSDPBackend(reduce_scatter_comm=DefaultReduceScatter())
        with self.assertRaisesRegex(
            ValueError, "No FSDP backend is registered for 'meta'"
        ):
            unregister_fsdp_backend("meta")


class TestFullyShardBackendDefaults(TestCase):
    """Single process over the fake process group: checks what FSDP hands a
    backend, not the numerics."""

    def setUp(self):
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def test_group_collectives_resolves_from_backend(self):
        """Tests that ``group_collectives=None`` takes the backend's default,
        that an explicit value wins, and that it is ``True`` without one."""
        with _registered(device_type.type, FSDPBackend(group_collectives=False)):
            for explicit, expected in ((None, False), (True, True), (False, False)):
                model = fully_shard(MLP(8), group_collectives=explicit)
                groups = [model._get_fsdp_state()._fsdp_param_group]
                self.assertEqual([g.group_collectives for g in groups], [expected])
        with _registered(device_type.type, FSDPBackend()):
            model = fully_shard(MLP(8))
            self.assertTrue(model._get_fsdp_state()._fsdp_param_group.group_collectives)

    def test_backend_comms_are_group_defaults(self):
        """Tests that each parameter group gets its own comm from the
        backend's factories, that ``set_custom_*`` still overrides them, and
        that unregistering restores the default comms."""
        backend = FSDPBackend(
            all_gather_comm=RecordingAllGather,
            reduce_scatter_comm=RecordingReduceScatter,
        )
        with _registered(device_type.type, backend):
            model = nn.Sequential(MLP(8), MLP(8))
            fully_shard(model[0])
            fully_shard(model)
            groups = [m._get_fsdp_state()._fsdp_param_group for m in (model[0], model)]
            for group in groups:
                self.assertIsInstance(group._all_gather_comm, RecordingAllGather)
                self.assertIsInstance(
                    group._reduce_scatter_comm, RecordingReduceScatter
                )
            self.assertIsNot(
                groups[0]._reduce_scatter_comm, groups[1]._reduce_scatter_comm
            )
            model.set_custom_reduce_scatter(DefaultReduceScatter())
            self.assertIsInstance(groups[1]._reduce_scatter_comm, DefaultReduceScatter)
        group = fully_shard(MLP(8))._get_fsdp_state()._fsdp_param_group
        self.assertIsInstance(group._all_gather_comm, DefaultAllGather)
        self.assertIsInstance(group._reduce_scatter_comm, DefaultReduceScatter)

    def test_comm_factory_returning_no_comm_raises_at_fully_shard(self):
        """Tests that a backend comm factory that returns something other than a
        comm fails at ``fully_shard`` time, naming the device type and the
        value, instead of in the first collective."""
        for name, comm_type in (
            ("all_gather_comm", "AllGather"),
            ("reduce_scatter_comm", "ReduceScatter"),
        ):
            with _registered(device_type.type, FSDPBackend(**{name: lambda: 42})):
                with self.assertRaisesRegex(
                    TypeError,
                    f"for {device_type.type!r} made 42 of type int, which is not a {comm_type}",
                ):
                    fully_shard(MLP(8))

    @parametrize("comm_cls", [GradientReadingReduceScatter, RecordingReduceScatter])
    def test_backend_comm_gets_gradients_themselves(
        self, comm_cls: type[ReduceScatter]
    ):
        """Tests that in per-parameter mode a backend's reduce-scatter whose
        ``foreach`` takes FSDP's tensors receives each gradient computed by
        autograd itself (same storage), and that one that defines only
        ``allocate`` and ``__call__`` receives none of them."""
        backend = FSDPBackend(
            group_collectives=False,
            all_gather_comm=RecordingAllGather,
            reduce_scatter_comm=comm_cls,
        )
        with _registered(device_type.type, backend):
            torch.manual_seed(42)
            model = fully_shard(MLP(8))
            inp = torch.randn(4, 8, device=device_type)
            model(inp).sum().backward()  # lazy init
            grad_data_ptrs = []
            fsdp_params = model._get_fsdp_state()._fsdp_param_group.fsdp_params
            for fsdp_param in fsdp_params:
                fsdp_param.unsharded_param.register_hook(
                    lambda grad: grad_data_ptrs.append(grad.data_ptr())
                )
            comm = model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
            comm.input_data_ptrs.clear()
            model(inp).sum().backward()
            self.assertEqual(len(comm.input_data_ptrs), len(fsdp_params))
            if comm_cls is GradientReadingReduceScatter:
                self.assertEqual(sorted(comm.input_data_ptrs), sorted(grad_data_ptrs))
            else:
                allocated = {t.data_ptr() for t in comm.allocated}
                self.assertLessEqual(set(comm.input_data_ptrs), allocated)

    def test_backend_comm_owns_allocation(self):
        """Tests that a backend comm that defines only ``allocate`` and
        ``__call__`` is called on tensors from its ``allocate`` only: the base
        ``foreach`` copies every per-parameter input and output through it."""
        with _registered(
            device_type.type, FSDPBackend(reduce_scatter_comm=RecordingReduceScatter)
        ):
            torch.manual_seed(42)
            model = fully_shard(nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 8)))
            model.set_group_collectives(False)
            comm = model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
            model(torch.randn(4, 8, device=device_type)).sum().backward()
        # Inputs: (7, 8) and (7,) padded to (8, 8) and (8,), (8, 7) and (8,);
        # outputs: half of each
        self.assertEqual(
            sorted(comm.allocations, key=lambda s: s.numel()),
            [(4,), (4,), (8,), (8,), (28,), (32,), (56,), (64,)],
        )
        self.assertLessEqual(
            set(comm.input_data_ptrs), {t.data_ptr() for t in comm.allocated}
        )

    def test_grouped_buffer_from_backend_allocate(self):
        """Tests that in grouped mode the backend's comm allocates the
        group-wide reduce-scatter input (the ``chunk_cat`` buffer) and output."""
        with _registered(
            device_type.type, FSDPBackend(reduce_scatter_comm=RecordingReduceScatter)
        ):
            torch.manual_seed(42)
            model = fully_shard(MLP(8))
            comm = model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
            model(torch.randn(4, 8, device=device_type)).sum().backward()
        # 552 unsharded gradient elements in, 276 per rank out
        self.assertEqual(comm.allocations, [(552,), (276,)])
        self.assertEqual(len(comm.input_data_ptrs), 1)

    def test_grouped_copy_in_overridable_per_dispatch_key(self):
        """Tests that a backend can replace the grouped copy-in by registering
        its own kernel of the copy-in op (``fsdp::chunk_cat``) for its
        dispatch key (CPU here,
        PrivateUse1 for an out-of-tree device), and that destroying the
        registration restores the default kernel."""
        calls = []

        def chunk_cat(tensors, dim, num_chunks, *, out):
            calls.append(len(tensors))
            torch._chunk_cat(tensors, dim, num_chunks, out=out)

        model = fully_shard(MLP(8))
        with torch.library._scoped_library(fsdp_lib.ns, "IMPL") as lib:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Warning only once for all operators")
                warnings.filterwarnings(
                    "ignore", "Overriding a previously registered kernel"
                )
                # FSDP registers its own Python kernel for the key
                lib.impl(
                    "chunk_cat",
                    chunk_cat,
                    device_type.type.upper(),
                    allow_override=True,
                )
            model(torch.randn(4, 8, device=device_type)).sum().backward()
        self.assertEqual(calls, [4])
        model(torch.randn(4, 8, device=device_type)).sum().backward()
        self.assertEqual(calls, [4])

    def test_backend_force_sum_reduction_is_group_default(self):
        """Tests that a backend's ``force_sum_reduction_for_comms`` is each
        parameter group's default, which
        ``set_force_sum_reduction_for_comms`` still overrides."""
        backend = FSDPBackend(force_sum_reduction_for_comms=True)
        with _registered(device_type.type, backend):
            model = fully_shard(MLP(8))
            group = model._get_fsdp_state()._fsdp_param_group
            self.assertTrue(group.force_sum_reduction_for_comms)
            model.set_force_sum_reduction_for_comms(False)
            self.assertFalse(group.force_sum_reduction_for_comms)
        group = fully_shard(MLP(8))._get_fsdp_state()._fsdp_param_group
        self.assertFalse(group.force_sum_reduction_for_comms)

    def test_grouped_collectives_call_the_comm_directly(self):
        """Tests that grouped, each group's all-gather and reduce-scatter comms
        are called directly, as without per-parameter collectives, with one
        reduce-scatter input (the flat buffer), and never through
        ``foreach``."""
        torch.manual_seed(42)
        model = nn.Sequential(MLP(8), MLP(8))
        comms = []
        for mlp in model:
            fully_shard(mlp)
            comms.append((ForeachAllGather(), ForeachReduceScatter()))
            mlp.set_custom_all_gather(comms[-1][0])
            mlp.set_custom_reduce_scatter(comms[-1][1])
        fully_shard(model)
        model(torch.randn(4, 8, device=device_type)).sum().backward()
        for all_gather, reduce_scatter in comms:
            self.assertEqual(all_gather.foreach_pairs, [])
            self.assertEqual(all_gather.calls, 2)
            self.assertEqual(reduce_scatter.foreach_pairs, [])
            self.assertEqual(len(reduce_scatter.input_data_ptrs), 1)

    def test_per_param_reduce_scatter_is_one_foreach_call(self):
        """Tests that per parameter each group's reduce-scatter comm gets one
        ``foreach`` call with a pair per parameter, and that the default
        ``foreach`` calls ``__call__`` once per pair."""
        for _, reduce_scatter in _per_param_two_blocks_with_foreach_comms():
            self.assertEqual(reduce_scatter.foreach_pairs, [4])
            self.assertEqual(len(reduce_scatter.input_data_ptrs), 4)

    def test_per_param_all_gather_is_one_foreach_call(self):
        """Tests that per parameter each group's all-gather comm gets one
        ``foreach`` call per all-gather with a pair per parameter (forward,
        and backward after resharding; 4 parameters)."""
        for all_gather, _ in _per_param_two_blocks_with_foreach_comms():
            self.assertEqual(all_gather.foreach_pairs, [4, 4])
            self.assertEqual(all_gather.calls, 8)


def _per_param_two_blocks_with_foreach_comms() -> list[
    tuple[ForeachAllGather, ForeachReduceScatter]
]:
    """Trains one step of two blocks with per-parameter collectives whose comms
    record their ``foreach`` calls; returns each block's comms."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(8), MLP(8))
    comms = []
    for mlp in model:
        fully_shard(mlp)
        comms.append((ForeachAllGather(), ForeachReduceScatter()))
        mlp.set_custom_all_gather(comms[-1][0])
        mlp.set_custom_reduce_scatter(comms[-1][1])
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # One parameter group per ``fully_shard`` call, none without
            # parameters of its own
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                group._set_group_collectives(False)
    model(torch.randn(4, 8, device=device_type)).sum().backward()
    return comms


def _OwnCall(comm_cls: type) -> type:
    """A subclass of ``comm_cls`` whose ``__call__`` is its own (the base's)."""

    def __call__(self, *args, **kwargs):
        return comm_cls.__call__(self, *args, **kwargs)

    return type(f"OwnCall{comm_cls.__name__}", (comm_cls,), {"__call__": __call__})


def _OneByOne(comm_cls: type) -> type:
    """A subclass of ``comm_cls`` with the base interface's one-by-one
    ``foreach``."""
    base = AllGather if issubclass(comm_cls, AllGather) else ReduceScatter
    return type(f"OneByOne{comm_cls.__name__}", (comm_cls,), {"foreach": base.foreach})


class TestFullyShardBackendCoalescing(TestCase):
    """Single process over the fake process group, whose c10d backend does
    not report coalescing: ``_coalesces`` is patched to stand in for one that
    does (NCCL)."""

    def setUp(self):
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def _foreach(self, comm, num_pairs: int, coalesces: bool, async_op: bool):
        """Calls ``comm.foreach`` on ``num_pairs`` pairs; returns its work and
        the c10d ops it issued."""
        group = dist.group.WORLD
        shards = [torch.ones(2, device=device_type) for _ in range(num_pairs)]
        unsharded = [torch.empty(4, device=device_type) for _ in range(num_pairs)]
        with (
            mock.patch.object(_fsdp_collectives, "_coalesces", return_value=coalesces),
            CommDebugMode() as comm_mode,
        ):
            if isinstance(comm, AllGather):
                work = comm.foreach(unsharded, shards, group, async_op)
            else:
                work = comm.foreach(
                    shards, unsharded, group, dist.ReduceOp.SUM, async_op
                )
        return work, comm_mode.get_comm_counts()

    @parametrize("async_op", [False, True])
    def test_default_comms_coalesce_where_the_group_does(self, async_op: bool):
        """Tests that FSDP's default comms issue a group's pairs as one
        coalesced c10d op where the process group coalesces, returning its
        work only for ``async_op``, and one op per pair where it does not."""
        c10d = torch.ops.c10d
        for comm, coalesced_op, op in (
            (
                DefaultAllGather(),
                c10d.allgather_into_tensor_coalesced_,
                c10d._allgather_base_,
            ),
            (
                DefaultReduceScatter(),
                c10d.reduce_scatter_tensor_coalesced_,
                c10d._reduce_scatter_base_,
            ),
        ):
            work, counts = self._foreach(comm, 3, True, async_op)
            self.assertEqual(counts, {coalesced_op: 1})
            self.assertEqual(work is not None, async_op)
            work, counts = self._foreach(comm, 3, False, async_op)
            self.assertEqual(counts, {op: 3})
            self.assertIsNone(work)
            # Overriding decides: a subclass's own ``__call__`` runs inside the
            # coalescing manager too; one that must go one by one overrides
            # ``foreach``
            work, counts = self._foreach(_OwnCall(type(comm))(), 3, True, async_op)
            self.assertEqual(counts, {coalesced_op: 1})
            work, counts = self._foreach(_OneByOne(type(comm))(), 3, True, async_op)
            self.assertEqual(counts, {op: 3})
            self.assertIsNone(work)

    def test_group_without_coalescing(self):
        """Tests that a single pair, and a process group whose c10d backend
        does not report coalescing (the fake one, gloo), issue no coalesced
        op."""
        group = dist.group.WORLD
        tensors = [torch.ones(2, device=device_type) for _ in range(2)]
        self.assertFalse(_fsdp_collectives._coalesces(group, tensors))
        self.assertFalse(_fsdp_collectives._coalesces(group, tensors[:1]))


instantiate_parametrized_tests(TestFullyShardBackendDefaults)
instantiate_parametrized_tests(TestFullyShardBackendCoalescing)


if __name__ == "__main__":
    run_tests()
