#!/usr/bin/env python3
"""Measure what FSDP's cross-rank consistency check costs at lazy init.

Spawns CPU ranks (gloo), shards a model with torch_fsdp_ext, runs one forward
(lazy init, which runs the check once), then times the check alone: building
every parameter group's fingerprint, one ``all_gather_object`` of a 16-byte
digest per mesh, and the comparison. Prints the median and maximum over
``--repeat`` runs on rank 0 (and the median of the local part alone), the pickled payload each rank contributes, and the
number of FSDP modules, parameter groups, parameters and meshes.

Models:
  moe      the MoE demo model (tools/moe_demo.py defaults; experts on the efsdp
           mesh, the rest on dp), per-parameter collectives
  llama-m  a Llama-shaped dense model of --layers blocks (attention wq/wk/wv/wo,
           FFN w1/w2/w3, two RMSNorms each; embedding, final norm, output), one
           FSDP module per block. The check's cost depends on the number of
           parameters, not their size, so --dim is small.
"""

from __future__ import annotations

import argparse
import logging
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import rank_rows  # noqa: E402

log = logging.getLogger("torch_fsdp_ext.rank_check_cost")


class _LlamaBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1, self.w3 = (nn.Linear(dim, 4 * dim, bias=False) for _ in range(2))
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        x = x + self.wo(self.wq(h) * torch.sigmoid(self.wk(h)) + self.wv(h))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class _Llama(nn.Module):
    def __init__(self, layers: int, dim: int, vocab: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_LlamaBlock(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _build(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor]:
    import torch_fsdp_ext
    from torch_fsdp_ext._testing import moe

    if args.model == "moe":
        model_args = moe.MoEArgs()
        meshes = moe.build_meshes("cpu", args.world_size // 2, 2)
        model = moe.build_model(model_args, "per-param", meshes)
        return model, torch.randint(model_args.vocab, (2, 16))
    torch.manual_seed(42)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (args.world_size,))
    model = _Llama(args.layers, args.dim, vocab=64)
    for layer in model.layers:
        torch_fsdp_ext.fully_shard(layer, mesh=mesh, group_collectives=False)
    torch_fsdp_ext.fully_shard(model, mesh=mesh, group_collectives=False)
    return model, torch.randint(64, (2, 16))


def _worker(rank: int, args: argparse.Namespace, store_path: str, queue) -> None:
    from torch_fsdp_ext._fully_shard import _fsdp_rank_check

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.world_size)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, store=store)
    model, tokens = _build(args)
    dist.barrier()
    start = time.perf_counter()
    model(tokens)  # lazy init, with the check
    first_forward = time.perf_counter() - start
    state = model._get_fsdp_state()
    seconds = []
    for _ in range(args.repeat):
        dist.barrier()
        start = time.perf_counter()
        state._check_rank_consistency()
        seconds.append(time.perf_counter() - start)
    groups = [g for s in state._state_ctx.all_states for g in s._fsdp_param_groups]
    local_seconds = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        by_mesh = _fsdp_rank_check._fingerprints(groups)
        _fsdp_rank_check._digests(by_mesh)
        local_seconds.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(
            {
                "median_ms": 1e3 * statistics.median(seconds),
                "max_ms": 1e3 * max(seconds),
                "local_ms": 1e3 * statistics.median(local_seconds),
                "first_forward_ms": 1e3 * first_forward,
                "payload_bytes": len(pickle.dumps(_fsdp_rank_check._digests(by_mesh))),
                "fingerprint_bytes": len(pickle.dumps(by_mesh)),
                "fsdp_modules": len(state._state_ctx.all_states),
                "groups": len(groups),
                "params": sum(len(g.fsdp_params) for g in groups),
                "meshes": len(by_mesh),
            }
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("moe", "llama-m"), default="moe")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=32, help="llama-m blocks")
    parser.add_argument("--dim", type=int, default=64, help="llama-m width")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if args.model == "moe" and args.world_size % 2:
        parser.error("the MoE model runs expert parallel over 2 ranks: use an even --world-size")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info(
        "timing the check %d times on %d CPU ranks (gloo), model %s",
        args.repeat,
        args.world_size,
        args.model,
    )
    (row,) = rank_rows(_worker, args, args.world_size, rows=1)
    log.info(
        "%s: %d FSDP modules, %d parameter groups, %d parameters, %d meshes per rank",
        args.model,
        row["fsdp_modules"],
        row["groups"],
        row["params"],
        row["meshes"],
    )
    log.info(
        "check: median %.2f ms, max %.2f ms (of which fingerprints and digests, no "
        "communication: median %.2f ms); all_gather_object payload %d B per rank (full "
        "fingerprints, exchanged only on a mismatch: %d B)",
        row["median_ms"],
        row["max_ms"],
        row["local_ms"],
        row["payload_bytes"],
        row["fingerprint_bytes"],
    )
    log.info(
        "for scale: the first forward (lazy init and the check) took %.0f ms",
        row["first_forward_ms"],
    )


if __name__ == "__main__":
    main()
