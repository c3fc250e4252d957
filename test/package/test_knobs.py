"""The knob table: every public setting of ``fully_shard`` and ``FSDPModule``
that touches communication, run in the three ways collectives can go out,
on real gloo, with the same bits required of all three:

- grouped (``group_collectives=True``);
- per-parameter, one op per parameter (gloo's default);
- per-parameter, coalesced (``fsdp_ext_testing.coalescing.COALESCED``).

At 2 ranks a sum of two values does not depend on order, so the three agree
bitwise with the default comms. The settings that need more ranks (HSDP,
``reshard_after_forward`` as an int below the world size) run at 4 ranks with
``DeterministicReduceScatter``, whose sums are in rank order in every mode;
HSDP's reduce-scatters and all-reduces are over 2 ranks. A fast path that
silently changes what a setting does shows up here as a red row.

All knobs of one world size share one process group (one spawn).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import (
    EXT,
    FSDPExtTestMultiProcess,
    Model,
    assert_models_bitwise_equal,
    on_fsdp_modules,
    registered_fsdp_backend,
    requires_per_param_meshes,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.common_utils import run_tests

from fsdp_ext_testing.coalescing import COALESCED, ONE_BY_ONE
from torch_fsdp_ext import CPUOffloadPolicy, DeterministicReduceScatter
from torch_fsdp_ext._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

DEVICE = torch.device("cpu")
BF16 = torch.bfloat16
MODES = {
    # name: (group_collectives, coalesced)
    "grouped": (True, False),
    "per-param one by one": (False, False),
    "per-param coalesced": (False, True),
}
STEPS = 3


@dataclass
class Knob:
    """A setting: extra ``fully_shard`` kwargs (given the mesh), what to call
    on each sharded model, and how many microbatches a step has (with
    ``no_sync``, all but the last skip gradient sync)."""

    name: str
    fsdp_kwargs: Callable[[DeviceMesh], dict[str, Any]] = lambda mesh: {}
    after_shard: Callable[[nn.Module], None] = lambda model: None
    before_forward: Callable[[nn.Module, int], None] = lambda model, micro: None
    microbatches: int = 1
    no_sync: bool = False
    mesh_shape: tuple[int, ...] = field(default=())
    # The root's kwargs instead of ``fsdp_kwargs``, if given
    root_fsdp_kwargs: Callable[[DeviceMesh], dict[str, Any]] | None = None


def _prefetch(model: nn.Module) -> None:
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch([blocks[0]])
    for block, following in zip(blocks, blocks[1:], strict=False):
        block.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([block])


def _unshard_async_before_forward(model: nn.Module, micro: int) -> None:
    for block in model.blocks:
        block.unshard(async_op=True)


def _second_mesh_for_hidden_weights(mesh: DeviceMesh) -> dict[str, Any]:
    # A second process group over the same ranks: the blocks' first weight
    # goes into a param group of its own (a per-param mesh, #173509)
    other = DeviceMesh.from_group(dist.new_group(), DEVICE.type)
    placement = EXT.ShardPlacementResult(Shard(0), mesh=other)
    return {"shard_placement_fn": lambda p: placement if p.shape == (35, 16) else None}


class _CallingAllGather(DefaultAllGather):
    """A default comm subclass with its own ``__call__``."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CallingReduceScatter(DefaultReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _custom_comms(module: Any) -> None:
    module.set_custom_all_gather(_CallingAllGather())
    module.set_custom_reduce_scatter(_CallingReduceScatter())


def _halve(tensor: torch.Tensor) -> None:
    tensor.mul_(0.5)


def _last_backward_on_last_microbatch(model: nn.Module, micro: int) -> None:
    model.set_is_last_backward(micro == 1)


def _mp(**kwargs: Any) -> Callable[[DeviceMesh], dict[str, Any]]:
    return lambda mesh: {"mp_policy": EXT.MixedPrecisionPolicy(**kwargs)}


KNOBS_W2 = [
    Knob("defaults"),
    Knob("reshard_after_forward=False", lambda mesh: {"reshard_after_forward": False}),
    Knob("reshard_after_forward=1", lambda mesh: {"reshard_after_forward": 1}),
    Knob("mp_policy bf16 params, fp32 reduce", _mp(param_dtype=BF16, reduce_dtype=torch.float32)),
    Knob("mp_policy bf16 params, reduce None", _mp(param_dtype=BF16)),
    Knob("mp_policy bf16 params and reduce", _mp(param_dtype=BF16, reduce_dtype=BF16)),
    Knob("mp_policy fp32 params, bf16 reduce", _mp(reduce_dtype=BF16)),
    Knob(
        "mp_policy bf16 params, fp32 output at the root",
        _mp(param_dtype=BF16, reduce_dtype=torch.float32),
        root_fsdp_kwargs=_mp(
            param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float32
        ),
    ),
    Knob(
        "offload_policy CPUOffloadPolicy(pin_memory=False)",
        lambda mesh: {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    ),
    Knob(
        "Shard(1) placement",
        lambda mesh: {
            "shard_placement_fn": lambda p: (
                Shard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None
            )
        },
    ),
    Knob("set_requires_gradient_sync(False) microbatches", microbatches=2, no_sync=True),
    Knob(
        "set_is_last_backward on the last microbatch",
        before_forward=_last_backward_on_last_microbatch,
        microbatches=2,
    ),
    Knob(
        "set_reshard_after_backward(False)",
        after_shard=on_fsdp_modules(lambda m: m.set_reshard_after_backward(False)),
    ),
    Knob("forward and backward prefetch", after_shard=_prefetch),
    Knob("unshard(async_op=True)", before_forward=_unshard_async_before_forward),
    Knob("_set_unshard_async_op(True)", after_shard=lambda m: m._set_unshard_async_op(True)),
    Knob(
        "_set_unshard_async_op(True), reshard_after_forward=False",
        lambda mesh: {"reshard_after_forward": False},
        after_shard=lambda m: m._set_unshard_async_op(True),
    ),
    Knob(
        "set_custom_all_gather / set_custom_reduce_scatter",
        after_shard=on_fsdp_modules(_custom_comms),
    ),
    Knob(
        # gloo has no PREMUL_SUM: a divide factor needs SUM, as upstream's does
        "set_gradient_divide_factor(3.0) with force-sum",
        after_shard=on_fsdp_modules(
            lambda m: (
                m.set_gradient_divide_factor(3.0),
                m.set_force_sum_reduction_for_comms(True),
            )
        ),
    ),
    Knob(
        "set_all_reduce_hook", after_shard=on_fsdp_modules(lambda m: m.set_all_reduce_hook(_halve))
    ),
    Knob(
        "set_force_sum_reduction_for_comms(True)",
        after_shard=on_fsdp_modules(lambda m: m.set_force_sum_reduction_for_comms(True)),
    ),
]
_deterministic = on_fsdp_modules(
    lambda m: m.set_custom_reduce_scatter(DeterministicReduceScatter())
)
KNOBS_W4 = [
    Knob("DeterministicReduceScatter", after_shard=_deterministic),
    Knob(
        "reshard_after_forward=2, DeterministicReduceScatter",
        lambda mesh: {"reshard_after_forward": 2},
        after_shard=_deterministic,
    ),
    Knob("HSDP 2x2", mesh_shape=(2, 2)),
    Knob(
        "HSDP 2x2, bf16 params, fp32 reduce",
        _mp(param_dtype=BF16, reduce_dtype=torch.float32),
        mesh_shape=(2, 2),
    ),
]


class _KnobTable(FSDPExtTestMultiProcess):
    def _train(self, knob: Knob, mode: str) -> tuple[nn.Module, list[torch.Tensor]]:
        group_collectives, coalescing = MODES[mode]
        mesh = (
            init_device_mesh(DEVICE.type, knob.mesh_shape, mesh_dim_names=("replicate", "shard"))
            if knob.mesh_shape
            else DeviceMesh.from_group(dist.group.WORLD, DEVICE.type)
        )
        kwargs = {"mesh": mesh, "group_collectives": group_collectives, **knob.fsdp_kwargs(mesh)}
        with registered_fsdp_backend(DEVICE.type, COALESCED if coalescing else ONE_BY_ONE):
            torch.manual_seed(42)
            # hidden 35: padded shards at 2 and 4 ranks
            model = Model(16, 35, num_blocks=3).to(DEVICE)
            for block in model.blocks:
                EXT.fully_shard(block, **kwargs)
            root_kwargs = knob.root_fsdp_kwargs(mesh) if knob.root_fsdp_kwargs else {}
            EXT.fully_shard(model, **{**kwargs, **root_kwargs})
            knob.after_shard(model)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(42 + self.rank)
            losses = []
            for _ in range(STEPS):
                for micro in range(knob.microbatches):
                    if knob.no_sync:
                        model.set_requires_gradient_sync(micro == knob.microbatches - 1)
                    knob.before_forward(model, micro)
                    loss = model(torch.randn(4, 16, generator=gen)).sum()
                    loss.backward()
                    losses.append(loss.detach())
                optim.step()
                optim.zero_grad()
        return model, losses

    def _check_knobs(self, knobs: list[Knob]) -> None:
        for knob in knobs:
            results = {mode: self._train(knob, mode) for mode in MODES}
            grouped_model, grouped_losses = results["grouped"]
            for mode, (model, losses) in results.items():
                what = f"{knob.name} [{mode} vs grouped, rank {self.rank}]"
                self.assertEqual(
                    torch.stack(losses), torch.stack(grouped_losses), atol=0, rtol=0, msg=what
                )
                assert_models_bitwise_equal(self, model, grouped_model, what, grads=False)
            # Equal bits prove nothing if nothing trained
            self.assertFalse(
                torch.equal(grouped_losses[0], grouped_losses[-1]), msg=f"{knob.name}: no training"
            )


class TestFullyShardKnobTable(_KnobTable):
    def test_every_setting_same_bits_in_every_mode(self):
        """Tests that at 2 ranks, for each communication setting, grouped,
        per-parameter one by one and per-parameter coalesced give the same
        losses and sharded parameters, bit for bit, over 3 AdamW steps."""
        self._check_knobs(KNOBS_W2)

    @requires_per_param_meshes
    def test_per_param_mesh_same_bits_in_every_mode(self):
        """Tests the same for a second mesh for the blocks' first weights."""
        self._check_knobs([Knob("per-param mesh", _second_mesh_for_hidden_weights)])


class TestFullyShardKnobTableW4(_KnobTable):
    @property
    def world_size(self) -> int:
        return 4

    def test_every_setting_same_bits_in_every_mode(self):
        """Tests the settings that need 4 ranks (HSDP 2x2, ``reshard_after_forward=2``,
        ``DeterministicReduceScatter``) the same way."""
        self._check_knobs(KNOBS_W4)


if __name__ == "__main__":
    run_tests()
