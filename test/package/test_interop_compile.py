"""``torch.compile`` per block (inductor, CPU) with the vendored FSDP2: parity with
upstream under compile, and Dynamo graph breaks no worse than upstream's.

Run: ``python -m pytest test/package/test_interop_compile.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
import torch._dynamo.trace_rules as trace_rules
import torch._inductor.config
import torch.distributed.fsdp._fully_shard._fsdp_state as upstream_state
from common_fsdp_ext import (
    EXT,
    UPSTREAM,
    FSDPExtTestMultiProcess,
    ParityMixin,
    build_titan_style,
    make_input_fn,
    train_in_lockstep,
)
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
import torch_fsdp_ext._fully_shard._fsdp_state as vendored_state

# Graph breaks counted by ``torch._dynamo.utils.counters["graph_break"]`` over
# the first forward and backward of a 2-block model with each block compiled,
# per layout; upstream FSDP2 and ours must both give these. Upstream's hooks run
# outside the graph without a break, so ours must too (before
# ``torch_fsdp_ext._torch_compat``: 4 per model, at the ``_dynamo_disable``
# wrappers of ``_pre_forward``/``_post_forward``). With FSDP inside a compiled
# checkpoint, the hooks break the checkpoint's graph and the block runs eagerly.
EXPECTED_GRAPH_BREAKS = {"plain": 0, "titan_style": 0, "fsdp_inside_checkpoint": 1}


class TestFullyShardCompileTraceRules(TestCase):
    def test_vendored_fsdp_files_are_skipped_like_upstream(self):
        """Tests that Dynamo skips frames in the vendored ``_fully_shard`` as it
        skips frames in torch's ``torch/distributed/fsdp/_fully_shard``."""
        vendored_dir = os.path.dirname(vendored_state.__file__)
        upstream_dir = os.path.dirname(upstream_state.__file__)
        self.assertNotEqual(vendored_dir, upstream_dir)
        for name in ("_fsdp_state.py", "_fsdp_common.py", "_fsdp_param_group.py"):
            with self.subTest(name=name):
                self.assertTrue(trace_rules.check_file(os.path.join(upstream_dir, name)).skipped)
                self.assertTrue(trace_rules.check_file(os.path.join(vendored_dir, name)).skipped)
        # The rest of the package (and user code) is still traced
        package_dir = os.path.dirname(torch_fsdp_ext.__file__)
        self.assertFalse(trace_rules.check_file(os.path.join(package_dir, "_vendor.py")).skipped)


@pytest.mark.slow
class TestFullyShardCompile(FSDPExtTestMultiProcess, ParityMixin):
    def _compile_and_count(self, model: torch.nn.Module, inp: torch.Tensor) -> tuple[int, int]:
        """Runs one forward and backward; returns (graph breaks, graphs) it added."""
        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        model(inp).sum().backward()
        model.zero_grad(set_to_none=True)
        return (
            sum(counters["graph_break"].values()) - breaks,
            counters["stats"]["unique_graphs"] - graphs,
        )

    def test_compile_per_block_parity_and_graph_breaks(self):
        """Tests that per-block ``torch.compile`` (inductor) with vendored FSDP2 in
        both modes trains bitwise equal to upstream FSDP2 under compile (losses,
        sharded params and grads), and that Dynamo counts exactly as many graph
        breaks and graphs for ours as for upstream: plainly, torchtitan-style
        (meta init, ``checkpoint_wrapper``, compile with ``fullgraph=True``,
        ``fully_shard`` with bf16 params and fp32 reduction), and with FSDP
        inside a compiled non-reentrant checkpoint."""
        self.run_subtests(
            {"group_collectives": [True, False], "layout": list(EXPECTED_GRAPH_BREAKS)},
            self._test_compile_per_block_parity_and_graph_breaks,
        )

    def _test_compile_per_block_parity_and_graph_breaks(self, group_collectives: bool, layout: str):
        # Tiny graphs: compiling in-process beats starting a worker pool per rank
        torch._inductor.config.compile_threads = 1
        torch._dynamo.reset()
        counters.clear()
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        build_kwargs = {"compile_blocks": True}
        titan_style = layout == "titan_style"
        if layout == "fsdp_inside_checkpoint":
            build_kwargs.update(ac="fsdp_inside_checkpoint")
        if titan_style:
            # As torchtitan: a graph break would raise, bf16 compute, fp32 reduce
            build_kwargs.update(meta_init=True, ac="checkpoint_wrapper", fullgraph=True)

        def fsdp_kwargs(impl):
            if not titan_style:
                return {}
            return {
                "mp_policy": impl.MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
            }

        ref_model = build_titan_style(
            UPSTREAM, mesh, self.device, fsdp_kwargs=fsdp_kwargs(UPSTREAM), **build_kwargs
        )
        model = build_titan_style(
            EXT,
            mesh,
            self.device,
            fsdp_kwargs={"group_collectives": group_collectives, **fsdp_kwargs(EXT)},
            **build_kwargs,
        )
        inp = torch.randn(4, 16, device=self.device)
        ref_breaks, ref_graphs = self._compile_and_count(ref_model, inp)
        breaks, graphs = self._compile_and_count(model, inp)
        expected_breaks = EXPECTED_GRAPH_BREAKS[layout]
        self.assertEqual(ref_breaks, expected_breaks, msg=dict(counters["graph_break"]))
        self.assertEqual(breaks, ref_breaks, msg=dict(counters["graph_break"]))
        self.assertEqual(ref_graphs > 0, expected_breaks == 0)
        self.assertEqual(graphs, ref_graphs)
        train_in_lockstep(
            self, model, ref_model, make_input_fn(self.rank, self.device), num_steps=3
        )
        # No graph breaks or recompiles-with-breaks after the first step either
        self.assertEqual(sum(counters["graph_break"].values()), breaks + ref_breaks)


if __name__ == "__main__":
    run_tests()
