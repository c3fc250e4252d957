# Owner(s): ["oncall: distributed"]

import contextlib
import datetime
import functools
import warnings
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch_fsdp_ext import fully_shard
from torch_fsdp_ext._fully_shard import _fsdp_param_group
from torch.testing._internal.common_fsdp import get_devtype, MLP
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch_fsdp_ext import FSDPModule
from torch_fsdp_ext import (
    FSDPBackend,
    get_fsdp_backend,
    register_fsdp_backend,
    unregister_fsdp_backend,
)
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    _CommCapabilities,
    _get_comm_capabilities,
    _get_gradient_divide_factors,
)
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    _foreach_coalesced_if_supported,
    DefaultAllGather,
    DefaultReduceScatter,
    ProcessGroupAllocAllGather,
)
from torch_fsdp_ext._fully_shard._fsdp_collectives import lib as fsdp_lib

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
    """Opts in to receiving gradients themselves as inputs."""

    accepts_gradient_input = True


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


class _C10dOpCounter(TorchDispatchMode):
    """Counts the c10d ops dispatched, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


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
            replacement = FSDPBackend(supports_avg=False)
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
        with self.assertRaisesRegex(TypeError, "supports_avg must be a bool or None"):
            FSDPBackend(supports_avg="no")
        with self.assertRaisesRegex(
            TypeError, "reduce_scatter_comm must be a zero-argument"
        ):
            FSDPBackend(reduce_scatter_comm=DefaultReduceScatter())
        with self.assertRaisesRegex(
            ValueError, "No FSDP backend is registered for 'meta'"
        ):
            unregister_fsdp_backend("meta")


class _C10dBackend:
    """What FSDP asks of a process group's c10d backend: a stand-in for one
    that is not gloo, whatever its name."""

    def __init__(self, name: str, supports_coalescing: bool):
        self._name = name
        self.supports_coalescing = supports_coalescing

    def name(self) -> str:
        return self._name


_NCCL = _C10dBackend("nccl", supports_coalescing=True)
_XCCL = _C10dBackend("xccl", supports_coalescing=True)
_TPU = _C10dBackend("tpu_dist", supports_coalescing=False)
_MPI = _C10dBackend("mpi", supports_coalescing=False)


@functools.cache
def _gloo() -> dist.ProcessGroupGloo:
    """A real c10d gloo backend (one rank), made on first use: FSDP tells
    gloo's lack of ``PREMUL_SUM`` by its ``name()``; it does not report
    coalescing."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60))


class _CoalescingGloo(dist.ProcessGroupGloo):
    """A gloo c10d backend that reports coalescing (gloo implements the
    coalesced ops but does not report them)."""

    supports_coalescing = True


class _Work:
    def __init__(self):
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


class _FakeGroup:
    """A process group of ``size`` ranks whose c10d backend for "meta" is
    ``backend`` (none if ``None``)."""

    def __init__(self, size: int, backend: _C10dBackend | None = None):
        self._size = size
        self._backend = backend
        self._device_types = [] if backend is None else [torch.device("meta")]
        self.backend_queries = 0

    def size(self) -> int:
        return self._size

    def _get_backend(self, device: torch.device) -> _C10dBackend:
        self.backend_queries += 1
        return self._backend


class TestFullyShardBackendCapabilities(TestCase):
    def test_reduce_ops_follow_the_process_group(self):
        """Tests that ``PREMUL_SUM`` comes from the process group's c10d
        backend for the device (NCCL, XCCL and an out-of-tree backend have it;
        gloo's and MPI's have not), and that a group without a backend for the
        device is taken to have it, as FSDP always has."""
        meta = torch.device("meta")
        for backend, expected in (
            (_NCCL, True),
            (_XCCL, True),
            (_TPU, True),
            (_gloo(), False),
            (_MPI, False),
            (None, True),
        ):
            caps = _get_comm_capabilities(_FakeGroup(2, backend), meta)
            self.assertIs(caps.premul_sum, expected, msg=backend and backend.name())

    def test_divide_factor_follows_the_capabilities(self):
        """Tests that a divide factor reduces with ``PREMUL_SUM`` where the
        group has it and with ``SUM`` plus FSDP's own divides where it has
        not; that a 1-rank mesh, where no collective runs, keeps the division
        in FSDP's copy (no pre/post divides); and that without capabilities
        (a caller that passes none) the ops are upstream's."""
        for backend in (_NCCL, _XCCL, _TPU, None):
            group = _FakeGroup(4, backend)
            op = _get_gradient_divide_factors(
                group,
                None,
                torch.float32,
                "meta",
                3.0,
                comm_capabilities=_get_comm_capabilities(group, torch.device("meta")),
            )[2]
            self.assertNotEqual(op, dist.ReduceOp.SUM, msg=backend and backend.name())
        no_premul_sum = _CommCapabilities(premul_sum=False)
        factors = _get_gradient_divide_factors(
            _FakeGroup(4),
            None,
            torch.float32,
            "meta",
            3.0,
            comm_capabilities=no_premul_sum,
        )
        self.assertEqual(factors[2], dist.ReduceOp.SUM)
        self.assertEqual(factors[1], 3.0)
        self.assertEqual(
            _get_gradient_divide_factors(
                _FakeGroup(4), None, torch.float32, "meta", 3.0, True
            ),
            factors,
        )
        factors = _get_gradient_divide_factors(
            _FakeGroup(1),
            None,
            torch.float32,
            "meta",
            2.0,
            comm_capabilities=no_premul_sum,
        )
        self.assertEqual(factors[:2], (None, None))
        # The world size as factor is AVG, which needs no PREMUL_SUM
        factors = _get_gradient_divide_factors(
            _FakeGroup(4),
            None,
            torch.float32,
            "meta",
            4.0,
            comm_capabilities=no_premul_sum,
        )
        self.assertEqual(factors, (None, None, dist.ReduceOp.AVG, dist.ReduceOp.SUM))
        factors = _get_gradient_divide_factors(
            _FakeGroup(4), None, torch.float32, "meta", 3.0
        )
        self.assertNotEqual(factors[2], dist.ReduceOp.SUM)

    def test_capabilities_read_once_per_param_group(self):
        """Tests that FSDP reads a group's capabilities once per parameter
        group, at lazy init, however many gradient reductions follow, from
        the group's c10d backend (the fake process group's has
        ``PREMUL_SUM``)."""
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        try:
            torch.manual_seed(42)
            model = nn.Sequential(MLP(8, device_type), MLP(8, device_type))
            for mlp in model:
                fully_shard(mlp)
            fully_shard(model)
            model.set_gradient_divide_factor(3.0)
            num_param_groups = sum(
                len(module._get_fsdp_state()._fsdp_param_groups)
                for module in model.modules()
                if hasattr(module, "_get_fsdp_state")
            )
            with mock.patch.object(
                _fsdp_param_group,
                "_get_comm_capabilities",
                wraps=_get_comm_capabilities,
            ) as get_capabilities:
                for _ in range(3):
                    model(torch.randn(2, 8, device=device_type)).sum().backward()
            self.assertEqual(get_capabilities.call_count, num_param_groups)
            for module in model.modules():
                if hasattr(module, "_get_fsdp_state"):
                    for param_group in module._get_fsdp_state()._fsdp_param_groups:
                        self.assertEqual(
                            param_group._comm_capabilities,
                            _CommCapabilities(premul_sum=True),
                        )
        finally:
            dist.destroy_process_group()


class TestFullyShardBackendDefaults(TestCase):
    """Single process over the fake process group: checks what FSDP hands a
    backend, not the numerics."""

    def setUp(self):
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def test_registration_sets_capabilities_at_lazy_init(self):
        """Tests that what a registration for the device type declares
        overrides what the process group reports (the fake process group: no
        coalescing), in each parameter group's capabilities read at lazy init,
        and that a registration after lazy init leaves them alone."""
        from_group = _CommCapabilities(premul_sum=True, coalescing=False)
        for backend, expected in (
            (FSDPBackend(), from_group),
            (
                FSDPBackend(
                    supports_premul_sum=False,
                    supports_avg=False,
                    supports_coalescing=True,
                ),
                _CommCapabilities(premul_sum=False, coalescing=True, avg=False),
            ),
        ):
            with _registered(device_type.type, backend):
                torch.manual_seed(42)
                model = fully_shard(MLP(8, device_type))
                model(torch.randn(2, 8, device=device_type)).sum().backward()
            self.assertEqual(
                model._get_fsdp_state()._fsdp_param_groups[0]._comm_capabilities,
                expected,
                msg=str(backend),
            )
        with _registered(device_type.type, FSDPBackend(supports_avg=False)):
            model(torch.randn(2, 8, device=device_type)).sum().backward()
        self.assertEqual(
            model._get_fsdp_state()._fsdp_param_groups[0]._comm_capabilities,
            expected,
        )

    def test_missing_avg_selects_force_sum(self):
        """Tests that without AVG the ops and factors are exactly those of
        ``set_force_sum_reduction_for_comms(True)``."""
        pg = _FakeGroup(4, _NCCL)
        self.assertEqual(
            _get_gradient_divide_factors(
                pg,
                None,
                torch.float32,
                "meta",
                None,
                comm_capabilities=_CommCapabilities(avg=False),
            ),
            _get_gradient_divide_factors(pg, None, torch.float32, "meta", None, True),
        )

    def test_group_collectives_resolves_from_backend(self):
        """Tests that ``group_collectives=None`` takes the backend's default,
        that an explicit value wins, and that it is ``True`` without one."""
        with _registered(device_type.type, FSDPBackend(group_collectives=False)):
            for explicit, expected in ((None, False), (True, True), (False, False)):
                model = fully_shard(MLP(8), group_collectives=explicit)
                groups = model._get_fsdp_state()._fsdp_param_groups
                self.assertEqual([g.group_collectives for g in groups], [expected])
        with _registered(device_type.type, FSDPBackend()):
            model = fully_shard(MLP(8))
            self.assertTrue(
                model._get_fsdp_state()._fsdp_param_groups[0].group_collectives
            )

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
            groups = [
                m._get_fsdp_state()._fsdp_param_groups[0] for m in (model[0], model)
            ]
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
        group = fully_shard(MLP(8))._get_fsdp_state()._fsdp_param_groups[0]
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

    def test_backend_comm_gets_gradients_themselves(self):
        """Tests that in per-parameter mode a backend's reduce-scatter that
        sets ``accepts_gradient_input`` receives each gradient computed by
        autograd itself (same storage), that one that does not (the default)
        receives none of them, and that the all-gather runs once per
        parameter."""
        for comm_cls in (GradientReadingReduceScatter, RecordingReduceScatter):
            with self.subTest(comm_cls=comm_cls.__name__):
                self._test_backend_comm_gets_gradients_themselves(comm_cls)

    def _test_backend_comm_gets_gradients_themselves(
        self, comm_cls: type[ReduceScatter]
    ):
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
            fsdp_params = model._get_fsdp_state()._fsdp_param_groups[0].fsdp_params
            for fsdp_param in fsdp_params:
                fsdp_param.unsharded_param.register_hook(
                    lambda grad: grad_data_ptrs.append(grad.data_ptr())
                )
            comm = model._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
            comm.input_data_ptrs.clear()
            model(inp).sum().backward()
            self.assertEqual(len(comm.input_data_ptrs), len(fsdp_params))
            if comm_cls.accepts_gradient_input:
                self.assertEqual(sorted(comm.input_data_ptrs), sorted(grad_data_ptrs))
            else:
                allocated = {t.data_ptr() for t in comm.allocated}
                self.assertLessEqual(set(comm.input_data_ptrs), allocated)

    def test_backend_comm_owns_allocation(self):
        """Tests that the backend's ``allocate`` provides the reduce-scatter
        output and every input of a comm that does not accept gradients
        themselves: FSDP allocates nothing of its own."""
        with _registered(
            device_type.type, FSDPBackend(reduce_scatter_comm=RecordingReduceScatter)
        ):
            torch.manual_seed(42)
            model = fully_shard(nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 8)))
            model.set_group_collectives(False)
            comm = model._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
            model(torch.randn(4, 8, device=device_type)).sum().backward()
        # (7, 8) and (7,) are padded to (8, 8) and (8,); (8, 7) and (8,) are
        # copied as they are; one output of (64 + 8 + 56 + 8) / 2 elements
        self.assertEqual(
            sorted(comm.allocations, key=lambda s: s.numel()),
            [(8,), (8,), (56,), (64,), (68,)],
        )

    def test_grouped_buffer_from_backend_allocate(self):
        """Tests that in grouped mode the backend's comm allocates the
        group-wide reduce-scatter input (the ``chunk_cat`` buffer) and output."""
        with _registered(
            device_type.type, FSDPBackend(reduce_scatter_comm=RecordingReduceScatter)
        ):
            torch.manual_seed(42)
            model = fully_shard(MLP(8))
            comm = model._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
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
                lib.impl("chunk_cat", chunk_cat, device_type.type.upper())
            model(torch.randn(4, 8, device=device_type)).sum().backward()
        self.assertEqual(calls, [4])
        model(torch.randn(4, 8, device=device_type)).sum().backward()
        self.assertEqual(calls, [4])

    def test_default_comms_coalesce_in_foreach_where_supported(self):
        """Tests that the default comms' ``foreach`` issues one coalesced c10d
        op per group where the process group supports coalescing (here by
        registration, as the fake process group does not report it) and one
        op per parameter where it does not."""
        ops = {}
        for coalescing in (False, True):
            with _registered(
                device_type.type, FSDPBackend(supports_coalescing=coalescing)
            ):
                torch.manual_seed(42)
                model = fully_shard(MLP(8), group_collectives=False)
                inp = torch.randn(4, 8, device=device_type)
                model(inp).sum().backward()  # lazy init
                with _C10dOpCounter() as counter:
                    model(inp).sum().backward()
            ops[coalescing] = dict(counter.ops)
        self.assertEqual(
            ops[False], {"_allgather_base_": 4, "_reduce_scatter_base_": 4}
        )
        self.assertEqual(
            ops[True],
            {
                "allgather_into_tensor_coalesced_": 1,
                "reduce_scatter_tensor_coalesced_": 1,
            },
        )

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
            for group in module._get_fsdp_state()._fsdp_param_groups:
                group.group_collectives = False
    model(torch.randn(4, 8, device=device_type)).sum().backward()
    return comms


class _CallOverridingAllGather(DefaultAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _ForeachOverridingReduceScatter(DefaultReduceScatter):
    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        return super().foreach(output_tensors, input_tensors, group, op, async_op)


class TestFullyShardBackendCoalescing(TestCase):
    def setUp(self):
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def _foreach(self, comm, dtypes, caps, async_op=False):
        """Runs ``comm.foreach`` through FSDP's coalescing on the fake process
        group; returns the work and how many coalesced ops were issued."""
        group = dist.group.WORLD
        inputs = [torch.ones(2, dtype=dtype, device=device_type) for dtype in dtypes]
        outputs = [torch.empty(4, dtype=t.dtype, device=device_type) for t in inputs]
        if isinstance(comm, ReduceScatter):
            inputs, outputs = outputs, inputs

            def foreach(async_op):
                return comm.foreach(outputs, inputs, group, dist.ReduceOp.SUM, async_op)

        else:

            def foreach(async_op):
                return comm.foreach(outputs, inputs, group, async_op)

        with mock.patch.object(
            dist.distributed_c10d,
            "_coalescing_manager",
            wraps=dist.distributed_c10d._coalescing_manager,
        ) as manager:
            work = _foreach_coalesced_if_supported(
                comm, foreach, inputs, group, async_op, caps
            )
        return work, manager.call_count

    def test_coalescing_follows_the_process_group(self):
        """Tests that coalescing comes from the process group's c10d backend
        for the device (``supports_coalescing``; gloo's does not report it), and
        that a coalesced op may stay in flight except on gloo, whose coalesced
        ops corrupted the heap with several in flight."""
        meta = torch.device("meta")
        for backend, expected in (
            (_NCCL, (True, True)),
            (_XCCL, (True, True)),
            (_TPU, (False, True)),
            (_gloo(), (False, False)),
            (None, (False, True)),
        ):
            caps = _get_comm_capabilities(_FakeGroup(2, backend), meta)
            self.assertEqual(
                (caps.coalescing, caps.async_coalescing),
                expected,
                msg=backend and backend.name(),
            )

    def test_default_comms_coalesce_where_supported(self):
        """Tests that FSDP's own comms issue a group's pairs of one dtype as
        one coalesced op through c10d's coalescing manager where the process
        group coalesces, and one by one otherwise: without coalescing, for
        several dtypes, for a single pair, and for a comm that overrides
        ``__call__`` or ``foreach`` (its own code runs)."""
        fp32, bf16 = torch.float32, torch.bfloat16
        coalescing = _CommCapabilities(coalescing=True)
        for comm, dtypes, caps, expected in (
            (DefaultAllGather(), (fp32, fp32), coalescing, 1),
            (DefaultReduceScatter(), (fp32, fp32), coalescing, 1),
            (ProcessGroupAllocAllGather(dist.group.WORLD), (fp32, fp32), coalescing, 1),
            (DefaultAllGather(), (fp32, fp32), _CommCapabilities(), 0),
            (DefaultAllGather(), (bf16, fp32), coalescing, 0),
            (DefaultAllGather(), (fp32,), coalescing, 0),
            (_CallOverridingAllGather(), (fp32, fp32), coalescing, 0),
            (_ForeachOverridingReduceScatter(), (fp32, fp32), coalescing, 0),
        ):
            with self.subTest(comm=type(comm).__name__, dtypes=dtypes, caps=caps):
                work, num_coalesced = self._foreach(comm, dtypes, caps)
                self.assertEqual(num_coalesced, expected)
                self.assertIsNone(work)

    def test_coalesced_op_in_flight_only_where_allowed(self):
        """Tests that a coalesced op is returned in flight for ``async_op``
        and waited before returning where the process group does not allow
        it (gloo)."""
        fp32 = torch.float32
        for async_coalescing, async_op in (
            (True, True),
            (True, False),
            (False, True),
        ):
            caps = _CommCapabilities(coalescing=True, async_coalescing=async_coalescing)
            work, num_coalesced = self._foreach(
                DefaultAllGather(), (fp32, fp32), caps, async_op
            )
            self.assertEqual(num_coalesced, 1)
            in_flight = async_op and async_coalescing
            self.assertEqual(
                work is not None, in_flight, msg=f"{async_coalescing=}, {async_op=}"
            )


if __name__ == "__main__":
    run_tests()
