"""``torch.compile`` per block (inductor, CPU) with the vendored FSDP2: parity with
upstream under compile, and Dynamo graph breaks no worse than upstream's; and
the whole model under compiled autograd (aot_eager), both modes bitwise upstream.

Run: ``python -m pytest test/package/test_interop_compile.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
import torch._dynamo.compiled_autograd as compiled_autograd
import torch._dynamo.trace_rules as trace_rules
import torch._functorch.config
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
from torch.distributed.tensor import DTensor
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
    # Dynamo's caches and counters outlive a test
    own_processes = True

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


@pytest.mark.slow
class TestFullyShardCompiledAutograd(FSDPExtTestMultiProcess, ParityMixin):
    # Dynamo's caches and counters outlive a test
    own_processes = True

    def test_compiled_autograd_per_param_matches_grouped_and_upstream(self):
        """Tests that with the whole model compiled (aot_eager) and backward
        under compiled autograd, per-parameter and grouped collectives train to
        the same bits (losses and parameters, 3 SGD steps), and to upstream
        FSDP2's. On torch 2.9, FSDP's hooks are traced (``skip_fsdp_hooks=False``,
        its compiled-autograd FSDP2) and per-parameter all-gather outputs are
        recreated per all-gather as grouped ones are; torch 2.9's own FSDP2
        traces its CUDA streams there and cannot run on CPU, so grouped mode is
        the reference."""
        traces_fsdp_hooks = hasattr(torch._dynamo.config, "skip_fsdp_hooks")  # torch 2.9
        if traces_fsdp_hooks:
            self.enterContext(torch._dynamo.config.patch(skip_fsdp_hooks=False))
        self.enterContext(torch._functorch.config.patch(recompute_views=True))
        runs = [self._train_compiled(EXT, {"group_collectives": gc}) for gc in (True, False)]
        if not traces_fsdp_hooks:
            runs.append(self._train_compiled(UPSTREAM, {}))
        for run in runs[1:]:
            for tensor, ref_tensor in zip(run, runs[0], strict=True):
                self.assertTrue(torch.equal(tensor, ref_tensor))

    def _train_compiled(self, impl, fsdp_kwargs: dict) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8)
        ).to(self.device)
        for module in (model[0], model[2], model[3], model):
            impl.fully_shard(module, **fsdp_kwargs)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled_model = torch.compile(model, backend="aot_eager")
        losses = []
        for step in range(3):
            torch.manual_seed(100 + 10 * step + self.rank)
            with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss = compiled_model(torch.randn(4, 8, device=self.device)).sum()
                loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        # Compiled autograd leaves FSDP2's parameters unsharded after the last
        # backward, upstream's as ours: compare what the module holds
        params = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        return losses + [p.detach().clone() for p in params]


if __name__ == "__main__":
    run_tests()
