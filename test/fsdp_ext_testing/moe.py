"""A tiny DeepSeek-V3-like MoE transformer with expert parallelism, sharded
three ways with FSDP2; shared by ``tools/demos/moe.py``, ``tools/bench/`` and
``test/package/test_moe.py``.

Layout, as torchtitan builds it: a world mesh with dims ``("efsdp", "ep")``.
Routed experts are 3-D grouped parameters, DTensors ``Shard(0)`` on the "ep"
sub-mesh (each ep rank holds ``num_experts / ep`` experts), and FSDP shards
them with ``Shard(1)`` on the "efsdp" sub-mesh. Every other parameter is a
plain tensor that FSDP shards with ``Shard(0)`` on the flattened "dp" mesh
(all ranks).

The three wrappings (:data:`MODES`) of each block, then the root:

- ``old``: ``fully_shard(block.moe.experts, mesh=efsdp, Shard(1))``, then
  ``fully_shard(block, mesh=dp)``: two FSDP modules per block. It uses
  ``torch_fsdp_ext`` (grouped, bitwise upstream's implementation) so that only
  the wrapping differs: upstream torch 2.13 divides expert gradients twice on
  a 1-rank efsdp mesh, which the series' 1-rank divide patch fixes.
- ``grouped``: ``torch_fsdp_ext.fully_shard(block, mesh=dp, shard_placement_fn=...)``
  where the function puts expert parameters on the efsdp mesh
  (``ShardPlacementResult``): one FSDP module, two parameter groups.
- ``per-param``: ``grouped`` with ``group_collectives=False``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import torch_fsdp_ext
from fsdp_ext_testing.comm_recorder import CommRecorder

MODES = ("old", "grouped", "per-param")


@dataclass
class MoEArgs:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    num_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 32
    shared_hidden: int = 32
    score_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    """SwiGLU MLP: the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k = top_k
        self.score_func = score_func

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: (tokens, dim) -> routing weights and expert indices, (tokens, top_k)."""
        logits = self.gate(x)
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        weights, indices = scores.topk(self.top_k, dim=-1)
        if self.score_func == "sigmoid":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices


def _all_gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.size(0) * group.size(), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.size(0) // group.size(), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _AllGatherTokens(torch.autograd.Function):
    """All-gathers dim 0 over the ep group; backward reduce-scatters the gradient.

    Synchronous c10d collectives, not the asynchronous functional collectives
    (``funcol.all_gather_single_autograd``): on gloo, an all-gather of
    ``torch.distributed._functional_collectives`` that is in flight while the
    caller keeps computing corrupts the heap now and then (torch 2.13; the
    upstream report and a reproduction without FSDP are in
    ``docs/upstream-gloo-funcol-heap-corruption.md``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_tokens(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_tokens(grad, ctx.group), None


class _ReduceScatterTokens(torch.autograd.Function):
    """Sum-reduce-scatters dim 0 over the ep group; backward all-gathers the
    gradient. Synchronous for the reason given in :class:`_AllGatherTokens`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_tokens(grad, ctx.group), None


class GroupedExperts(nn.Module):
    """Routed SwiGLU experts as 3-D parameters, one slice per expert.

    With expert parallelism (:func:`apply_expert_parallel`) the parameters are
    DTensors ``Shard(0)`` on the ep mesh. The forward all-gathers every ep
    rank's tokens, applies the local experts to the tokens routed to them and
    reduce-scatters the weighted outputs back (see :class:`_AllGatherTokens`).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, dim, hidden) * dim**-0.5)
        self.ep_mesh: DeviceMesh | None = None

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        if self.ep_mesh is None or self.ep_mesh.size() == 1:
            return self._local_experts(x, weights, indices)
        group = self.ep_mesh.get_group()
        x = _AllGatherTokens.apply(x, group)
        weights = _AllGatherTokens.apply(weights, group)
        indices = _all_gather_tokens(indices, group)
        out = self._local_experts(x, weights, indices)
        return _ReduceScatterTokens.apply(out, group)

    def _local_experts(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        # FSDP's unsharded parameters are DTensors on the ep mesh: compute on
        # this rank's experts
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)
        )
        num_local = w1.shape[0]
        first = 0 if self.ep_mesh is None else self.ep_mesh.get_local_rank() * num_local
        out = torch.zeros_like(x)
        for e in range(num_local):
            tokens, slots = (indices == first + e).nonzero(as_tuple=True)
            h = x[tokens]
            y = (F.silu(h @ w1[e]) * (h @ w3[e])) @ w2[e]
            out = out.index_add(0, tokens, y * weights[tokens, slots, None])
        return out


class MoE(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.router = TopKRouter(args.dim, args.num_experts, args.top_k, args.score_func)
        self.experts = GroupedExperts(args.dim, args.expert_hidden, args.num_experts)
        self.shared_expert = FeedForward(args.dim, args.shared_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.router(x)
        out = self.experts(x, weights, indices) + self.shared_expert(x)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.dim)
        self.attn = Attention(args.dim, args.heads)
        self.moe_norm = nn.RMSNorm(args.dim)
        self.moe = MoE(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on ``tokens`` of shape (batch, seq + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@dataclass
class MoEMeshes:
    world: DeviceMesh  # ("efsdp", "ep")
    dp: DeviceMesh  # all ranks, flattened: dense parameters
    efsdp: DeviceMesh  # expert parameters' FSDP dim
    ep: DeviceMesh  # expert parallel dim

    def name_of(self, group: dist.ProcessGroup) -> str | None:
        for name in ("dp", "efsdp", "ep"):
            if getattr(self, name).get_group().group_name == group.group_name:
                return name
        return None


def build_meshes(device_type: str, efsdp: int, ep: int) -> MoEMeshes:
    world = init_device_mesh(device_type, (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
    return MoEMeshes(world, world["efsdp", "ep"]._flatten("dp"), world["efsdp"], world["ep"])


def apply_expert_parallel(model: MoETransformer, meshes: MoEMeshes) -> None:
    """Make every routed expert parameter a DTensor ``Shard(0)`` on the ep mesh.

    Every rank built the model from the same seed, so each keeps its own
    experts' slice of the full parameter.
    """
    ep = meshes.ep
    for layer in model.layers:
        experts = layer.moe.experts
        for name, param in list(experts.named_parameters()):
            local = param.detach().chunk(ep.size(), dim=0)[ep.get_local_rank()].clone()
            dtensor = DTensor.from_local(local, ep, [Shard(0)], run_check=False)
            experts.register_parameter(name, nn.Parameter(dtensor))
        experts.ep_mesh = ep


def is_expert_param(param: nn.Parameter) -> bool:
    # Only routed experts are DTensors before fully_shard (apply_expert_parallel)
    return isinstance(param, DTensor)


def expert_placement(meshes: MoEMeshes) -> torch_fsdp_ext.ShardPlacementResult:
    """Where expert parameters go: ``Shard(1)`` on the efsdp mesh.

    The one place that builds the placement; all expert parameters share it.
    """
    return torch_fsdp_ext.ShardPlacementResult(Shard(1), mesh=meshes.efsdp)


def shard_model(
    model: MoETransformer, mode: str, meshes: MoEMeshes, *, upstream: bool = False
) -> MoETransformer:
    """Shard every block, then the root, the way ``mode`` (one of :data:`MODES`) says.

    Every FSDP module divides gradients by the dp size, as torchtitan's
    ``fsdp_gradient_divide_factor``: an expert's gradient already sums the
    tokens of its whole ep group (the backward of the token all-gather), so
    dividing by the efsdp size alone would scale it by ep.

    ``upstream`` shards with ``torch.distributed.fsdp.fully_shard`` instead of
    ``torch_fsdp_ext.fully_shard``; only ``old`` can, the other wrappings need
    per-parameter meshes.
    """
    if upstream and mode != "old":
        raise ValueError(f"upstream fully_shard has no per-parameter meshes for mode {mode!r}")
    if mode == "old":
        fully_shard = upstream_fsdp.fully_shard if upstream else torch_fsdp_ext.fully_shard
        for layer in model.layers:
            fully_shard(layer.moe.experts, mesh=meshes.efsdp, shard_placement_fn=lambda p: Shard(1))
            fully_shard(layer, mesh=meshes.dp)
        fully_shard(model, mesh=meshes.dp)
    elif mode in MODES:
        placement = expert_placement(meshes)
        kwargs: dict[str, Any] = {
            "mesh": meshes.dp,
            "shard_placement_fn": lambda p: placement if is_expert_param(p) else None,
            "group_collectives": mode == "grouped",
        }
        for layer in model.layers:
            torch_fsdp_ext.fully_shard(layer, **kwargs)
        torch_fsdp_ext.fully_shard(model, **kwargs)
    else:
        raise ValueError(f"mode must be one of {MODES} but got {mode!r}")
    for module in model.modules():
        if isinstance(module, upstream_fsdp.FSDPModule):
            module.set_gradient_divide_factor(float(meshes.dp.size()))
            # gloo has no PREMUL_SUM: sum, then divide (the user's knob on CPU)
            if meshes.dp.device_type == "cpu":
                module.set_force_sum_reduction_for_comms(True)
    return model


def build_model(
    args: MoEArgs, mode: str | None, meshes: MoEMeshes, *, seed: int = 42
) -> MoETransformer:
    """The model from ``seed`` with expert parallelism, sharded as ``mode`` (or not if None)."""
    torch.manual_seed(seed)
    model = MoETransformer(args).to(meshes.world.device_type)
    apply_expert_parallel(model, meshes)
    return model if mode is None else shard_model(model, mode, meshes)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _deterministic_reduce_scatter_for(group: object) -> torch_fsdp_ext.DeterministicReduceScatter:
    return torch_fsdp_ext.DeterministicReduceScatter()


def set_deterministic_reduce_scatter(model: nn.Module) -> None:
    """Give every FSDP module ``DeterministicReduceScatter``; with per-parameter
    meshes it serves each parameter group on that group's mesh."""
    for module in model.modules():
        if isinstance(module, torch_fsdp_ext.FSDPModule):
            # Several param groups (per-parameter meshes, which torch 2.9's
            # series lacks) take a comm factory, one comm per group
            groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", ())
            module.set_custom_reduce_scatter(
                _deterministic_reduce_scatter_for
                if len(groups) > 1
                else torch_fsdp_ext.DeterministicReduceScatter()
            )


class FSDPCollectiveTrace(CommRecorder):
    """FSDP's all-gathers and reduce-scatters of a region, in order, as the
    demo prints and the tests pin them.

    Each entry is ``(phase, op, owner, kind, numels)``: ``owner`` is the block
    (``"block1"``) or ``"root"`` from the FSDP ``record_function`` label that
    encloses the collective, ``kind`` is ``"dense"`` (dp mesh) or ``"experts"``
    (efsdp mesh), and ``numels`` the input numel of each tensor, several for a
    coalesced op. Collectives on other groups (ep) are skipped.
    """

    def __init__(self, meshes: MoEMeshes):
        super().__init__()
        self.meshes = meshes

    @property
    def entries(self) -> list[tuple[str, str, str, str, tuple[int, ...]]]:
        entries = []
        for c in self.collectives:
            mesh_name = self.meshes.name_of(c.group)
            if mesh_name in ("dp", "efsdp"):
                kind = "dense" if mesh_name == "dp" else "experts"
                entries.append((c.phase, c.kind, _owner(c.labels), kind, c.input_numels))
        return entries

    def order(self, phase: str, ops: tuple[str, ...] = ("all_gather",)) -> str:
        """``"block1.dense, block1.experts, ..."``: the collectives of ``ops`` in
        ``phase``, each prefixed ``AG``/``RS`` if ``ops`` has several; a run of
        one-per-parameter ops of one group reads ``"RS block1.dense x8"``."""
        # DeterministicReduceScatter reduce-scatters with an all-to-all
        short = {"all_gather": "AG ", "reduce_scatter": "RS ", "all_to_all": "RS "}
        names = [
            f"{short[c] if len(ops) > 1 else ''}{o}.{k}"
            for p, c, o, k, _ in self.entries
            if p == phase and c in ops
        ]
        runs = [(name, len(list(run))) for name, run in itertools.groupby(names)]
        return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in runs)

    def lines(self) -> str:
        """One line per collective: ``phase op owner.kind numels`` (``a+b`` if coalesced)."""
        return "\n".join(
            f"{p} {c} {o}.{k} {'+'.join(map(str, n))}" for p, c, o, k, n in self.entries
        )


def _owner(labels: tuple[str, ...]) -> str:
    for label in reversed(labels):
        if label.startswith("FSDP::"):
            match = re.search(r"\(layers\.(\d+)", label)
            return f"block{match.group(1)}" if match else "root"
    return "?"
