# Owner(s): ["oncall: distributed"]

import contextlib
import datetime
import gc
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.common_fsdp import get_devtype
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from torch_fsdp_ext import fully_shard
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch_fsdp_ext import FSDPModule
from torch_fsdp_ext import (
    FSDPBackend,
    get_fsdp_backend,
    register_fsdp_backend,
    unregister_fsdp_backend,
)
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    _comm_capabilities_cache,
    _get_comm_capabilities,
    _get_gradient_divide_factors,
)
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    _foreach_coalesced,
)
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
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

    def test_missing_capabilities_select_force_sum(self):
        """Tests that a backend without PREMUL_SUM (divide factor) or without
        AVG reduces with exactly the ops and factors of
        ``set_force_sum_reduction_for_comms(True)``."""
        pg = _FakeGroup(4, _NCCL)
        forced = _get_gradient_divide_factors(
            pg, None, torch.float32, "meta", 3.0, True
        )
        with _registered("meta", FSDPBackend(supports_premul_sum=False)):
            self.assertEqual(
                _get_gradient_divide_factors(pg, None, torch.float32, "meta", 3.0),
                forced,
            )
            # AVG stays available when the factor is the world size
            self.assertEqual(
                _get_gradient_divide_factors(pg, None, torch.float32, "meta", 4.0)[2],
                dist.ReduceOp.AVG,
            )
        forced_avg = _get_gradient_divide_factors(
            pg, None, torch.float32, "meta", None, True
        )
        with _registered("meta", FSDPBackend(supports_avg=False)):
            self.assertEqual(
                _get_gradient_divide_factors(pg, None, torch.float32, "meta", None),
                forced_avg,
            )
        # Without a registration, NCCL's divide factor uses PREMUL_SUM
        _, _, op, _ = _get_gradient_divide_factors(pg, None, torch.float32, "meta", 3.0)
        self.assertNotEqual(op, dist.ReduceOp.SUM)


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
# A real c10d gloo backend (one rank): FSDP tells gloo's lack of
# ``PREMUL_SUM`` by its type; it does not report coalescing
_GLOO = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60))


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
    def test_reduce_ops_asked_once_per_group_and_device_type(self):
        """Tests that a process group's c10d backend is asked once per device
        type however often FSDP asks (at every gradient reduction), that
        another group is asked anew, and that the cached entry goes with its
        group."""
        meta, cpu = torch.device("meta"), torch.device("cpu")
        group, other = _FakeGroup(2, _NCCL), _FakeGroup(2, _GLOO)
        # Groups of earlier tests in this process may still be cached until
        # collected; counting after a collection counts this test's entries
        gc.collect()
        num_entries = len(_comm_capabilities_cache)
        for _ in range(3):
            caps = _get_comm_capabilities(group, meta)
            self.assertEqual((caps.avg, caps.premul_sum), (True, True))
            caps = _get_comm_capabilities(group, cpu)
            self.assertEqual((caps.avg, caps.premul_sum), (True, True))
        self.assertEqual(group.backend_queries, 1)
        caps = _get_comm_capabilities(other, meta)
        self.assertEqual((caps.avg, caps.premul_sum), (True, False))
        self.assertEqual(other.backend_queries, 1)
        self.assertEqual(len(_comm_capabilities_cache), num_entries + 2)
        del group, other
        gc.collect()
        self.assertEqual(len(_comm_capabilities_cache), num_entries)

    def test_capabilities_asked_once_per_group_and_device_type(self):
        """Tests that coalescing is read with the reduce ops, once per group
        and device type (per-parameter collectives ask at every collective)."""
        meta, cpu = torch.device("meta"), torch.device("cpu")
        group, other = _FakeGroup(2, _NCCL), _FakeGroup(2, _TPU)
        for _ in range(3):
            self.assertEqual(
                tuple(_get_comm_capabilities(group, meta)), (True, True, True, True)
            )
            self.assertEqual(
                tuple(_get_comm_capabilities(group, cpu)), (False, True, True, True)
            )
        self.assertEqual(group.backend_queries, 1)
        self.assertEqual(
            tuple(_get_comm_capabilities(other, meta)), (False, True, True, True)
        )
        self.assertEqual(other.backend_queries, 1)

    def test_mixed_dtypes_go_one_by_one(self):
        """Tests that pairs of one dtype go out as one coalesced op where the
        process group coalesces, and pairs of several dtypes one by one (gloo's
        coalesced all-gather is wrong for some dtype mixes)."""
        group = _FakeGroup(2, _NCCL)
        calls = []
        for dtypes, expected in (
            ((torch.float32, torch.float32), ["coalesced"]),
            ((torch.bfloat16, torch.float32), ["call", "call"]),
        ):
            calls.clear()
            inputs = [torch.empty(2, dtype=dtype, device="meta") for dtype in dtypes]
            _foreach_coalesced(
                lambda output, input: calls.append("call"),
                lambda: calls.append("coalesced"),
                [torch.empty_like(t) for t in inputs],
                inputs,
                group,
                async_op=True,
            )
            self.assertEqual(calls, expected, msg=str(dtypes))

    def test_coalesced_op_on_gloo_is_waited_before_returning(self):
        """Tests that a coalesced op is returned in flight for ``async_op``,
        except on gloo, where it is waited first: gloo's coalesced all-gather
        corrupted the heap with several in flight while the caller computed."""
        coalescing_gloo = _CoalescingGloo(
            dist.HashStore(), 0, 1, datetime.timedelta(seconds=60)
        )
        for backend, async_coalescing in ((_NCCL, True), (coalescing_gloo, False)):
            group = _FakeGroup(2, backend)
            caps = _get_comm_capabilities(group, torch.device("meta"))
            self.assertEqual(
                (caps.coalescing, caps.async_coalescing), (True, async_coalescing)
            )
            for async_op in (True, False):
                work = _Work()
                inputs = [torch.empty(2, device="meta") for _ in range(2)]
                returned = _foreach_coalesced(
                    lambda output, input: self.fail("expected one coalesced op"),
                    lambda work=work: work,
                    [torch.empty_like(t) for t in inputs],
                    inputs,
                    group,
                    async_op,
                )
                in_flight = async_op and async_coalescing
                msg = f"{backend.name()}, async_op={async_op}"
                self.assertIs(returned, work if in_flight else None, msg=msg)
                self.assertIs(work.waited, not in_flight, msg=msg)

    def test_coalescing_follows_the_process_group(self):
        """Tests that coalescing comes from the process group's c10d backend
        for the device (``supports_coalescing``), not from its name: gloo's
        c10d backend does not report it, and a group without a backend for
        the device does not coalesce."""
        meta = torch.device("meta")
        for backend, expected in (
            (_NCCL, True),
            (_XCCL, True),
            (_TPU, False),
            (_GLOO, False),
            (None, False),
        ):
            caps = _get_comm_capabilities(_FakeGroup(2, backend), meta)
            self.assertIs(caps.coalescing, expected, msg=backend and backend.name())

    def test_registration_overrides_capabilities(self):
        """Tests that a registration for the device type overrides exactly the
        capabilities it sets, whatever the process group reports, and that
        coalescing turned on for gloo still waits its coalesced ops at once."""
        meta = torch.device("meta")
        with _registered(
            "meta", FSDPBackend(supports_coalescing=False, supports_avg=False)
        ):
            caps = _get_comm_capabilities(_FakeGroup(2, _NCCL), meta)
        self.assertEqual(tuple(caps), (False, False, True, True))
        with _registered("meta", FSDPBackend(supports_premul_sum=True)):
            caps = _get_comm_capabilities(_FakeGroup(2, _GLOO), meta)
        self.assertEqual(tuple(caps), (False, True, True, False))
        with _registered("meta", FSDPBackend(supports_coalescing=True)):
            caps = _get_comm_capabilities(_FakeGroup(2, _GLOO), meta)
        self.assertEqual(tuple(caps), (True, True, False, False))

    def test_registration_applies_to_a_group_already_asked(self):
        """Tests that registering, re-registering and unregistering a
        backend for the device type change the capabilities of a process
        group that FSDP has already asked about (only what the process group
        reports is cached)."""
        meta = torch.device("meta")
        group = _FakeGroup(2, _NCCL)
        self.assertEqual(
            tuple(_get_comm_capabilities(group, meta)), (True, True, True, True)
        )
        with _registered("meta", FSDPBackend(supports_coalescing=False)):
            self.assertEqual(
                tuple(_get_comm_capabilities(group, meta)), (False, True, True, True)
            )
            register_fsdp_backend(
                "meta", FSDPBackend(supports_premul_sum=False), override=True
            )
            self.assertEqual(
                tuple(_get_comm_capabilities(group, meta)), (True, True, False, True)
            )
        self.assertEqual(
            tuple(_get_comm_capabilities(group, meta)), (True, True, True, True)
        )
        self.assertEqual(group.backend_queries, 1)

    def test_reduce_ops_follow_the_process_group(self):
        """Tests that ``PREMUL_SUM`` comes from the process group's c10d
        backend for the device, not from its name (NCCL, XCCL and an
        out-of-tree backend have it; gloo's c10d backend has not), that a
        group without a backend for the device is taken to have it, as FSDP
        always has, and that ``AVG`` is assumed, the same on any device type."""
        meta = torch.device("meta")
        for backend, expected in (
            (_NCCL, (True, True)),
            (_XCCL, (True, True)),
            (_TPU, (True, True)),
            (_GLOO, (True, False)),
            (None, (True, True)),
        ):
            caps = _get_comm_capabilities(_FakeGroup(2, backend), meta)
            self.assertEqual(
                (caps.avg, caps.premul_sum), expected, msg=backend and backend.name()
            )

    def test_divide_factor_follows_the_process_group(self):
        """Tests that a divide factor reduces with ``PREMUL_SUM`` on NCCL, XCCL
        and out-of-tree groups and with ``SUM`` plus FSDP's own divides on a
        gloo group, with no registration, and on a real (fake) c10d process
        group; also on a 1-rank gloo mesh, where the reduce-scatter runs as
        well, and with HSDP for a factor other than the data-parallel size."""
        for backend in (_NCCL, _XCCL, _TPU, None):
            op = _get_gradient_divide_factors(
                _FakeGroup(4, backend), None, torch.float32, "meta", 3.0
            )[2]
            self.assertNotEqual(op, dist.ReduceOp.SUM, msg=backend and backend.name())
        factors = _get_gradient_divide_factors(
            _FakeGroup(4, _GLOO), None, torch.float32, "meta", 3.0
        )
        self.assertEqual(factors[2], dist.ReduceOp.SUM)
        self.assertEqual(factors[1], 3.0)
        factors = _get_gradient_divide_factors(
            _FakeGroup(1, _GLOO), None, torch.float32, "meta", 2.0
        )
        self.assertEqual(factors[:3], (None, 2.0, dist.ReduceOp.SUM))
        # HSDP: the factor is compared with the data-parallel size (4 here),
        # so a factor equal to the shard size still needs PREMUL_SUM
        for factor in (2.0, 3.0):
            factors = _get_gradient_divide_factors(
                _FakeGroup(2, _GLOO),
                _FakeGroup(2, _GLOO),
                torch.float32,
                "meta",
                factor,
            )
            self.assertEqual(
                factors, (None, factor, dist.ReduceOp.SUM, dist.ReduceOp.SUM)
            )
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        try:
            group = dist.group.WORLD
            caps = _get_comm_capabilities(group, device_type)
            self.assertEqual((caps.avg, caps.premul_sum), (True, True))
            factors = _get_gradient_divide_factors(
                group, None, torch.float32, device_type.type, 3.0
            )
            self.assertNotEqual(factors[2], dist.ReduceOp.SUM)
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
            fsdp_params = model._get_fsdp_state()._fsdp_param_group.fsdp_params
            for fsdp_param in fsdp_params:
                fsdp_param.unsharded_param.register_hook(
                    lambda grad: grad_data_ptrs.append(grad.data_ptr())
                )
            comm = model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
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
            comm = model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
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

    def test_grouped_reduce_scatter_is_one_foreach_pair(self):
        """Tests that grouped, each group's reduce-scatter comm gets one
        ``foreach`` call with one pair (the flat buffer), which the default
        ``foreach`` issues with one ``__call__``, and that upstream's grouped
        all-gather calls the comm directly."""
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
            self.assertEqual(reduce_scatter.foreach_pairs, [1])
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
                group.group_collectives = False
    model(torch.randn(4, 8, device=device_type)).sum().backward()
    return comms


if __name__ == "__main__":
    run_tests()
