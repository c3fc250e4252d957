"""The models the bench trains: Llama-like transformers, the residual MLP
stack, chains of equal square parameters (and the sweep of them), the MoE
transformer. A :class:`ModelSpec` builds one from seed 42, sharded with a mode
on its mesh, and gives its input and loss.

``Transformer`` comes from ``test/fsdp_ext_testing/models.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_ext_testing import moe
from fsdp_ext_testing.memory import LossFn, sum_loss
from fsdp_ext_testing.models import Model, Transformer

from .modes import Mode, shard, shard_moe


class LinearChain(nn.Module):
    """``num_params`` bias-free ``Linear(dim, dim)`` layers in a row: one
    parameter group (``fully_shard`` on the root only) of equal-size params.

    Weights are drawn with std ``dim ** -0.5`` so activations keep their scale
    through hundreds of layers."""

    def __init__(self, num_params: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(num_params))
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "llama", "mlp", "chain" or "moe"
    config: dict[str, int]
    description: str

    def runs_at(self, world_size: int) -> bool:
        """Whether the model can be sharded on ``world_size`` ranks."""
        if self.kind != "moe":
            return True
        # One efsdp rank would leave the experts unsharded, and upstream torch
        # 2.13 divides their gradients twice there
        ep = self.config["ep"]
        return world_size % ep == 0 and world_size // ep >= 2

    def mesh(self, device_type: str, world_size: int) -> DeviceMesh | moe.MoEMeshes:
        """A 1-D mesh of all ranks; for the MoE model its (efsdp, ep) meshes."""
        if self.kind == "moe":
            ep = self.config["ep"]
            return moe.build_meshes(device_type, world_size // ep, ep)
        return init_device_mesh(device_type, (world_size,))

    def build(self, mode: Mode, mesh: DeviceMesh | moe.MoEMeshes, mp: str = "fp32") -> nn.Module:
        """The model from seed 42 on ``mesh``'s device type, sharded as ``mode`` and
        ``mp`` (a ``modes.MIXED_PRECISION`` name; dense models only) say."""
        c = self.config
        if self.kind == "moe":
            if mp != "fp32":
                raise ValueError(f"--mp {mp}: the moe model runs in fp32 only")
            args = moe.MoEArgs(
                vocab=c["vocab"],
                dim=c["dim"],
                heads=c["heads"],
                layers=c["layers"],
                num_experts=c["experts"],
                top_k=c["top_k"],
            )
            return shard_moe(moe.build_model(args, None, mesh, seed=42), mode, mesh)
        torch.manual_seed(42)
        if self.kind == "llama":
            model = Transformer(c["vocab"], c["dim"], c["heads"], c["layers"])
        elif self.kind == "mlp":
            model = Model(c["dim"], c["hidden"], c["blocks"])
        else:
            model = LinearChain(c["num_params"], c["dim"])
        model.to(mesh.device_type)
        # Blocks get their own fully_shard before the root
        return shard(model, mode, list(model.blocks) if self.kind != "chain" else [], mesh, mp)

    def make_input(self, rank: int, device: torch.device) -> torch.Tensor:
        c = self.config
        gen = torch.Generator().manual_seed(42 + rank)
        if self.kind == "llama":
            inp = torch.randint(c["vocab"], (c["batch"], c["seq"]), generator=gen)
        elif self.kind == "moe":
            # moe.loss_fn predicts each next token: seq + 1 tokens per row
            inp = torch.randint(c["vocab"], (c["batch"], c["seq"] + 1), generator=gen)
        else:
            inp = torch.randn(c["batch"], c["dim"], generator=gen)
        return inp.to(device)

    @property
    def loss_fn(self) -> LossFn:
        """``loss_fn(model, inp)``: next-token cross entropy for the MoE model,
        the output's sum otherwise."""
        return moe.loss_fn if self.kind == "moe" else sum_loss


def _llama(name: str, vocab: int, dim: int, heads: int, layers: int, batch: int, seq: int):
    return ModelSpec(
        name,
        "llama",
        dict(vocab=vocab, dim=dim, heads=heads, layers=layers, batch=batch, seq=seq),
        f"transformer (test/fsdp_ext_testing/models.py): vocab {vocab}, dim {dim}, {heads} heads, "
        f"{layers} blocks, batch {batch}x{seq} tokens; fully_shard per block + root",
    )


def _chain(name: str, num_params: int, dim: int, batch: int) -> ModelSpec:
    return ModelSpec(
        name,
        "chain",
        dict(num_params=num_params, dim=dim, batch=batch),
        f"{num_params} params of {dim}x{dim} in one group, batch {batch}",
    )


MODELS = {
    spec.name: spec
    for spec in (
        _llama("llama-S", vocab=512, dim=128, heads=4, layers=2, batch=4, seq=32),
        _llama("llama-M", vocab=1024, dim=256, heads=8, layers=4, batch=4, seq=64),
        ModelSpec(
            "mlp",
            "mlp",
            dict(dim=256, hidden=1024, blocks=3, batch=4),
            "residual MLP stack of test/fsdp_ext_testing/models.py (dim 256, hidden 1024, "
            "3 blocks, batch 4; the model of test/package/test_per_param_memory.py): "
            "parameters outweigh activations; fully_shard per block + root",
        ),
        _chain("many-small", num_params=64, dim=64, batch=32),
        _chain("few-large", num_params=2, dim=2048, batch=8),
        ModelSpec(
            "moe",
            "moe",
            dict(vocab=64, dim=32, heads=4, layers=2, experts=4, top_k=2, ep=2, batch=2, seq=16),
            "MoE transformer of test/fsdp_ext_testing/moe.py at tools/demos/moe.py's sizes: "
            "vocab 64, dim 32, 4 heads, 2 blocks of 4 routed experts (top 2) + a shared "
            "expert, batch 2x16 tokens; experts Shard(0) on ep 2 and Shard(1) on efsdp W/2, the "
            "rest on all ranks; upstream: fully_shard(experts) + fully_shard(block) + root, the "
            "other modes: fully_shard per block (expert params on efsdp) + root",
        ),
    )
}
# The sweep: one group of n square params with a fixed total of 2**20
# elements (4 MiB fp32), so FLOPs per step are the same at every point
SWEEP_TOTAL_NUMEL = 1 << 20
SWEEP_BATCH = 16


def sweep_spec(num_params: int) -> ModelSpec:
    dim = math.isqrt(SWEEP_TOTAL_NUMEL // num_params)
    assert dim * dim * num_params == SWEEP_TOTAL_NUMEL, num_params
    return _chain(f"sweep-{num_params}", num_params, dim, SWEEP_BATCH)
