# Owner(s): ["oncall: distributed"]

import copy
import importlib.metadata
import inspect
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch_fsdp_ext import fully_shard, MixedPrecisionPolicy
from torch_fsdp_ext._fully_shard._fsdp_collectives import (
    _get_gradient_divide_factors,
    DefaultAllGather,
    DefaultReduceScatter,
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
)
from torch.distributed.tensor import Shard
from torch.testing._internal.common_fsdp import FSDPTestMultiThread, get_devtype, MLP
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

device_type = torch.device(get_devtype())

_REDUCE_OPS = {
    int(op): name for name, op in dist.ReduceOp.RedOpType.__members__.items()
}


def _reduce_op_name(op) -> str:
    # ``ReduceOp.AVG`` is a ``RedOpType``; ``PREMUL_SUM(factor)`` a ``ReduceOp``
    return _REDUCE_OPS[int(getattr(op, "op", op))]


class _CollectiveRecorder(TorchDispatchMode):
    """Records each c10d collective: phase, op, dtype and numel of each input
    and, for reductions, the reduce op."""

    def __init__(self):
        super().__init__()
        self.collectives: list[str] = []
        # In dispatch, the reduce op is an opaque ``ScriptObject``, so it is
        # read where FSDP passes it to the c10d Python API
        self._reduce_ops: list[str] = []
        self._originals = {
            name: getattr(dist, name)
            for name in ("reduce_scatter_tensor", "all_reduce")
        }

    def __enter__(self):
        for name, original in self._originals.items():

            def wrapper(*args, original=original, **kwargs):
                bound = inspect.signature(original).bind(*args, **kwargs)
                bound.apply_defaults()
                self._reduce_ops.append(_reduce_op_name(bound.arguments["op"]))
                return original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return super().__enter__()

    def __exit__(self, *args):
        for name, original in self._originals.items():
            setattr(dist, name, original)
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[1]
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            tensors = [
                t
                for a in args
                for t in (a if isinstance(a, list) else [a])
                if isinstance(t, torch.Tensor)
            ]
            # The inputs: the second tensor argument, or for all-reduce, the first
            inputs = tensors[:1] if name.startswith("allreduce") else tensors[1:]
            ops = [
                self._reduce_ops.pop(0)
                for a in args
                if isinstance(a, torch.ScriptObject) and a._type().name() == "ReduceOp"
            ]
            self.collectives.append(
                " ".join(
                    [phase, name]
                    + [
                        f"{str(t.dtype).removeprefix('torch.')}[{t.numel()}]"
                        for t in inputs
                    ]
                    + ops
                )
            )
        return func(*args, **(kwargs or {}))


class TestFullyShardCollectiveTrace(TestCase):
    """Pins the collectives FSDP issues (op, dtypes, sizes and reduce ops) for
    one training step of two blocks over the fake process group, for each
    setting that selects the reduce op."""

    world_size = 4

    def setUp(self):
        super().setUp()
        dist.init_process_group(
            "fake", store=FakeStore(), rank=0, world_size=self.world_size
        )

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def _trace(
        self, mesh_shape: tuple[int, ...] = (4,), lazy_init: bool = False, **kwargs
    ) -> str:
        """The trace of one training step; with ``lazy_init``, of the first."""
        torch.manual_seed(42)
        model = nn.Sequential(MLP(8), MLP(8))
        mesh = init_device_mesh(
            device_type.type,
            mesh_shape,
            mesh_dim_names=("replicate", "shard")[-len(mesh_shape) :],
        )
        divide_factor = kwargs.pop("divide_factor", None)
        force_sum = kwargs.pop("force_sum", False)
        for module in (*model, model):
            fully_shard(module, mesh=mesh, **kwargs)
            if divide_factor is not None:
                module.set_gradient_divide_factor(divide_factor)
            module.set_force_sum_reduction_for_comms(force_sum)
        inp = torch.randn(4, 8, device=device_type)
        if not lazy_init:
            model(inp).sum().backward()  # lazy init outside of the recording
        with _CollectiveRecorder() as recorder:
            model(inp).sum().backward()
        return "\n".join(recorder.collectives)

    def test_trace_fp32(self):
        """Tests the collectives of fp32 training: ``AVG``."""
        self.assertExpectedInline(
            self._trace(),
            """\
forward _allgather_base_ float32[138]
forward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _reduce_scatter_base_ float32[552] AVG
backward _reduce_scatter_base_ float32[552] AVG""",
        )

    def test_trace_bf16_params_fp32_reduce(self):
        """Tests the collectives with bf16 parameters reduced in fp32."""
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        self.assertExpectedInline(
            self._trace(mp_policy=mp_policy),
            """\
forward _allgather_base_ bfloat16[138]
forward _allgather_base_ bfloat16[138]
backward _allgather_base_ bfloat16[138]
backward _allgather_base_ bfloat16[138]
backward _reduce_scatter_base_ float32[552] AVG
backward _reduce_scatter_base_ float32[552] AVG""",
        )

    def test_trace_fp16_reduce(self):
        """Tests the collectives with fp16 reduction: ``SUM`` with FSDP's own
        pre/post divides."""
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.float16, reduce_dtype=torch.float16
        )
        self.assertExpectedInline(
            self._trace(mp_policy=mp_policy),
            """\
forward _allgather_base_ float16[138]
forward _allgather_base_ float16[138]
backward _allgather_base_ float16[138]
backward _allgather_base_ float16[138]
backward _reduce_scatter_base_ float16[552] SUM
backward _reduce_scatter_base_ float16[552] SUM""",
        )

    def test_trace_divide_factor(self):
        """Tests the collectives with a gradient divide factor: ``PREMUL_SUM``,
        or ``AVG`` for the world size."""
        self.assertExpectedInline(
            self._trace(divide_factor=3.0),
            """\
forward _allgather_base_ float32[138]
forward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _reduce_scatter_base_ float32[552] PREMUL_SUM
backward _reduce_scatter_base_ float32[552] PREMUL_SUM""",
        )
        self.assertExpectedInline(
            self._trace(divide_factor=4.0),
            """\
forward _allgather_base_ float32[138]
forward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _reduce_scatter_base_ float32[552] AVG
backward _reduce_scatter_base_ float32[552] AVG""",
        )

    def test_trace_force_sum(self):
        """Tests the collectives with ``set_force_sum_reduction_for_comms``."""
        self.assertExpectedInline(
            self._trace(force_sum=True),
            """\
forward _allgather_base_ float32[138]
forward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _allgather_base_ float32[138]
backward _reduce_scatter_base_ float32[552] SUM
backward _reduce_scatter_base_ float32[552] SUM""",
        )

    def test_trace_hsdp(self):
        """Tests the collectives of HSDP on a 2 x 2 mesh: a reduce-scatter, then
        an all-reduce."""
        self.assertExpectedInline(
            self._trace(mesh_shape=(2, 2)),
            """\
forward _allgather_base_ float32[276]
forward _allgather_base_ float32[276]
backward _allgather_base_ float32[276]
backward _allgather_base_ float32[276]
backward _reduce_scatter_base_ float32[552] AVG
backward allreduce_ float32[276] AVG
backward _reduce_scatter_base_ float32[552] AVG
backward allreduce_ float32[276] AVG""",
        )

    def test_reduce_ops_per_device_type(self):
        """Tests the reduce ops and divide factors FSDP picks for each device
        type (MTIA reduces with ``SUM``), with and without a divide factor."""
        group = dist.distributed_c10d._get_default_group()
        lines = []
        for device in ("cpu", "cuda", "mtia", "privateuseone"):
            for factor in (None, 3.0):
                pre, post, rs_op, ar_op = _get_gradient_divide_factors(
                    group, None, torch.float32, device, factor
                )
                lines.append(
                    f"{device} {factor}: {pre} {post} "
                    f"{_reduce_op_name(rs_op)} {_reduce_op_name(ar_op)}"
                )
        self.assertExpectedInline(
            "\n".join(lines),
            """\
cpu None: None None AVG AVG
cpu 3.0: None None PREMUL_SUM SUM
cuda None: None None AVG AVG
cuda 3.0: None None PREMUL_SUM SUM
mtia None: None 4.0 SUM SUM
mtia 3.0: None 3.0 SUM SUM
privateuseone None: None None AVG AVG
privateuseone 3.0: None None PREMUL_SUM SUM""",
        )


class TestFullyShardGroupedSurface(TestCase):
    """Pins what grouped FSDP does around its collectives: no collective added
    by a debug setting, no third-party code loaded, how it calls
    ``shard_placement_fn`` and groups parameters, and which custom comms may
    be set."""

    world_size = 4

    def setUp(self):
        super().setUp()
        dist.init_process_group(
            "fake", store=FakeStore(), rank=0, world_size=self.world_size
        )

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def test_no_collective_added_by_debug_level(self):
        """Tests that the first training step, lazy init included, issues the
        same collectives with ``TORCH_DISTRIBUTED_DEBUG`` at ``INFO`` and
        ``DETAIL`` as with it off."""
        trace = TestFullyShardCollectiveTrace._trace
        expected = trace(self, lazy_init=True)
        previous = dist.get_debug_level()
        for level in (dist.DebugLevel.INFO, dist.DebugLevel.DETAIL):
            dist.set_debug_level(level)
            try:
                self.assertEqual(trace(self, lazy_init=True), expected, msg=str(level))
            finally:
                dist.set_debug_level(previous)

    def test_no_entry_points_loaded(self):
        """Tests that sharding and training, and choosing the reduce ops of
        CPU, CUDA and MTIA, load no package entry points (no third-party
        code runs in ``fully_shard``)."""
        with mock.patch.object(
            importlib.metadata, "entry_points", wraps=importlib.metadata.entry_points
        ) as entry_points:
            TestFullyShardCollectiveTrace._trace(self, lazy_init=True)
            group = dist.distributed_c10d._get_default_group()
            for device in ("cpu", "cuda", "mtia"):
                _get_gradient_divide_factors(group, None, torch.float32, device, 3.0)
        self.assertEqual(entry_points.call_count, 0)

    def test_shard_placement_fn_calls_and_param_group(self):
        """Tests how often ``shard_placement_fn`` is called, with which
        parameters, and that the parameters form one group in order."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        torch.manual_seed(42)
        model = MLP(8)
        names = {param: name for name, param in model.named_parameters()}
        calls = []

        def shard_placement_fn(param):
            calls.append(names[param])
            return Shard(0) if param.ndim == 1 else None

        fully_shard(model, mesh=mesh, shard_placement_fn=shard_placement_fn)
        group = model._get_fsdp_state()._fsdp_param_group
        self.assertExpectedInline(
            "\n".join(calls),
            """\
in_proj.weight
in_proj.bias
out_proj.weight
out_proj.bias""",
        )
        self.assertEqual(
            [fsdp_param._module_info.param_name for fsdp_param in group.fsdp_params],
            ["weight", "bias", "weight", "bias"],
        )

    def test_custom_comms_on_a_module(self):
        """Tests that the custom comm setters take any comm, one bound to
        another process group included."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        sub_mesh = init_device_mesh(
            device_type.type, (2, 2), mesh_dim_names=("replicate", "shard")
        )["shard"]
        for all_gather, reduce_scatter in (
            (DefaultAllGather(), DefaultReduceScatter()),
            (
                ProcessGroupAllocAllGather(mesh.get_group()),
                ProcessGroupAllocReduceScatter(mesh.get_group()),
            ),
            (
                ProcessGroupAllocAllGather(sub_mesh.get_group()),
                ProcessGroupAllocReduceScatter(sub_mesh.get_group()),
            ),
        ):
            model = fully_shard(MLP(8), mesh=mesh)
            model.set_custom_all_gather(all_gather)
            model.set_custom_reduce_scatter(reduce_scatter)
            param_group = model._get_fsdp_state()._fsdp_param_group
            self.assertIs(param_group._all_gather_comm, all_gather)
            self.assertIs(param_group._reduce_scatter_comm, reduce_scatter)


class TestFullyShardCollectiveBits(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_gradients_are_the_average(self):
        """Tests that FSDP's sharded gradients are bitwise the average of each
        rank's gradients of an unsharded replica, evenly and unevenly
        sharded."""
        self.run_subtests({"dim": [8, 7]}, self._test_gradients_are_the_average)

    def _test_gradients_are_the_average(self, dim: int):
        torch.manual_seed(42)
        ref = nn.Sequential(MLP(dim), MLP(dim)).to(device_type)
        # Ranks may be threads that share one random generator
        for param in ref.parameters():
            dist.broadcast(param.detach(), src=0)
        model = copy.deepcopy(ref)
        for module in (*model, model):
            fully_shard(module)
        torch.manual_seed(42 + self.rank)
        inp = torch.randn(4, dim, device=device_type)
        model(inp).sum().backward()
        ref(inp).sum().backward()
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            grads = [torch.empty_like(ref_param.grad) for _ in range(self.world_size)]
            dist.all_gather(grads, ref_param.grad)
            expected = grads[0].clone()
            for grad in grads[1:]:
                expected += grad
            expected /= self.world_size
            self.assertTrue(torch.equal(param.grad.full_tensor(), expected))


if __name__ == "__main__":
    run_tests()
