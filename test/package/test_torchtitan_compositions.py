"""The FSDP2 compositions torchtitan uses, three ways: torch's ``fully_shard``
(``upstream``), ours grouped (``group_collectives=True``) and ours
per-parameter (``group_collectives=False``). Each test trains the three from
seed 42 on the same inputs and requires bitwise-equal (``torch.equal``) losses,
sharded gradients after every backward and sharded parameters after every
optimizer step.

- FSDP + TP on a 2-D (dp, tp) mesh, torchtitan's dense layout (threaded PG).
- MoE: routed experts ``Shard(1)`` on the efsdp mesh, placed by torchtitan's own
  ``apply_fsdp_to_decoder`` (gloo, W=4, EP=2).
- All-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``):
  one input, two inputs, metadata; torchao's float8 all-gather when torchao is
  installed (threaded PG).
- torch's own policy classes given to ``torch_fsdp_ext.fully_shard``.

Every test compares ours grouped and ours per-parameter each with upstream,
all with default comms: the data-parallel reductions are over 2 ranks, where
both modes sum alike, except the MoE test's dense parameters (4 ranks), where
gloo's sums agree too on that model, so no ``DeterministicReduceScatter`` is
needed.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import unittest
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not importable (requirements.txt pins torchtitan==0.3.0; a base may "
    "exclude it: [requirements.exclude] in patches/<version>/base.toml)",
)

import torch.distributed.fsdp as upstream_fsdp
import torch.nn as nn
import torch.nn.functional as F
from common_fsdp_ext import (
    EXT,
    UPSTREAM,
    FakeProcessGroupTestCase,
    FSDPExtTestMultiProcess,
    assert_bitwise_equal,
    assert_models_bitwise_equal,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing._internal.common_fsdp import FSDPTestMultiThread
from torch.testing._internal.common_utils import run_tests
from torch.utils._pytree import tree_map_only
from torchtitan.distributed import ParallelDims

import torch_fsdp_ext
from fsdp_ext_testing.moe import FeedForward
from fsdp_ext_testing.torchtitan import DebugRun, debug_config
from torch_fsdp_ext.torchtitan import FSDPExtSettings

try:
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )
except ImportError as e:  # optional: a base may exclude it (patches/<version>/base.toml)
    convert_to_float8_training = None
    TORCHAO_MISSING = f"torchao is not importable ({e})"

# The three arms: the implementation and its extra ``fully_shard`` kwargs
ARMS: dict[str, tuple[SimpleNamespace, dict[str, Any]]] = {
    "upstream": (UPSTREAM, {}),
    "grouped": (EXT, {"group_collectives": True}),
    "per-param": (EXT, {"group_collectives": False}),
}
# Bitwise comparisons: both of ours against upstream's
ALL_THREE = (("grouped", "upstream"), ("per-param", "upstream"))

# Threads of one process share the global RNG: seeding and building a model is
# one step under this lock, so every rank and arm builds the same parameters
_BUILD_LOCK = threading.Lock()


def build_seeded(build: Callable[[], nn.Module]) -> nn.Module:
    with _BUILD_LOCK:
        torch.manual_seed(42)
        return build()


def train_three_ways(
    test: Any,
    models: dict[str, nn.Module],
    make_input: Callable[[int], torch.Tensor],
    *,
    pairs: tuple[tuple[str, str], ...] = ALL_THREE,
    num_steps: int = 4,
    make_optim: Callable[[nn.Module], torch.optim.Optimizer] = lambda model: torch.optim.AdamW(
        model.parameters(), lr=1e-2, foreach=True
    ),
    after_optim_step: Callable[[nn.Module], None] = lambda model: None,
) -> list[float]:
    """Trains ``models`` side by side for ``num_steps`` steps on
    ``make_input(step)`` with ``out.sum()`` as the loss, and requires each pair
    in ``pairs`` bitwise equal: loss and sharded gradients after backward,
    sharded parameters after the optimizer step (and ``after_optim_step``).
    Returns the first model's losses, which must change (the optimizer moved
    the parameters)."""
    optims = {name: make_optim(model) for name, model in models.items()}
    losses = []
    for step in range(num_steps):
        inp = make_input(step)
        step_losses = {}
        for name, model in models.items():
            loss = model(inp).sum()
            loss.backward()
            step_losses[name] = loss.detach()
        for name, ref_name in pairs:
            what = f"step {step} {name} vs {ref_name}"
            assert_bitwise_equal(test, step_losses[name], step_losses[ref_name], f"{what}: loss")
            assert_models_bitwise_equal(
                test, models[name], models[ref_name], f"{what} after backward", grads=True
            )
        for name, optim in optims.items():
            optim.step()
            optim.zero_grad()
            after_optim_step(models[name])
        for name, ref_name in pairs:
            what = f"step {step} {name} vs {ref_name} after optim"
            assert_models_bitwise_equal(test, models[name], models[ref_name], what, grads=False)
        losses.append(next(iter(step_losses.values())).float().item())
    test.assertNotEqual(losses[0], losses[-1])
    return losses


# ---------------------------------------------------------------------------
# FSDP + TP: torchtitan's dense layout
# ---------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # Under TP each rank holds n_heads / tp heads: the view infers them
        q, k, v = (
            w(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A llama-style decoder at toy sizes, with torchtitan's module names."""

    def __init__(self, vocab: int = 32, dim: int = 16, n_heads: int = 4, hidden: int = 32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, hidden) for _ in range(2))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """torchtitan's llama TP plan: sequence parallel norms, column-wise
    q/k/v/w1/w3 and the output projection, row-wise wo/w2 and embeddings."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


class TestFullyShardTorchtitanTP(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_fsdp_tp_three_ways(self):
        """Tests that FSDP on "dp" over torchtitan's TP plan on "tp" of a 2x2
        mesh trains bitwise alike with upstream's fully_shard and ours grouped
        and per-parameter, with fp32 and with bf16 parameters and fp32
        reduction, and FSDP placement Shard(0) and Shard(1)
        (``shard_placement_fn``). The dp world size is 2, so all three are
        compared with default comms."""
        self.run_subtests(
            {"param_dtype": [None, torch.bfloat16], "fsdp_dim": [0, 1]},
            self._test_fsdp_tp_three_ways,
        )

    def _test_fsdp_tp_three_ways(self, param_dtype: torch.dtype | None, fsdp_dim: int):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        models = {}
        for name, (impl, extra) in ARMS.items():
            model = build_seeded(Transformer)
            apply_tp(model, mesh["tp"])
            kwargs = {
                "mesh": mesh["dp"],
                "mp_policy": impl.MixedPrecisionPolicy(
                    param_dtype=param_dtype, reduce_dtype=torch.float32
                ),
                "shard_placement_fn": lambda p: Shard(fsdp_dim) if p.ndim == 2 else None,
                **extra,
            }
            for block in model.layers:
                impl.fully_shard(block, **kwargs)
            impl.fully_shard(model, **kwargs)
            models[name] = model
        for param in models["per-param"].parameters():
            self.assertEqual(param.device_mesh.mesh_dim_names, ("dp", "tp"))
            # On TP's dim too FSDP shards that dim (a _StridedShard)
            self.assertEqual(param.placements[0].dim, fsdp_dim if param.ndim == 2 else 0)
        # TP ranks of one dp rank see the same tokens: seed 42 + dp rank
        gen = torch.Generator()
        dp_rank = mesh["dp"].get_local_rank()

        def make_input(step: int) -> torch.Tensor:
            gen.manual_seed(42 + dp_rank + 1000 * step)
            return torch.randint(32, (2, 8), generator=gen)

        train_three_ways(self, models, make_input)


# ---------------------------------------------------------------------------
# MoE: torchtitan's own expert placement (Shard(1) on the efsdp mesh)
# ---------------------------------------------------------------------------

TITAN_ARMS = {
    "upstream": None,
    "grouped": FSDPExtSettings(group_collectives=True),
    "per-param": FSDPExtSettings(group_collectives=False),
}
NUM_EXPERTS = 2


def tiny_moe_config(ep: int, num_steps: int) -> Any:
    """deepseek_v3's debug config with two layers (one dense, one MoE) and
    :data:`NUM_EXPERTS` routed experts, each token routed to one: with EP 2 on
    4 ranks, efsdp (2) * ep (2) exceeds the experts, so torchtitan's
    ``apply_fsdp_to_decoder`` shards them ``Shard(1)`` on the efsdp mesh."""
    config = debug_config("deepseek_v3", ep=ep, seq_len=16, steps=num_steps)
    model = config.model_spec.model
    model.layers = model.layers[:2]
    moe = model.layers[1].moe
    moe.num_experts = NUM_EXPERTS
    moe.routed_experts.inner_experts.num_experts = NUM_EXPERTS
    moe.routed_experts.token_dispatcher.num_experts = NUM_EXPERTS
    moe.routed_experts.token_dispatcher.top_k = 1
    moe.router.num_experts = NUM_EXPERTS
    moe.router.gate.out_features = NUM_EXPERTS
    moe.router.top_k = 1
    return config


@unittest.skipIf(torch.cuda.is_available(), "trains on CPU ranks over gloo")
class TestFullyShardTorchtitanMoEShard1(FSDPExtTestMultiProcess):
    # apply_cpu_shims patches torchtitan, whose spmd_types backend keeps the
    # meshes of a process's first ParallelDims
    own_processes = True

    @property
    def world_size(self) -> int:
        return 4

    @pytest.mark.slow
    def test_experts_shard1_on_efsdp_three_ways(self):
        """Tests that routed experts placed ``Shard(1)`` on the efsdp mesh by
        torchtitan's own ``apply_fsdp_to_decoder`` (its ``shard_placement_fn``
        returns torch's ``ShardPlacementResult`` when efsdp * ep exceeds the
        experts: 2 * 2 > 2) train bitwise alike with upstream's fully_shard and
        ours grouped and per-parameter: losses, gradient norms and every
        rank's parameter and gradient shards at every step (gloo W=4, EP 2,
        bf16 parameters, default comms)."""
        num_steps = 3
        parallel_dims = ParallelDims.from_config(
            tiny_moe_config(2, num_steps).parallelism, self.world_size
        )
        runs = {
            name: DebugRun(tiny_moe_config(2, num_steps), parallel_dims, fsdp, seed=42)
            for name, fsdp in TITAN_ARMS.items()
        }
        for name, run in runs.items():
            experts = run.model.layers["1"].moe.routed_experts.inner_experts
            for param in experts.parameters():
                # (efsdp, ep) with FSDP's Shard(1) on efsdp: torchtitan's placement reached us
                self.assertEqual(param.device_mesh.mesh_dim_names, ("efsdp", "ep"), msg=name)
                self.assertEqual(param.placements[0], Shard(1), msg=name)
            modules = [m for m in run.model.modules() if isinstance(m, upstream_fsdp.FSDPModule)]
            self.assertEqual(
                all(isinstance(m, torch_fsdp_ext.FSDPModule) for m in modules), name != "upstream"
            )
        ref = runs["upstream"]
        vocab = ref.model_config.vocab_size
        shape = (ref.config.training.local_batch_size, ref.config.training.seq_len + 1)
        losses = []
        for step in range(num_steps):
            gen = torch.Generator().manual_seed(42 + self.rank + 1000 * step)
            tokens = torch.randint(vocab, shape, generator=gen)
            results = {name: run.step(tokens) for name, run in runs.items()}
            for name, ref_name in ALL_THREE:
                what = f"step {step} {name} vs {ref_name}"
                (loss, norm), (ref_loss, ref_norm) = results[name], results[ref_name]
                assert_bitwise_equal(self, loss, ref_loss, f"{what}: loss")
                assert_bitwise_equal(self, norm, ref_norm, f"{what}: grad norm")
                assert_models_bitwise_equal(
                    self, runs[name].model, runs[ref_name].model, what, grads=True
                )
            losses.append(results["upstream"][0].item())
        self.assertNotEqual(losses[0], losses[-1])


# ---------------------------------------------------------------------------
# All-gather extensions
# ---------------------------------------------------------------------------


class WrapperTensor(torch.Tensor):
    """A tensor subclass around one plain tensor, ``_data``, on which every op
    runs; results are wrapped again. FSDP shards it like a plain parameter
    and, because of the ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` of
    the subclasses below, all-gathers what those return."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> WrapperTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data
        self.extension_calls: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, metadata, outer_size, outer_stride):
        return cls(inner_tensors["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped_args, unwrapped_kwargs = tree_map_only(
            WrapperTensor, lambda t: t._data, (args, kwargs or {})
        )
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func._schema.is_mutable:
            # In place (copy_, the optimizers' foreach ops): the wrapper is the result
            return args[0] if isinstance(out, torch.Tensor) else out
        return tree_map_only(torch.Tensor, cls, out)


def _param_dtype(tensor: torch.Tensor, mp_policy: Any) -> torch.dtype:
    return mp_policy.param_dtype or tensor.dtype


def _count(tensor: WrapperTensor, what: str, out: torch.Tensor | None = None) -> None:
    # The test requires that FSDP called the extension, and all-gathered into
    # existing storage (``out=``) too: counted on the sharded local tensor
    what = f"{what}_out" if out is not None else what
    tensor.extension_calls[what] = tensor.extension_calls.get(what, 0) + 1


class OneInputTensor(WrapperTensor):
    """All-gathers one tensor, cast to the param dtype before the all-gather;
    the unsharded parameter is the all-gather output itself, so a later
    all-gather into the same storage (``out=``) needs nothing more."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _count(self, "pre")
        return (self._data.to(_param_dtype(self, mp_policy)),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        _count(self, "post", out)
        (output,) = all_gather_outputs
        if out is not None:
            return None
        return output, (output,)


class TwoInputTensor(WrapperTensor):
    """All-gathers two tensors of different dtypes per parameter: the bf16
    rounding of the shard and the fp32 remainder (exact, so their sum is the
    parameter). The unsharded parameter is computed from both, so an
    all-gather into existing storage (``out=``) writes it in place."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _count(self, "pre")
        high = self._data.to(torch.bfloat16)
        return (high, self._data - high.to(self._data.dtype)), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        _count(self, "post", out)
        high, low = all_gather_outputs
        unsharded = (high.to(low.dtype) + low).to(param_dtype)
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(unsharded)
            return None
        return unsharded, (unsharded,)


class MetadataTensor(WrapperTensor):
    """All-gathers the shard's bytes (``uint8``); the metadata carries the
    dtype they encode, without which the output cannot be read back."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        _count(self, "pre")
        data = self._data.to(_param_dtype(self, mp_policy))
        return (data.view(torch.uint8),), {"dtype": data.dtype}

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        _count(self, "post", out)
        (output,) = all_gather_outputs
        if output.dtype != torch.uint8 or metadata["dtype"] != param_dtype:
            raise AssertionError(f"{output.dtype=} {metadata=} {param_dtype=}")
        if out is not None:
            return None
        unsharded = output.view(metadata["dtype"])
        return unsharded, (unsharded,)


EXTENSIONS = {cls.__name__: cls for cls in (OneInputTensor, TwoInputTensor, MetadataTensor)}


def extension_mlp(cls: type[WrapperTensor]) -> nn.Module:
    """Two linears whose weights are ``cls``; biases stay plain."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    for linear in (model[0], model[2]):
        linear.weight = nn.Parameter(cls(linear.weight.detach()))
    return model


class TestFullyShardTorchtitanAllGatherExtensions(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_extensions_three_ways(self):
        """Tests that parameters whose local tensors define
        ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` train bitwise alike
        with upstream's fully_shard and ours grouped and per-parameter: one
        all-gather input per parameter, two inputs of different dtypes, and
        metadata passed from pre to post; fp32 and bf16 parameters (W=2,
        default comms)."""
        self.run_subtests(
            {"extension": list(EXTENSIONS), "param_dtype": [None, torch.bfloat16]},
            self._test_extensions_three_ways,
        )

    def _test_extensions_three_ways(self, extension: str, param_dtype: torch.dtype | None):
        cls = EXTENSIONS[extension]
        models = {}
        for name, (impl, extra) in ARMS.items():
            model = build_seeded(functools.partial(extension_mlp, cls))
            mp_policy = impl.MixedPrecisionPolicy(param_dtype=param_dtype)
            for linear in (model[0], model[2]):
                impl.fully_shard(linear, mp_policy=mp_policy, **extra)
            impl.fully_shard(model, mp_policy=mp_policy, **extra)
            models[name] = model
        gen = torch.Generator()

        def make_input(step: int) -> torch.Tensor:
            gen.manual_seed(42 + self.rank + 1000 * step)
            return torch.randn(4, 16, generator=gen)

        train_three_ways(self, models, make_input)
        for name, model in models.items():
            for linear in (model[0], model[2]):
                local = linear.weight._local_tensor  # to_local() is a view: a new wrapper
                self.assertIsInstance(local, cls)
                # Forward and backward all-gathers, each pre's output reaching a post
                calls = local.extension_calls
                self.assertGreater(calls.get("post_out", 0), 0, msg=f"{name}: {calls}")
                self.assertEqual(calls["pre"], calls.get("post", 0) + calls["post_out"], msg=name)


# ---------------------------------------------------------------------------
# torch's own policy classes
# ---------------------------------------------------------------------------


class TestFullyShardTorchtitanUpstreamPolicies(FakeProcessGroupTestCase):
    def test_torch_policies_take_effect(self):
        """Tests that torch's ``CPUOffloadPolicy``, ``OffloadPolicy``,
        ``MixedPrecisionPolicy`` and ``DataParallelMeshDims``, given directly to
        ``torch_fsdp_ext.fully_shard``, act as ours: the copy checks its own
        classes, so unconverted, torch's ``CPUOffloadPolicy`` silently did not
        offload (regression test)."""
        mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("dp",))

        def override(param: nn.Parameter) -> torch.dtype | None:
            return torch.float32 if param.ndim == 1 else None

        fields = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
        if "param_dtype_override_fn" in {
            f.name for f in dataclasses.fields(upstream_fsdp.MixedPrecisionPolicy)
        }:
            fields["param_dtype_override_fn"] = override  # torch >= 2.15
        for offload_policy, offloads in (
            (upstream_fsdp.CPUOffloadPolicy(pin_memory=False), True),
            (upstream_fsdp.OffloadPolicy(), False),
        ):
            module = torch_fsdp_ext.fully_shard(
                # dp_mesh_dims wants DTensor parameters on the whole mesh
                distribute_module(nn.Linear(8, 8), mesh),
                mesh=mesh,
                mp_policy=upstream_fsdp.MixedPrecisionPolicy(**fields),
                offload_policy=offload_policy,
                dp_mesh_dims=upstream_fsdp.DataParallelMeshDims(shard="dp"),
            )
            state = module._get_fsdp_state()
            group = state._fsdp_param_group
            self.assertEqual([p.offload_to_cpu for p in group.fsdp_params], [offloads] * 2)
            expected_cls = (
                torch_fsdp_ext.CPUOffloadPolicy if offloads else torch_fsdp_ext.OffloadPolicy
            )
            self.assertIs(type(group.offload_policy), expected_cls)
            self.assertIs(type(state._mp_policy), torch_fsdp_ext.MixedPrecisionPolicy)
            # Resolved per parameter: the bias kept in fp32 where torch has the override
            bias_dtype = torch.float32 if "param_dtype_override_fn" in fields else torch.bfloat16
            for fsdp_param, param_dtype in zip(
                group.fsdp_params, (torch.bfloat16, bias_dtype), strict=True
            ):
                self.assertIs(type(fsdp_param.mp_policy), torch_fsdp_ext.MixedPrecisionPolicy)
                self.assertEqual(fsdp_param.mp_policy.param_dtype, param_dtype)
                self.assertEqual(fsdp_param.mp_policy.reduce_dtype, torch.float32)
            self.assertEqual(
                state._mesh_info.dp_mesh_dims, torch_fsdp_ext.DataParallelMeshDims(shard="dp")
            )


class TestFullyShardTorchtitanUpstreamPoliciesTraining(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_torch_policies_three_ways(self):
        """Tests that with torch's own ``MixedPrecisionPolicy`` (bf16
        parameters, fp32 reduction) and ``CPUOffloadPolicy`` objects in every
        arm, as torchtitan passes them, ours grouped and per-parameter train
        bitwise alike with upstream's fully_shard and offload (W=2, default comms)."""
        mp_policy = upstream_fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        offload_policy = upstream_fsdp.CPUOffloadPolicy(pin_memory=False)
        models = {}
        for name, (impl, extra) in ARMS.items():
            model = build_seeded(Transformer)
            kwargs = {"mp_policy": mp_policy, "offload_policy": offload_policy, **extra}
            for block in model.layers:
                impl.fully_shard(block, **kwargs)
            impl.fully_shard(model, **kwargs)
            models[name] = model
        for name in ("grouped", "per-param"):
            for module in models[name].modules():
                if isinstance(module, torch_fsdp_ext.FSDPModule):
                    for fsdp_param in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
                        self.assertTrue(fsdp_param.offload_to_cpu, msg=name)
        gen = torch.Generator()

        def make_input(step: int) -> torch.Tensor:
            gen.manual_seed(42 + self.rank + 1000 * step)
            return torch.randint(32, (2, 8), generator=gen)

        train_three_ways(self, models, make_input)


def float8_mlp() -> nn.Module:
    """torchao's float8 training linears (dims divisible by 16) with the
    float8 all-gather: weights are ``WeightWithDynamicFloat8CastTensor``."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


@unittest.skipIf(convert_to_float8_training is None, globals().get("TORCHAO_MISSING", ""))
class TestFullyShardTorchtitanFloat8AllGather(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_float8_all_gather_three_ways(self):
        """Tests that torchao's float8 all-gather (``enable_fsdp_float8_all_gather``,
        as torchtitan's float8 converter sets it) trains bitwise alike with
        upstream's fully_shard and ours grouped and per-parameter: weights cast
        to float8 in ``fsdp_pre_all_gather`` with an amax all-reduce per
        weight, or with the scales from ``precompute_float8_dynamic_scale_for_fsdp``
        after each optimizer step; fp32 and bf16 parameters (W=2, default comms)."""
        self.run_subtests(
            {"precompute_scales": [False, True], "param_dtype": [None, torch.bfloat16]},
            self._test_float8_all_gather_three_ways,
        )

    def _test_float8_all_gather_three_ways(
        self, precompute_scales: bool, param_dtype: torch.dtype | None
    ):
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        models = {}
        for name, (impl, extra) in ARMS.items():
            model = build_seeded(float8_mlp)
            mp_policy = impl.MixedPrecisionPolicy(param_dtype=param_dtype)
            for linear in (model[0], model[2]):
                impl.fully_shard(linear, mp_policy=mp_policy, **extra)
            impl.fully_shard(model, mp_policy=mp_policy, **extra)
            for linear in (model[0], model[2]):
                self.assertIsInstance(
                    linear.weight._local_tensor, WeightWithDynamicFloat8CastTensor
                )
            models[name] = model
        gen = torch.Generator()

        def make_input(step: int) -> torch.Tensor:
            gen.manual_seed(42 + self.rank + 1000 * step)
            return torch.randn(16, 32, generator=gen)

        train_three_ways(
            self,
            models,
            make_input,
            after_optim_step=precompute_float8_dynamic_scale_for_fsdp
            if precompute_scales
            else lambda model: None,
        )


if __name__ == "__main__":
    run_tests()
