"""torch_fsdp_ext.xla without torch_xla: the parts that are plain torch;
with torch_xla installed (the torch 2.9.0 venv of ``tools/xla_check.sh``),
also a short training run on its PJRT CPU device (:class:`TestFullyShardXLADevice`).

The XLA lane itself (grouped vs per-param on PJRT CPU) is
``bash tools/xla_check.sh``, which CI runs; these tests hold on every base.
"""

import importlib.util
import inspect
import itertools
import json
import os
import subprocess
import sys
import types
import unittest
from unittest import mock

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_fsdp_ext import get_fsdp_backend, xla
from torch_fsdp_ext._fully_shard import _fsdp_init
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch_fsdp_ext._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter


class TestFullyShardXLAKernels(TestCase):
    @settings(max_examples=50, deadline=None)
    @given(
        rows=st.lists(st.integers(1, 9), min_size=1, max_size=4),
        cols=st.integers(1, 3),
        num_chunks=st.integers(1, 4),
    )
    def test_chunk_cat_matches_aten(self, rows, cols, num_chunks):
        """Tests that the package's chunk_cat, which replaces torch_xla's
        (zeros for a tensor whose dim 0 needs padding), equals ATen's
        ``torch._chunk_cat`` bit for bit, padding included."""
        g = torch.Generator().manual_seed(len(rows) * 100 + cols * 10 + num_chunks)
        tensors = [
            torch.randn(r, cols, generator=g) if i % 2 else torch.randn(r * cols, generator=g)
            for i, r in enumerate(rows)
        ]
        expected = torch._chunk_cat(tensors, 0, num_chunks)
        out = torch.full_like(expected, float("nan"))
        xla._chunk_cat(tensors, 0, num_chunks, out=out)
        self.assertEqual(out, expected, atol=0, rtol=0)

    def test_split_with_sizes_copy_fills_every_output(self):
        """Tests that the functionalizable split_with_sizes_copy writes each
        slice of the all-gather output into its output tensor."""
        src = torch.arange(10.0)
        outs = [torch.empty(3), torch.empty(0), torch.empty(7)]
        xla._split_with_sizes_copy(src, [3, 0, 7], out=outs)
        self.assertEqual(torch.cat(outs), src, atol=0, rtol=0)


class _NotXlaGroup:
    """A process group stand-in without torch_xla's replica groups, nor a
    c10d backend (so the default comms do not coalesce)."""

    _device_types: list[torch.device] = []


class TestFullyShardXLATupleCollectives(TestCase):
    @settings(max_examples=100, deadline=None)
    @given(
        inputs=st.lists(
            st.tuples(st.integers(0, 64), st.sampled_from([torch.float32, torch.bfloat16])),
            max_size=8,
        ),
        cap=st.one_of(st.none(), st.integers(1, 256)),
    )
    def test_buckets_keep_order_dtype_and_cap(self, inputs, cap):
        """Tests that the tuple collectives' buckets are consecutive runs of
        one dtype (torch_xla's list all-gather aborts on mixed dtypes) that
        keep every (output, input) pair in order, hold at most ``cap`` bytes
        of inputs unless a run is one input, and are one run per dtype change
        without a cap."""
        ins = [torch.empty(n, dtype=dtype) for n, dtype in inputs]
        outs = [torch.empty(2 * n, dtype=dtype) for n, dtype in inputs]
        runs = list(xla._buckets(outs, ins, cap))
        self.assertEqual([id(t) for _, run in runs for t in run], [id(t) for t in ins])
        self.assertEqual([id(t) for run, _ in runs for t in run], [id(t) for t in outs])
        for run_outs, run_ins in runs:
            self.assertEqual(len(run_outs), len(run_ins))
            self.assertEqual(len({t.dtype for t in run_ins}), 1)
            if cap is not None and len(run_ins) > 1:
                self.assertLessEqual(sum(t.nbytes for t in run_ins), cap)
        if cap is None:
            dtype_changes = sum(a[1] != b[1] for a, b in itertools.pairwise(inputs))
            self.assertEqual(len(runs), dtype_changes + 1 if inputs else 0)

    @settings(max_examples=200, deadline=None)
    @given(
        values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32)),
        dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    )
    def test_chain_zero_keeps_every_bit(self, values, dtype):
        """Tests what chaining the tuple collectives relies on: the zero read
        from any tensor (inf, NaN, negative, -0.0 first) is +0.0, and
        subtracting it from an all-gather input keeps every value bit for bit
        (-0.0, infinities and subnormals included; NaN stays NaN). ``x + 0.0``
        would turn -0.0 into +0.0. An empty tensor (an expert with no tokens)
        gives a zero too."""
        x = torch.tensor(values, dtype=torch.float32).to(dtype)
        zero = xla._zero_read_from(x)
        self.assertEqual(zero.dtype, torch.float32)
        self.assertEqual(zero.tolist(), [0.0])
        self.assertFalse(torch.signbit(zero).item())
        chained = xla._chained(x, zero.to(dtype))
        nan = torch.isnan(x)
        self.assertTrue(torch.equal(torch.isnan(chained), nan))
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        self.assertTrue(torch.equal(chained[~nan].view(bits), x[~nan].view(bits)))

    def test_chain_leaves_dtypes_without_subtraction_alone(self):
        """Tests that inputs the chain cannot subtract from (bool, float8)
        pass through as they are."""
        for t in (torch.ones(3, dtype=torch.bool), torch.ones(3).to(torch.float8_e4m3fn)):
            self.assertIs(xla._chained(t, torch.zeros(1, dtype=t.dtype)), t)

    def test_padded_own_shard_reads_as_fsdps_padded_shard(self):
        """Tests that an own shard shorter than the padded size on dim 0 (the
        last ranks' shards of an uneven dim 0) reads as the flat padded shard
        FSDP would have kept: the shard, then zeros."""
        for local_size, padded_size in (
            ((3, 5), (4, 5)),
            ((0, 5), (4, 5)),
            ((4, 5), (4, 5)),
            ((2,), (3,)),
            ((0,), (3,)),
            ((1, 2, 3), (2, 2, 3)),
        ):
            with self.subTest(local_size=local_size, padded_size=padded_size):
                local = torch.randn(local_size)
                fsdp_param = types.SimpleNamespace(
                    sharded_param=types.SimpleNamespace(_local_tensor=local),
                    padded_sharded_param_size=torch.Size(padded_size),
                )
                expected = local.new_zeros(padded_size)
                expected.narrow(0, 0, local_size[0]).copy_(local)
                data = xla._get_sharded_param_data(fsdp_param)
                self.assertTrue(torch.equal(data, expected.view(-1)))

    def test_buckets_need_one_output_per_input(self):
        """Tests that pairs that do not match up raise instead of dropping one."""
        with self.assertRaisesRegex(ValueError, "2 outputs for 1 inputs"):
            list(xla._buckets([torch.empty(2), torch.empty(2)], [torch.empty(1)], None))

    def test_backend_comms_are_the_tuple_comms(self):
        """Tests that the 'xla' backend's default comms are the tuple
        collectives, each with a ``foreach`` of its own that takes FSDP's own
        tensors (not the base interface's copy through ``allocate``). That
        per parameter those are tensors of their own (no writes into slices)
        is FSDP's part, tested by ``test_foreach_gets_tensors_of_their_own``."""
        self.assertIs(xla.XLA_BACKEND.all_gather_comm, xla.XlaAllGather)
        self.assertIs(xla.XLA_BACKEND.reduce_scatter_comm, xla.XlaReduceScatter)
        self.assertIsNot(xla.XlaAllGather.foreach, AllGather.foreach)
        self.assertIsNot(xla.XlaReduceScatter.foreach, ReduceScatter.foreach)

    def test_other_process_groups_go_one_by_one(self):
        """Tests that with a process group that is not torch_xla's (no replica
        groups), the tuple comms say why once and issue the collectives one
        per parameter, in order, through the default ``__call__``."""
        group = _NotXlaGroup()
        outputs, inputs = [torch.empty(4), torch.empty(2)], [torch.empty(2), torch.empty(1)]
        for comm, args, default in (
            (xla.XlaAllGather(), (), DefaultAllGather),
            (xla.XlaReduceScatter(), (dist.ReduceOp.SUM,), DefaultReduceScatter),
        ):
            with self.subTest(comm=type(comm).__name__):
                xla._warned.discard(type(comm))
                with mock.patch.object(default, "__call__") as call:
                    with self.assertLogs(xla.logger, "WARNING") as logs:
                        for _ in range(2):
                            self.assertIsNone(comm.foreach(outputs, inputs, group, *args))
                self.assertEqual(len(logs.records), 1)
                self.assertIn("one per parameter", logs.output[0])
                self.assertEqual(
                    [c.args[:2] for c in call.call_args_list],
                    list(zip(outputs, inputs, strict=True)) * 2,
                )

    def test_one_by_one_comms_skip_the_tuple_collective(self):
        """Tests that ``tuple_collectives=False`` comms issue one collective
        per parameter through the default ``__call__`` even on torch_xla's
        process group, and say nothing."""
        group = _NotXlaGroup()
        group._mesh = []  # what torch_xla's process group has for the world
        outputs, inputs = [torch.empty(4), torch.empty(2)], [torch.empty(2), torch.empty(1)]
        for comm, args, default in (
            (xla.XlaAllGather(tuple_collectives=False), (), DefaultAllGather),
            (
                xla.XlaReduceScatter(tuple_collectives=False),
                (dist.ReduceOp.SUM,),
                DefaultReduceScatter,
            ),
        ):
            with self.subTest(comm=type(comm).__name__):
                with mock.patch.object(default, "__call__") as call:
                    with self.assertNoLogs(xla.logger, "WARNING"):
                        self.assertIsNone(comm.foreach(outputs, inputs, group, *args))
                self.assertEqual(
                    [c.args[:2] for c in call.call_args_list],
                    list(zip(outputs, inputs, strict=True)),
                )

    def test_bucket_cap_needs_tuple_collectives(self):
        """Tests that a bucket cap for one-by-one collectives raises."""
        with self.assertRaisesRegex(ValueError, "tuple_collectives=True only"):
            xla.register(tuple_collectives=False, bucket_cap_bytes=1 << 20)


class TestFullyShardXLARegistration(TestCase):
    def test_xla_mesh_registers_before_the_device_handle(self):
        """Tests that FSDP registers the package's xla support itself when it
        first meets an 'xla' mesh, before asking for the device handle: here,
        without torch_xla, that is the one ImportError naming the fix."""
        mesh = types.SimpleNamespace(device_type="xla")
        with mock.patch.dict(sys.modules, {"torch_xla": None}):
            with self.assertRaisesRegex(ImportError, "Fix: pip install torch-xla=="):
                _fsdp_init._get_device_from_mesh(mesh)

    def test_register_without_torch_xla_names_the_fix(self):
        """Tests that register() without torch_xla raises one ImportError that
        names the pip command, and registers nothing."""
        with mock.patch.dict(sys.modules, {"torch_xla": None}):
            with self.assertRaisesRegex(ImportError, "Fix: pip install torch-xla=="):
                xla.register()
        self.assertIsNone(get_fsdp_backend("xla"))

    def test_clip_grad_norm_takes_dtensor_gradients(self):
        """Tests that once registered, ``torch.nn.utils.clip_grad_norm_``
        (which importing torch_xla replaces with a version DTensor cannot
        run) sends a call with DTensor gradients to
        ``torch_fsdp_ext.clip_grad_norm_``, any other call to the version it
        replaced, with the same arguments and torch's signature."""
        replaced = mock.Mock(name="torch_xla_clip_grad_norm_")
        replaced.__signature__ = inspect.signature(torch.nn.utils.clip_grad.clip_grad_norm_)
        with (
            mock.patch.object(torch.nn.utils, "clip_grad_norm_", replaced),
            mock.patch.object(xla._clip_grad, "clip_grad_norm_") as ours,
        ):
            xla._install_clip_grad_norm()
            installed = torch.nn.utils.clip_grad_norm_
            self.assertEqual(inspect.signature(installed), replaced.__signature__)
            plain = torch.nn.Parameter(torch.ones(2))
            plain.grad = torch.ones(2)
            installed([plain], 1.0)
            replaced.assert_called_once_with([plain], 1.0)
            ours.assert_not_called()
            # only the gradient's type is read before the call
            sharded = types.SimpleNamespace(grad=mock.Mock(spec=DTensor))
            installed(iter([plain, sharded]), 0.5, norm_type=1.0, foreach=True)
            ours.assert_called_once_with([plain, sharded], 0.5, norm_type=1.0, foreach=True)
            self.assertEqual(replaced.call_count, 1)

    def test_backend_reduces_with_sum(self):
        """Tests the defaults the 'xla' backend declares: per-parameter, and
        SUM with FSDP's own divides (XLA has neither AVG nor PREMUL_SUM)."""
        self.assertIs(xla.XLA_BACKEND.group_collectives, False)
        self.assertIs(xla.XLA_BACKEND.force_sum_reduction_for_comms, True)


# One rank on torch_xla's PJRT CPU device, in a process of its own (importing
# torch_xla changes torch for the rest of the process): per-param FSDP, three
# AdamW steps, once as the package frees and once never freeing; prints what
# TestFullyShardXLADevice checks, as JSON
_XLA_RUN = r"""
import json
import torch, torch.distributed as dist, torch_xla
import torch_fsdp_ext
from torch_fsdp_ext import xla as fsdp_xla

def numel(t):
    t = getattr(t, "_local_tensor", t)
    return torch._from_functional_tensor(t).numel() if torch._is_functional_tensor(t) else t.numel()

def train(free):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(device)
    modules = (model[0], model[2], model[3], model)
    for module in modules:
        torch_fsdp_ext.fully_shard(module, mesh=mesh, group_collectives=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.randn(3, 4, 8)
    step_ir = ""
    for step in range(3):
        model(inputs[step].to(device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            step_ir = torch_xla._XLAC._get_xla_tensors_text(
                [torch._from_functional_tensor(p._local_tensor) for p in model.parameters()]
            )
        torch_xla.sync()
    unsharded = []
    for module in modules:
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            unsharded += [numel(t) for t in fsdp_param.all_gather_outputs]
            unsharded.append(numel(fsdp_param._unsharded_param))
    final = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return {
        "unsharded_numels": unsharded,
        "params": {k: v.flatten().tolist() for k, v in final.items()},
        "moved": sum(not torch.equal(final[k], initial[k]) for k in initial),
        "parameters": len(initial),
        "step_reads_a_stale_base": "xla::unselect" in step_ir,
    }

dist.init_process_group("xla", init_method="xla://")
device = torch_xla.device()
mesh = fsdp_xla.mesh_from_group()
freed = train(True)
free, fsdp_xla._xla_free = fsdp_xla._xla_free, lambda tensor: None  # never free
kept = train(False)
print(json.dumps({"freed": freed, "kept": kept}))
"""


@unittest.skipIf(importlib.util.find_spec("torch_xla") is None, "needs torch_xla")
class TestFullyShardXLADevice(TestCase):
    def _train(self) -> dict:
        env = dict(
            os.environ,
            PJRT_DEVICE="CPU",
            CPU_NUM_DEVICES="1",
            XLA_USE_DUMMY_STORE="1",
            TORCH_DIST_INIT_BARRIER="0",
            # code generation that does not depend on the graph's other ops,
            # as the lane's parity flags (docs/xla.md)
            XLA_FLAGS="--xla_backend_optimization_level=0",
        )
        result = subprocess.run(
            [sys.executable, "-c", _XLA_RUN],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-4000:])
        return json.loads(result.stdout.strip().splitlines()[-1])

    def test_steady_step_frees_unsharded_parameters(self):
        """Tests that after a steady step on torch_xla's PJRT CPU device (one
        rank, per-param) every all-gather output and unsharded parameter
        holds a one-element placeholder, that the step read no stale padded
        shard (a sharded parameter is a tensor of its own, not a functional
        view of its padded shard), and that training matches a run that
        never frees, bit for bit, with every parameter moved."""
        result = self._train()
        freed, kept = result["freed"], result["kept"]
        self.assertTrue(freed["unsharded_numels"])
        self.assertEqual(set(freed["unsharded_numels"]), {1})
        self.assertNotIn(1, kept["unsharded_numels"])
        self.assertFalse(freed["step_reads_a_stale_base"])
        self.assertEqual(freed["moved"], freed["parameters"])
        self.assertEqual(freed["params"], kept["params"])


if __name__ == "__main__":
    run_tests()
