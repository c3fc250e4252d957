#!/usr/bin/env python3
"""Reproduce heap corruption with functional collectives on gloo, without FSDP.

Four CPU ranks on gloo, two expert-parallel groups of two. Each iteration
dispatches tokens the way an MoE layer does: asynchronous functional
all-gathers (``torch.distributed._functional_collectives``) of the tokens,
routing weights and expert indices, local expert matmuls on the gathered
tokens, an asynchronous reduce-scatter back, and a small MLP computed while
that reduce-scatter is in flight; then backward. Only torch is used: no FSDP,
no DTensor, nothing from this project.

With ``MALLOC_PERTURB_`` set (this script sets it for the ranks), a rank
usually dies within a few thousand iterations with SIGSEGV or a glibc abort
such as ``malloc(): unaligned tcache chunk detected``. ``--sync`` waits for
every collective right after issuing it, which avoids the crash; that is the
workaround this project's MoE test model uses. See
docs/upstream-gloo-funcol-heap-corruption.md.

``--collective`` narrows it to c10d's own all-gathers, with no functional
collectives and no autograd through them: the same three all-gathers
(float32, float32 and int64) issued asynchronously, the small MLP computed
while they run, then the experts on the gathered tokens. ``c10d-coalesced``
issues each through gloo's coalesced all-gather
(``ProcessGroup.all_gather_single_coalesced``, which FSDP's per-parameter
mode uses where coalescing is on), ``c10d`` through the plain
``all_gather_into_tensor``.

Exit status: 0 if every rank finished, 1 if a rank died.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.distributed_c10d import AllgatherOptions

WORLD_SIZE = 4
TOKENS, DIM, EXPERTS_PER_RANK = 18, 32, 2


def _maybe_wait(t: torch.Tensor, sync: bool) -> torch.Tensor:
    if sync and isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def _c10d_all_gather(
    tensor: torch.Tensor, group: dist.ProcessGroup, coalesced: bool
) -> tuple[torch.Tensor, dist.Work]:
    tensor = tensor.detach()
    output = tensor.new_empty((tensor.size(0) * group.size(), *tensor.shape[1:]))
    if coalesced:
        opts = AllgatherOptions()
        opts.asyncOp = True
        return output, group.all_gather_single_coalesced([output], [tensor], opts)
    return output, dist.all_gather_into_tensor(output, tensor, group=group, async_op=True)


def _experts(
    gx: torch.Tensor, gw: torch.Tensor, gi: torch.Tensor, w_experts: torch.Tensor, first: int
) -> torch.Tensor:
    out = torch.zeros_like(gx)
    for e in range(EXPERTS_PER_RANK):
        tokens, slots = (gi == first + e).nonzero(as_tuple=True)
        y = F.silu(gx[tokens] @ w_experts[e])
        out = out.index_add(0, tokens, y * gw[tokens, slots, None])
    return out


def _worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, store=store)
    # Every rank creates both groups, in the same order
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep = groups[rank // 2]
    torch.manual_seed(0)
    w_experts = torch.randn(EXPERTS_PER_RANK, DIM, DIM, requires_grad=True)
    w_shared = torch.randn(DIM, DIM, requires_grad=True)
    first_expert = (rank % 2) * EXPERTS_PER_RANK
    for it in range(args.iterations):
        x = torch.randn(TOKENS, DIM, requires_grad=True) * 1.0
        weights, indices = torch.randn(TOKENS, 4, requires_grad=True).softmax(-1).topk(2, dim=-1)
        if args.collective == "funcol":
            gx = _maybe_wait(funcol.all_gather_single_autograd(x, 0, ep), args.sync)
            gw = _maybe_wait(funcol.all_gather_single_autograd(weights, 0, ep), args.sync)
            gi = _maybe_wait(funcol.all_gather_single(indices, 0, ep), args.sync)
            out = _experts(gx, gw, gi, w_experts, first_expert)
            reduced = _maybe_wait(
                funcol.reduce_scatter_single_autograd(out, "sum", 0, ep), args.sync
            )
            shared = F.silu(x @ w_shared) @ w_shared  # computed while the reduce-scatter runs
            (reduced + shared).square().mean().backward()
        else:
            gathers = []
            for t in (x, weights, indices):
                gathers.append(_c10d_all_gather(t, ep, args.collective == "c10d-coalesced"))
                if args.sync:
                    gathers[-1][1].wait()
            shared = F.silu(x @ w_shared) @ w_shared  # computed while the all-gathers run
            for _, work in gathers:
                work.wait()
            gx, gw, gi = (output for output, _ in gathers)
            out = _experts(gx, gw, gi, w_experts, first_expert)
            (out.sum() + shared.square().mean()).backward()
        with torch.no_grad():
            for p in (w_experts, w_shared):
                p -= 1e-3 * p.grad
                p.grad = None
        if rank == 0 and (it + 1) % 500 == 0:
            print(f"iteration {it + 1}/{args.iterations}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=3000, help="default 3000")
    parser.add_argument(
        "--perturb", type=int, default=165, help="MALLOC_PERTURB_ for the ranks (default 165)"
    )
    parser.add_argument(
        "--sync", action="store_true", help="wait for each collective at once (the workaround)"
    )
    parser.add_argument(
        "--collective",
        choices=("funcol", "c10d-coalesced", "c10d"),
        default="funcol",
        help="what gathers the tokens (default funcol; see above)",
    )
    args = parser.parse_args()
    os.environ["MALLOC_PERTURB_"] = str(args.perturb)
    print(
        f"torch {torch.__version__}, {WORLD_SIZE} ranks on gloo, "
        f"collective={args.collective}, sync={args.sync}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(
                _worker,
                args=(args, os.path.join(tmp, "store")),
                nprocs=WORLD_SIZE,
                start_method="spawn",
            )
        except mp.ProcessExitedException as e:
            print(f"FAILED: {e}", flush=True)
            sys.exit(1)
    print("all ranks finished", flush=True)


if __name__ == "__main__":
    main()
