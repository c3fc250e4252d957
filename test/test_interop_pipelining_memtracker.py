"""``torch.distributed.pipelining`` schedules and ``FSDPMemTracker`` with the
vendored FSDP2, against upstream FSDP2 run the same way.

Run: ``python -m pytest test/test_interop_pipelining_memtracker.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from common_fsdp_ext import (
    EXT,
    UPSTREAM,
    Block,
    FSDPExtTestMultiProcess,
    ParityMixin,
    assert_bitwise_equal,
    assert_models_bitwise_equal,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext


class StageModule(nn.Module):
    """One pipeline stage: an input projection (first stage), a block, an output
    projection (last stage)."""

    def __init__(self, dim: int, hidden: int, first: bool, last: bool):
        super().__init__()
        self.inp = nn.Linear(dim, dim) if first else None
        self.block = Block(dim, hidden)
        self.out = nn.Linear(dim, dim) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        x = self.block(x)
        return self.out(x) if self.out is not None else x


class TestFullyShardPipelining(FSDPExtTestMultiProcess, ParityMixin):
    def test_pipeline_schedules_match_upstream(self):
        """Tests that pipelining schedules take their FSDP branches for the
        vendored FSDP2 (``isinstance(submod, FSDPModule)``: no-sync backward,
        ``REDUCE_GRAD``'s manual post-backward, ``UNSHARD``/``RESHARD``) and give
        bitwise the losses, sharded grads and params of upstream FSDP2 stages:
        ``ScheduleGPipe`` with one stage per rank and ``ScheduleInterleaved1F1B``
        with two, in both modes."""
        self.run_subtests(
            {"group_collectives": [True, False], "stages_per_rank": [1, 2]},
            self._test_pipeline_schedules_match_upstream,
        )

    def _build_stages(self, impl, dp_mesh, stages_per_rank: int, fsdp_kwargs: dict):
        num_stages = self.world_size * stages_per_rank
        submods = []
        for local in range(stages_per_rank):
            stage_index = self.rank + local * self.world_size
            torch.manual_seed(42 + stage_index)
            submod = StageModule(16, 32, stage_index == 0, stage_index == num_stages - 1)
            impl.fully_shard(submod.block, mesh=dp_mesh, **fsdp_kwargs)
            impl.fully_shard(submod, mesh=dp_mesh, **fsdp_kwargs)
            submods.append((stage_index, submod))
        stages = [
            PipelineStage(submod, stage_index, num_stages, self.device)
            for stage_index, submod in submods
        ]
        return [submod for _, submod in submods], stages

    def _test_pipeline_schedules_match_upstream(
        self, group_collectives: bool, stages_per_rank: int
    ):
        # One pipeline of ``world_size`` ranks; each stage is FSDP over a 1-rank mesh
        mesh = init_device_mesh(self.device.type, (self.world_size, 1), mesh_dim_names=("pp", "dp"))
        calls: list[str] = []
        results = []
        for impl, fsdp_kwargs in ((UPSTREAM, {}), (EXT, {"group_collectives": group_collectives})):
            submods, stages = self._build_stages(impl, mesh["dp"], stages_per_rank, fsdp_kwargs)
            if impl is EXT:
                for submod in submods:
                    self._record_fsdp_calls(submod, calls)
            loss_fn = lambda out, target: (out - target).pow(2).sum()  # noqa: E731
            if stages_per_rank == 1:
                schedule = ScheduleGPipe(stages[0], n_microbatches=2, loss_fn=loss_fn)
            else:
                schedule = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=loss_fn)
            optim = torch.optim.AdamW([p for m in submods for p in m.parameters()], lr=1e-2)
            losses = []
            for step in range(2):
                gen = torch.Generator().manual_seed(42 + step)
                x = torch.randn(4, 16, generator=gen)
                target = torch.randn(4, 16, generator=gen)
                step_losses: list[torch.Tensor] = []
                if self.rank == 0:
                    schedule.step(x, target=target, losses=step_losses)
                else:
                    schedule.step(target=target, losses=step_losses)
                losses.extend(loss.detach() for loss in step_losses)
                grads = [p.grad.clone() for m in submods for p in m.parameters()]
                optim.step()
                optim.zero_grad()
                losses.extend(grads)
            results.append((submods, losses))
        (ext_submods, ext_losses), (ref_submods, ref_losses) = results[1], results[0]
        self.assertEqual(len(ext_losses), len(ref_losses))
        for i, (actual, expected) in enumerate(zip(ext_losses, ref_losses, strict=True)):
            assert_bitwise_equal(self, actual, expected, f"loss or grad {i}")
        for submod, ref_submod in zip(ext_submods, ref_submods, strict=True):
            assert_models_bitwise_equal(self, submod, ref_submod, "after 2 steps", grads=False)
        # The schedule drove FSDP itself: the no-sync backward and REDUCE_GRAD,
        # plus UNSHARD/RESHARD for multi-stage schedules
        self.assertIn("set_requires_gradient_sync(False)", calls)
        self.assertIn("set_requires_gradient_sync(True)", calls)
        self.assertIn("set_is_last_backward(True)", calls)
        if stages_per_rank > 1:
            self.assertIn("unshard(async_op=True)", calls)
            self.assertIn("reshard()", calls)

    def _record_fsdp_calls(self, module: torch_fsdp_ext.FSDPModule, calls: list[str]) -> None:
        """Records calls of the FSDPModule methods that pipelining uses."""
        for name in ("set_requires_gradient_sync", "set_is_last_backward", "unshard", "reshard"):
            method = getattr(module, name)

            def recorded(*args, _name=name, _method=method, **kwargs):
                shown = ", ".join(
                    [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
                )
                calls.append(f"{_name}({shown})")
                return _method(*args, **kwargs)

            setattr(module, name, recorded)


if __name__ == "__main__":
    run_tests()
