#!/usr/bin/env python3
"""Train a Llama-like model with FSDP2 on torch_xla's PJRT CPU device in three
modes (grouped; per-parameter with tuple collectives, the ``xla`` default;
per-parameter one by one), stepping ``torch.optim.AdamW`` as users do, and
count what each mode compiles and executes per step.

The ranks run as threads of one process (PJRT CPU's only multi-device form in
torch_xla 2.9), one worker process per mode and world size. Every
configuration (``CONFIGS``: fp32, bf16 parameters with fp32 reduction,
``reshard_after_forward`` False and 2, gradient accumulation,
``clip_grad_norm_``, W=2 and W=4) runs in every mode at
``PARITY_XLA_FLAGS``; the parent requires the modes' final parameters to be
equal bit for bit and every parameter to have moved. The fp32 (W=2) and
bf16 (W=4) configurations (``COUNT_CONFIGS``) also run at XLA's default optimization
level, where each mode reports, for rank 0 per steady-state step: HLO op
counts (``HLO_OPS``) before XLA's optimizations (the graphs torch_xla built)
and after them (the compiled modules, ``--xla_dump_to``),
``host_round_trips`` (ops torch_xla ran on the host), ``graphs_compiled``,
``graphs_executed`` and the median ``step_ms``. The JSON report::

    {"counts": {config: {mode: {...}}}, "configs": {config: {"parity": bool, ...}},
     "parity": bool}

Only the test bed lives here (threads as ranks, XLA channel ids, ordered
compiles); what FSDP needs on an ``xla`` device comes from
``torch_fsdp_ext.xla``. Run it with ``bash tools/xla_check.sh OUT.json``,
which sets up the venv; see docs/xla.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("xla_check")

# mode -> (group_collectives, torch_fsdp_ext.xla.register's tuple_collectives)
MODES = {"grouped": (True, True), "per-param": (False, True), "per-param-1by1": (False, False)}
# config -> (world size, settings); every config runs in every mode
CONFIGS: dict[str, tuple[int, dict]] = {
    "fp32": (2, {}),
    "bf16-fp32": (2, {"mixed_precision": True}),
    "reshard-false": (2, {"reshard_after_forward": False}),
    "grad-accum": (2, {"accumulate": 2}),
    "clip": (2, {"clip": 1.0}),
    "w4": (4, {}),
    "w4-bf16-fp32": (4, {"mixed_precision": True}),
    # reshard_after_forward=2 keeps this rank's chunk of each all-gathered
    # parameter, a slice at an offset that differs by rank, so the ranks'
    # step graphs differ and their tuple collectives, which take no channel
    # id, never pair in this test bed (docs/xla.md); one by one covers it
    "w4-reshard-2": (4, {"reshard_after_forward": 2, "not_in": ("per-param",)}),
}
# the configs whose per-step op counts --check compares, at XLA's default flags.
# bf16 at W=4: at W=2 an fp32 shard has exactly the bytes of a bf16 unsharded
# parameter, and XLA's buffer-donor pass pairs a donated input with an output
# of the same byte size, so it gives the shards' donated buffers to the
# unsharded parameters (live at the step's end in both modes) and copies the
# shards first: XLA's pairing, not FSDP's data movement (docs/xla.md)
COUNT_CONFIGS = ("fp32", "w4-bf16-fp32")
# XLA:CPU's code for a dot depends on the graph it lands in, and the modes cut
# a step into different graphs, so parity is asserted with LLVM's
# optimizations off, where the code does not depend on the cut (docs/xla.md)
PARITY_XLA_FLAGS = "--xla_backend_optimization_level=0"
# ops that move data; --check requires per-param's, after XLA's passes, each <= grouped's
DATA_MOVEMENT_OPS = ("concatenate", "copy", "dynamic-update-slice", "pad", "select")
HLO_OPS = (*DATA_MOVEMENT_OPS, "all-gather", "reduce-scatter")


# what the parent hands each worker
_WORKER_OPTIONS = (
    "steps",
    "warmup",
    "lr",
    "vocab",
    "dim",
    "heads",
    "ffn",
    "layers",
    "batch",
    "seq",
)


def _model_args(args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab": args.vocab,
        "dim": args.dim,
        "heads": args.heads,
        "ffn": args.ffn,
        "layers": args.layers,
    }


def build_model(vocab: int, dim: int, heads: int, ffn: int, layers: int):
    """A Llama-like decoder: token embedding, blocks of RMSNorm + causal
    attention and RMSNorm + SwiGLU, a final norm and an output projection."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, s, heads, dim // heads).transpose(1, 2)

            q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
            scores = q @ k.transpose(-1, -2) / (dim // heads) ** 0.5
            # the mask is built on the CPU: a device-side arange would be a
            # rank-independent constant too, but this keeps the graph simple
            mask = torch.ones(s, s, dtype=torch.bool).triu(1).to(x.device)
            scores = scores.masked_fill(mask, float("-inf"))
            out = scores.softmax(-1) @ v
            return self.wo(out.transpose(1, 2).reshape(b, s, dim))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(dim, ffn, bias=False)
            self.w3 = nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = RMSNorm(), RMSNorm()
            self.attention, self.feed_forward = Attention(), FeedForward()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm()
            self.output = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h))

    torch.manual_seed(0)
    return Transformer()


def batches(step: int, vocab: int, batch: int, seq: int, world_size: int):
    """Every rank's (tokens, targets) for ``step``, built on the CPU."""
    import torch

    out = []
    for rank in range(world_size):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


# ---------------------------------------------------------------------------
# The worker: one mode, two rank threads


class _TestBed:
    """PJRT CPU devices as rank threads of this process.

    torch.distributed's world is made thread-local (the threaded process group
    machinery of PyTorch's own tests), and every all-gather and reduce-scatter
    gets an XLA channel id: a per-rank counter, reset at each step's sync.
    XLA:CPU pairs a collective across ranks by its channel id, or without one
    by the id of its HLO module; with padded shards the ranks' step graphs
    differ in shape, so without channel ids the two rendezvous never meet.
    """

    def __init__(self, world_size: int) -> None:
        import torch
        import torch_xla.core.xla_model as xm
        from torch.testing._internal.distributed import multi_threaded_pg

        multi_threaded_pg._install_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        self._local = threading.local()
        self.barrier = threading.Barrier(world_size)
        self.init_lock = threading.Lock()
        # step_sync: the compile cache's count when rank 0 started its sync,
        # and whether that sync returned
        self._rank0_entered = 0
        self._rank0_returned = False
        all_gather, reduce_scatter = xm.all_gather, xm.reduce_scatter

        def all_gather_with_channel(value, *args, **kwargs):
            if kwargs.get("output") is None and kwargs.get("channel_id") is None:
                kwargs["channel_id"] = self._next_channel()
            return all_gather(value, *args, **kwargs)

        def reduce_scatter_with_channel(reduce_type, input, *args, **kwargs):
            if isinstance(input, list):
                # torch_xla's list form takes no channel id
                return reduce_scatter(reduce_type, input, *args, **kwargs)
            output = kwargs.pop("output", None)
            kwargs.setdefault("channel_id", self._next_channel())
            result = reduce_scatter(reduce_type, input, *args, **kwargs)
            if output is None:
                return result
            # the out= form takes no channel id: compute, then bind
            output.copy_(result)
            return output

        # torch_xla's process group looks both up on xm at each call
        xm.all_gather = all_gather_with_channel
        xm.reduce_scatter = reduce_scatter_with_channel

    def _next_channel(self) -> int:
        self._local.channel = getattr(self._local, "channel", 0) + 1
        return self._local.channel

    def step_sync(self) -> None:
        """Sync every rank, rank 0 first: the others start once rank 0's
        graph is in torch_xla's compile cache (or its sync returned), so that
        a graph that is the same on every rank is compiled once and the others
        take it from the cache. XLA:CPU pairs a collective without a channel
        id by the id of its compiled module, and torch_xla's list (tuple)
        collectives take no channel id. The others must not wait for rank 0's
        sync to return (it blocks in the collective until they join), nor for
        each other: XLA:CPU aborts a collective whose ranks do not all arrive
        within 10 seconds.
        """
        import torch.distributed as dist
        import torch_xla
        import torch_xla.debug.metrics as met

        def cached() -> int:
            # Grows once a graph is in the compile cache: a compiled graph is
            # added to it, a cache hit counts as CachedCompile
            return torch_xla._XLAC._xla_get_num_cached_compilation_graph() + (
                met.counter_value("CachedCompile") or 0
            )

        rank = dist.get_rank()
        self.barrier.wait()
        if rank == 0:
            self._rank0_entered = cached()
            self._rank0_returned = False
        self.barrier.wait()
        deadline = time.monotonic() + 600
        while rank > 0 and not self._rank0_returned and cached() <= self._rank0_entered:
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0's sync neither compiled nor returned")
            time.sleep(0.01)
        torch_xla.sync(wait=True)
        if rank == 0:
            self._rank0_returned = True
        self.barrier.wait()
        self._local.channel = 0

    def run(self, fn) -> None:
        from torch_xla._internal import pjrt

        errors: list[str] = []

        def wrapped(index: int) -> None:
            try:
                fn(index)
            except BaseException:
                import traceback

                errors.append(f"rank {index}:\n{traceback.format_exc()}")
                self.barrier.abort()
                raise

        try:
            pjrt._run_thread_per_device(
                local_rank=0,
                local_world_size=1,
                fn=pjrt._SpawnFn(wrapped),
                initializer_fn=pjrt.initialize_multiprocess,
            )
        finally:
            for e in errors:
                log.error("%s", e)
        if errors:
            raise RuntimeError("a rank failed; see above")


def _instructions(hlo: str) -> Iterator[tuple[str, str]]:
    """(op, computation) for each instruction of an HLO module's text."""
    computation = ""
    for line in hlo.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and " = " not in stripped:
            computation = (
                stripped.split()[1] if stripped.startswith("ENTRY") else stripped.split()[0]
            )
            continue
        if " = " not in stripped or stripped.startswith(("HloModule", "//")):
            continue
        rhs = stripped.split(" = ", 1)[1]
        if rhs.startswith("("):  # a tuple shape: skip to its closing parenthesis
            depth = 0
            for i, c in enumerate(rhs):
                depth += {"(": 1, ")": -1}.get(c, 0)
                if depth == 0:
                    rhs = rhs[i + 1 :]
                    break
        else:
            rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
        match = re.match(r"\s*([a-z][a-z\-]*)\(", rhs)
        if match:
            yield match.group(1), computation


def _count(hlo: str, entry_only: bool) -> Counter:
    """HLO op counts, async collectives counted once (``*-start``)."""
    ops: Counter = Counter()
    for op, computation in _instructions(hlo):
        if entry_only and not computation.startswith(("ENTRY", "IrToHlo", "SyncTensorsGraph")):
            continue
        if op.endswith("-done"):
            continue
        ops[op.removesuffix("-start")] += 1
    return ops


def _graphs(dump: str) -> list[str]:
    """The graphs of a part of an ``XLA_SAVE_TENSORS_FILE`` dump."""
    return [block.split("## END_GRAPH")[0] for block in dump.split("## BEGIN_GRAPH")[1:]]


def _entry(hlo: str) -> str:
    # the entry computation: other computations (reducers) are not ops of the step
    return hlo[hlo.index("ENTRY") :] if "ENTRY" in hlo else hlo


class _Optimized:
    """The modules XLA compiled (``--xla_dump_to``), by the graph they came from.

    torch_xla names a graph ``IrToHlo.<n>`` in its own dump and the compiled
    module ``SyncTensorsGraph.<n>``; ``n`` alone is ambiguous, so a module is
    matched by ``n`` and its op counts before optimization.
    """

    def __init__(self, directory: Path) -> None:
        self._modules: dict[tuple[str, frozenset], Counter] = {}
        for before in directory.glob("module_*.before_optimizations.txt"):
            after = before.with_name(
                before.name.replace("before_optimizations", "cpu_after_optimizations")
            )
            if after.exists():
                n = before.name.split(".")[2]
                key = (n, frozenset(_count(_entry(before.read_text()), False).items()))
                self._modules[key] = _count(after.read_text(), entry_only=False)

    def ops(self, graph: str) -> Counter | None:
        n = re.search(r"HloModule IrToHlo\.(\d+)", graph)
        key = (n.group(1) if n else "", frozenset(_count(_entry(graph), False).items()))
        return self._modules.get(key)


def _train_config(bed, args, config, group_collectives, rank, mesh, counting, record) -> dict:
    """Train ``config`` on this rank thread; returns its final shards and
    initial parameters (rank 0 also records per-step counts)."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    import torch_fsdp_ext

    world_size, settings = CONFIGS[config]
    device = torch_xla.device()
    with bed.init_lock:  # the CPU RNG is shared by the rank threads
        model = build_model(**_model_args(args))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(device)
    kwargs: dict = {"mesh": mesh, "group_collectives": group_collectives}
    if settings.get("mixed_precision"):
        kwargs["mp_policy"] = torch_fsdp_ext.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if "reshard_after_forward" in settings:
        kwargs["reshard_after_forward"] = settings["reshard_after_forward"]
    for block in model.layers:
        torch_fsdp_ext.fully_shard(block, **kwargs)
    torch_fsdp_ext.fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    micro_batches = settings.get("accumulate", 1)
    # torch_xla writes each device's graphs to the dump file + ".<ordinal>"
    dump = os.environ.get("XLA_SAVE_TENSORS_FILE")
    rank_dump = Path(f"{dump}.{xr.global_ordinal()}") if dump else None
    _drop_token_and_sync(bed)
    for step in range(args.steps):
        offset = rank_dump.stat().st_size if rank_dump and rank_dump.exists() else 0
        bed.barrier.wait()
        if counting and rank == 0:
            before, start = _counters(), time.perf_counter()
        bed.barrier.wait()
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            x, y = batches(
                step * micro_batches + micro, args.vocab, args.batch, args.seq, world_size
            )[rank]
            logits = model(x.to(device))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
            (loss / micro_batches).backward()
        if "clip" in settings:
            # as users call it: importing torch_xla replaces it with a version
            # DTensor cannot run, which torch_fsdp_ext.xla.register() undoes
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clip"])
        optimizer.step()
        optimizer.zero_grad()
        _drop_token_and_sync(bed)
        bed.barrier.wait()
        if counting and rank == 0:
            elapsed, after = time.perf_counter() - start, _counters()
            with rank_dump.open() as f:
                f.seek(offset)
                graphs = _graphs(f.read())
            record.append(
                {
                    "graphs": graphs,
                    # the counters are process-wide: every rank thread
                    "host_round_trips": sum(after[0][k] - before[0].get(k, 0) for k in after[0])
                    / world_size,
                    "graphs_compiled": (after[1] - before[1]) / world_size,
                    "graphs_executed": (after[2] - before[2]) / world_size,
                    "step_ms": elapsed * 1e3,
                }
            )
        bed.barrier.wait()
    # each rank's shards, joined by the parent: DTensor.full_tensor() would
    # unpad uneven shards with narrow(), which torch_xla's functionalization
    # rejects under funcol
    shards = {k: v.to_local().cpu() for k, v in model.state_dict().items()}
    _drop_token_and_sync(bed)
    return {"shards": shards, "initial": initial}


def _counters() -> tuple[dict[str, int], int, int]:
    """Host fallbacks by op, graphs compiled, graphs executed (process-wide)."""
    import torch_xla.debug.metrics as met

    compiled = met.metric_data("CompileTime")
    executed = met.metric_data("ExecuteTime")
    fallbacks = {name: met.counter_value(name) or 0 for name in met.executed_fallback_ops()}
    return fallbacks, compiled[0] if compiled else 0, executed[0] if executed else 0


def worker(args: argparse.Namespace) -> None:
    bed = _TestBed(args.world_size)
    import torch
    import torch.distributed as dist

    from torch_fsdp_ext import xla as fsdp_xla

    group_collectives, tuple_collectives = MODES[args.worker]
    fsdp_xla.register(tuple_collectives=tuple_collectives)
    out: dict[str, dict] = {config: {} for config in args.configs}
    record: list[dict] = []

    def rank_fn(index: int) -> None:
        dist.init_process_group("xla", init_method="xla://")
        rank = dist.get_rank()
        mesh = fsdp_xla.mesh_from_group()
        for config in args.configs:
            counting = args.count and config == args.configs[0]
            out[config][rank] = _train_config(
                bed, args, config, group_collectives, rank, mesh, counting, record
            )
            if rank == 0:
                log.info("%s, %s: trained %d steps", args.worker, config, args.steps)

    bed.run(rank_fn)
    result: dict = {"configs": {}}
    for config, ranks in out.items():
        full = {
            k: torch.cat([ranks[r]["shards"][k] for r in range(args.world_size)])
            for k in ranks[0]["shards"]
        }
        result["configs"][config] = {
            "params": full,
            "moved": sorted(k for k in full if not torch.equal(full[k], ranks[0]["initial"][k])),
        }
    if args.count:
        steady = record[args.warmup :]
        if not steady:
            raise SystemExit(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
        optimized = _Optimized(Path(args.dump_dir)) if args.dump_dir else None

        def per_step(graph_ops) -> dict:
            return {
                op.replace("-", "_"): statistics.median(
                    sum(ops[op] for ops in map(graph_ops, s["graphs"])) for s in steady
                )
                for op in HLO_OPS
            }

        report = {"before_optimizations": per_step(lambda g: _count(_entry(g), False))}
        if optimized is not None:
            unmatched = [g for s in steady for g in s["graphs"] if optimized.ops(g) is None]
            if unmatched:
                raise RuntimeError(f"{len(unmatched)} executed graphs have no compiled module")
            report["after_optimizations"] = per_step(optimized.ops)
        for key in ("host_round_trips", "graphs_compiled", "graphs_executed"):
            report[key] = statistics.median(s[key] for s in steady)
        report["step_ms"] = round(statistics.median(s["step_ms"] for s in steady), 1)
        result["counts"] = report
    torch.save(result, args.result)


def bench(args: argparse.Namespace) -> None:
    """``--bench``: one model per mode from the same seed, and the floor (the
    same model and per-rank batch on each rank's device with no FSDP and no
    collective), trained in rounds that alternate them, ``--bench-steps``
    steps each per round, all in this process; prints and saves each one's
    step times (rank 0) and each mode's overhead over the floor."""
    bed = _TestBed(args.world_size)
    import torch
    import torch.distributed as dist
    import torch_xla

    import torch_fsdp_ext
    from torch_fsdp_ext import xla as fsdp_xla

    fsdp_xla.register()
    comms = {
        "grouped": None,
        "per-param": (fsdp_xla.XlaAllGather, fsdp_xla.XlaReduceScatter),
        "per-param-1by1": (
            lambda: fsdp_xla.XlaAllGather(tuple_collectives=False),
            lambda: fsdp_xla.XlaReduceScatter(tuple_collectives=False),
        ),
    }
    bf16 = args.precision == "bf16"
    runs = ("floor", *MODES, "xla-fsdp")
    times: dict[str, list[float]] = {run: [] for run in runs}
    # rank 0's split of each timed step: tracing it (Python: the model, FSDP's
    # hooks, the optimizer, building the lazy graph) and the sync that runs
    # it (the graph's execution, the collectives' rendezvous with the other
    # rank, and the test bed's ordering barriers)
    trace_times: dict[str, list[float]] = {run: [] for run in runs}

    def rank_fn(index: int) -> None:
        dist.init_process_group("xla", init_method="xla://")
        rank = dist.get_rank()
        device = torch_xla.device()
        mesh = fsdp_xla.mesh_from_group()
        models, optimizers = {}, {}
        for run in runs:
            with bed.init_lock:
                model = build_model(**_model_args(args)).to(device)
            if run == "floor":
                # bf16: the floor computes in bf16 as FSDP's modes do
                model = model.to(torch.bfloat16 if bf16 else torch.float32)
            elif run == "xla-fsdp":
                model = _wrap_xla_fsdp(model, reshard=True, bf16=bf16)
            else:
                mp_policy = torch_fsdp_ext.MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16 if bf16 else None,
                    reduce_dtype=torch.float32 if bf16 else None,
                )
                for module in (*model.layers, model):
                    torch_fsdp_ext.fully_shard(
                        module, mesh=mesh, group_collectives=MODES[run][0], mp_policy=mp_policy
                    )
                    if comms[run] is not None:
                        module.set_custom_all_gather(comms[run][0]())
                        module.set_custom_reduce_scatter(comms[run][1]())
            models[run] = model
            optimizers[run] = torch.optim.AdamW(model.parameters(), lr=args.lr)
        step = 0
        for round_ in range(args.warmup + args.steps):
            for run, model in models.items():
                for _ in range(args.bench_steps):
                    _drop_token_and_sync(bed)
                    start = time.perf_counter()
                    x, y = batches(step, args.vocab, args.batch, args.seq, args.world_size)[rank]
                    logits = model(x.to(device))
                    loss = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1).float(), y.to(device).flatten()
                    )
                    loss.backward()
                    optimizers[run].step()
                    optimizers[run].zero_grad()
                    traced = time.perf_counter()
                    _drop_token_and_sync(bed)
                    if rank == 0 and round_ >= args.warmup:
                        times[run].append((time.perf_counter() - start) * 1e3)
                        trace_times[run].append((traced - start) * 1e3)
                    step += 1
            if rank == 0:
                log.info("round %d of %d", round_ + 1, args.warmup + args.steps)

    bed.run(rank_fn)
    report: dict = {
        "precision": args.precision,
        "world_size": args.world_size,
        "runs": {
            run: {
                "steps": len(t),
                "min_ms": round(min(t), 1),
                "median_ms": round(statistics.median(t), 1),
                "max_ms": round(max(t), 1),
                "median_trace_ms": round(statistics.median(trace_times[run]), 1),
                "median_sync_ms": round(
                    statistics.median([a - b for a, b in zip(t, trace_times[run], strict=True)]),
                    1,
                ),
            }
            for run, t in times.items()
        },
    }
    runs_report = report["runs"]
    floor = runs_report["floor"]["median_ms"]
    grouped = runs_report["grouped"]["median_ms"]
    for mode in (*MODES, "xla-fsdp"):
        runs_report[mode]["median_vs_grouped"] = round(runs_report[mode]["median_ms"] / grouped, 3)
        runs_report[mode]["overhead_ms"] = round(runs_report[mode]["median_ms"] - floor, 1)
    for mode in (*MODES, "xla-fsdp"):
        for part in ("trace", "sync"):
            runs_report[mode][f"{part}_overhead_ms"] = round(
                runs_report[mode][f"median_{part}_ms"] - runs_report["floor"][f"median_{part}_ms"],
                1,
            )
        runs_report[mode]["overhead_vs_grouped"] = round(
            runs_report[mode]["overhead_ms"] / runs_report["grouped"]["overhead_ms"], 3
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


# ---------------------------------------------------------------------------
# Memory: device bytes a rank keeps after a step, per arm

# arm -> what trains: no FSDP (the floor, each rank's batch on an unsharded
# model), FSDP2's two modes, torch_xla's own FSDP (nested per block)
MEMORY_ARMS = ("floor", "grouped", "per-param", "xla-fsdp")


def device_bytes(groups: dict[str, list]) -> dict[str, int]:
    """Bytes of device data this rank thread's device keeps, counted by buffer
    handle after a sync and without executing anything: ``held``, the buffers
    a Python-reachable tensor holds (for a functional tensor, its value), and
    ``pending_ir``, those only a tensor's pending graph reads. ``groups``
    (name -> tensors) also reports the bytes of each group's buffers, held or
    read (a buffer counts in the first group that reaches it)."""
    import gc

    import torch
    import torch_xla
    from torch.distributed.tensor import DTensor

    xlac = torch_xla._XLAC
    device = torch_xla.device()

    def buffers(t) -> tuple[dict[int, int], bool]:
        """{handle: bytes} of t's device data, and whether it holds it."""
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or t.device != device:
            return {}, False
        if torch._is_functional_tensor(t):
            t = torch._from_functional_tensor(t)
        try:
            (handle,) = xlac._get_tensors_handle([t])
            return {handle: t.numel() * t.element_size()}, True
        except RuntimeError:  # no data: a pending graph
            _, data = xlac._get_tensors_xla_device_data_node([t])
            handles = xlac._get_tensors_handle(data) if data else []
            return {
                h: d.numel() * d.element_size() for h, d in zip(handles, data, strict=True)
            }, False

    held: dict[int, int] = {}
    read: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            found, holds = buffers(obj)
            (held if holds else read).update(found)
    read = {h: n for h, n in read.items() if h not in held}
    out = {"held": sum(held.values()), "pending_ir": sum(read.values())}
    out["total"] = out["held"] + out["pending_ir"]
    seen: set[int] = set()
    for name, tensors in groups.items():
        mine: dict[int, int] = {}
        for t in tensors:
            mine.update(buffers(t)[0])
        out[name] = sum(n for h, n in mine.items() if h not in seen)
        seen |= mine.keys()
    out["other"] = out["total"] - sum(out[name] for name in groups)
    if os.environ.get("XLA_CHECK_DEBUG"):
        others = Counter()
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                found, holds = buffers(obj)
                if found and not (found.keys() & seen):
                    others[(type(obj).__name__, tuple(obj.shape), holds)] += 1
        log.info("other buffers' holders: %s", dict(others))
    return out


def _xla_fsdp_full_params(model) -> dict[str, tuple]:
    """(shard, original size) per parameter name of a model wrapped in
    torch_xla's XlaFullyShardedDataParallel, names as in the unwrapped model."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as XlaFSDP

    out = {}
    for prefix, module in model.named_modules():
        if isinstance(module, XlaFSDP):
            for p in module.sharded_params:
                name = f"{prefix}.{p._orig_name}" if prefix else p._orig_name
                name = name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")
                out[name] = (p.detach().cpu(), tuple(p._orig_size))
    return out


def _wrap_xla_fsdp(model, *, reshard: bool, bf16: bool):
    """``model`` in torch_xla's XlaFullyShardedDataParallel, per block and at
    the root, its defaults but for what the arms share and the test bed."""
    import torch
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as XlaFSDP

    kwargs = {
        "reshard_after_forward": reshard,
        # pinned collectives lower to rank-dependent graphs, which this test
        # bed cannot pair (docs/xla.md)
        "pin_layout_in_collective_ops": False,
        "compute_dtype": torch.bfloat16 if bf16 else torch.float32,
        "fp32_reduce_scatter": bf16,
    }
    for i, block in enumerate(model.layers):
        model.layers[i] = XlaFSDP(block, **kwargs)
    return XlaFSDP(model, **kwargs)


def memory_worker(args: argparse.Namespace) -> None:
    """One arm (``--memory-worker``): ``--steps`` SGD or AdamW steps on each
    rank thread; rank 0 reports device bytes after each step and every rank
    its final parameters (shards) for the parent's parity."""
    bed = _TestBed(args.world_size)
    import torch
    import torch.distributed as dist
    import torch_xla

    import torch_fsdp_ext
    from torch_fsdp_ext import xla as fsdp_xla

    arm = args.memory_worker
    bf16 = args.precision == "bf16"
    reshard = args.reshard_after_forward == "true"
    # device bytes after each step: rank 0, and the last rank, whose shards
    # are the padded ones where a dim does not divide by the world size
    out: dict = {"steps": [], "steps_last_rank": [], "params": {}}

    def rank_fn(index: int) -> None:
        dist.init_process_group("xla", init_method="xla://")
        rank = dist.get_rank()
        device = torch_xla.device()
        with bed.init_lock:
            model = build_model(**_model_args(args))
        model = model.to(device)
        if arm == "floor" and bf16:
            model = model.to(torch.bfloat16)
        elif arm in ("grouped", "per-param"):
            mesh = fsdp_xla.mesh_from_group()
            mp_policy = torch_fsdp_ext.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if bf16 else None,
                reduce_dtype=torch.float32 if bf16 else None,
            )
            for module in (*model.layers, model):
                torch_fsdp_ext.fully_shard(
                    module,
                    mesh=mesh,
                    group_collectives=arm == "grouped",
                    mp_policy=mp_policy,
                    reshard_after_forward=reshard,
                )
        elif arm == "xla-fsdp":
            model = _wrap_xla_fsdp(model, reshard=reshard, bf16=bf16)
        optimizer = (
            torch.optim.AdamW(model.parameters(), lr=args.lr)
            if args.optimizer == "adamw"
            else torch.optim.SGD(model.parameters(), lr=args.lr)
        )
        _drop_token_and_sync(bed)
        for step in range(args.steps):
            x, y = batches(step, args.vocab, args.batch, args.seq, args.world_size)[rank]
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            del logits, loss
            _drop_token_and_sync(bed)
            if rank in (0, args.world_size - 1):
                params = [p for p in model.parameters()]
                state = [t for s in optimizer.state.values() for t in s.values()]
                grads = [p.grad for p in params if p.grad is not None]
                out["steps" if rank == 0 else "steps_last_rank"].append(
                    device_bytes(
                        {
                            "params": params,
                            "optimizer_state": state,
                            "grads": grads,
                            "batch": [x, y],
                        }
                    )
                )
            bed.barrier.wait()
        if arm == "xla-fsdp":
            out["params"][rank] = _xla_fsdp_full_params(model)
        elif arm == "floor":
            out["params"][rank] = {
                k: v.detach().float().cpu() for k, v in model.state_dict().items()
            }
        else:
            out["params"][rank] = {
                k: v.to_local().detach().cpu() for k, v in model.state_dict().items()
            }
        bed.step_sync()

    bed.run(rank_fn)
    torch.save(out, args.result)


def _drop_token_and_sync(bed: _TestBed) -> None:
    # torch_xla.sync() drops the device's collective token with the GIL held,
    # which frees buffers a step it just launched still reads; with
    # torch_xla's FSDP at step 0, rank 0 then waits for its step, the step for
    # rank 1's collective, and rank 1 for the GIL. Dropping the token first
    # avoids it (so does XLA_ENABLE_PARAM_ALIASING=0)
    import torch_xla

    torch_xla._XLAC._set_all_reduce_token(torch_xla._XLAC._xla_get_default_device(), None)
    bed.step_sync()


# ---------------------------------------------------------------------------
# The parent: one worker process per mode and world size, then the comparison


def _run_worker(
    args, mode: str, world_size: int, configs: list[str], tmp: str, *, count: bool, retried: list
):
    import torch

    name = f"{mode}-w{world_size}{'-count' if count else ''}"
    result = Path(tmp, f"{name}.pt")
    env = dict(
        os.environ,
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(world_size),
        XLA_USE_DUMMY_STORE="1",
        TORCH_DIST_INIT_BARRIER="0",
    )
    cmd = [sys.executable, __file__, "--worker", mode, "--result", str(result)]
    cmd += ["--configs", *configs]
    if count:
        dump_dir = Path(tmp, f"{name}.modules")
        env.update(
            XLA_SAVE_TENSORS_FILE=str(Path(tmp, f"{name}.hlo")),
            XLA_SAVE_TENSORS_FMT="hlo",
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir}".strip(),
        )
        cmd += ["--count", "--dump-dir", str(dump_dir)]
    else:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {PARITY_XLA_FLAGS}".strip()
    for option in _WORKER_OPTIONS:
        cmd += [f"--{option}", str(getattr(args, option))]
    cmd += ["--world-size", str(world_size)]
    log.info("%s: %s", name, ", ".join(configs))
    if subprocess.run(cmd, env=env).returncode == -signal.SIGABRT:
        # XLA:CPU aborts the process when a rank joins a collective more than
        # 10 s after the others, which the ordered compiles of the test bed
        # (_TestBed.step_sync) can cause on a loaded machine; the product is
        # not involved, so run the worker again, once, and report it
        log.warning("%s: XLA aborted the worker (a collective's rendezvous); once more", name)
        retried.append(name)
        subprocess.run(cmd, env=env, check=True)
    return torch.load(result)


def _reference(args: argparse.Namespace) -> dict:
    """The unsharded model trained on the CPU (ATen) on every rank's batch at
    once, with the arms' optimizer: each rank's mean loss, averaged, is the
    mean loss over the joined batch."""
    import torch

    model = build_model(**_model_args(args))
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=args.lr)
        if args.optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=args.lr)
    )
    for step in range(args.steps):
        ranks = batches(step, args.vocab, args.batch, args.seq, args.world_size)
        x, y = torch.cat([r[0] for r in ranks]), torch.cat([r[1] for r in ranks])
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _full_params(arm: str, ranks: dict) -> dict:
    import torch

    if arm == "xla-fsdp":
        out = {}
        for name, (_, size) in ranks[0].items():
            flat = torch.cat([ranks[r][name][0].flatten() for r in sorted(ranks)])
            out[name] = flat[: torch.Size(size).numel()].view(size)
        return out
    if arm == "floor":
        return ranks[0]
    return {k: torch.cat([ranks[r][k] for r in sorted(ranks)]) for k in ranks[0]}


def _peaks(dump: Path) -> dict:
    """The in-step peaks XLA's buffer assignment reports (``--xla_dump_to``,
    "Stack trace breakdown for peak usage": live buffers at the peak, the
    graph's inputs included) of every graph the run compiled: the largest,
    and how many graphs there were (the modes that cut a step into several
    graphs also keep buffers live across them, which this does not add)."""
    peaks = []
    for f in dump.glob("*buffer-assignment.txt"):
        match = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", f.read_text())
        if match:
            peaks.append(int(match.group(1).replace(" ", "")))
    return {"peak_bytes_largest_graph": max(peaks, default=0), "graphs_compiled": len(peaks)}


def memory(args: argparse.Namespace) -> int:
    """``--memory``: each arm in its own worker; rank 0's device bytes after
    the last step, and each arm's parity (max abs diff) against the unsharded
    CPU reference; grouped and per-param must also agree bit for bit."""
    import torch

    arms = args.arms
    report: dict = {
        "precision": args.precision,
        "world_size": args.world_size,
        "optimizer": args.optimizer,
        "reshard_after_forward": args.reshard_after_forward,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "arms": {},
    }
    reference = _reference(args)
    report["parameters"] = len(reference)
    params = {}
    with tempfile.TemporaryDirectory() as tmp:

        def run_arm(arm: str, reshard: str) -> tuple[dict, dict]:
            name = f"{arm}-reshard-{reshard}"
            result = Path(tmp, f"{name}.pt")
            env = dict(
                os.environ,
                PJRT_DEVICE="CPU",
                CPU_NUM_DEVICES=str(args.world_size),
                XLA_USE_DUMMY_STORE="1",
                TORCH_DIST_INIT_BARRIER="0",
            )
            cmd = [sys.executable, __file__, "--memory-worker", arm, "--result", str(result)]
            for option in (*_WORKER_OPTIONS, "precision", "optimizer", "world_size"):
                cmd += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
            cmd += ["--reshard-after-forward", reshard]
            dump = Path(tmp, f"{name}.dump")
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
            log.info("memory: %s", name)
            if subprocess.run(cmd, env=env).returncode == -signal.SIGABRT:
                # XLA:CPU's rendezvous abort on a loaded machine, as in _run_worker
                log.warning(
                    "%s: XLA aborted the worker (a collective's rendezvous); once more", name
                )
                report.setdefault("retried", []).append(name)
                shutil.rmtree(dump, ignore_errors=True)
                subprocess.run(cmd, env=env, check=True)
            out = torch.load(result)
            return out, _peaks(dump)

        for arm in arms:
            out, peaks = run_arm(arm, args.reshard_after_forward)
            params[arm] = _full_params(arm, out["params"])
            report["arms"][arm] = {
                "device_bytes": out["steps"][-1],
                "device_bytes_last_rank": (out["steps_last_rank"] or out["steps"])[-1],
                **peaks,
            }
            if arm in ("grouped", "per-param") and args.reshard_after_forward == "true":
                # the same mode without resharding after forward: --check
                # requires resharding to lower the peak
                _, peaks = run_arm(arm, "false")
                report["arms"][arm]["peak_bytes_reshard_after_forward_false"] = peaks[
                    "peak_bytes_largest_graph"
                ]
    for arm, full in params.items():
        if arm == "floor":
            continue
        report["arms"][arm]["max_abs_diff_vs_reference"] = max(
            (full[k].float() - reference[k]).abs().max().item() for k in reference
        )
        report["arms"][arm]["moved"] = sum(
            not torch.equal(full[k].float(), build_ref) for k, build_ref in _initial(args).items()
        )
    if "grouped" in params and "per-param" in params:
        report["grouped_vs_per_param"] = _first_difference(params["grouped"], params["per-param"])
    report["failures"] = _memory_failures(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    for failure in report["failures"]:
        log.error("check failed: %s", failure)
    return 1 if report["failures"] and args.check else 0


def _memory_failures(report: dict) -> list[str]:
    """What ``--memory --check`` enforces: each FSDP2 mode keeps after a step,
    on rank 0 and on the last rank, at most torch_xla's FSDP's device bytes
    and at most 1.05x (sharded parameters + optimizer state + batch); per-param's in-step peak is at
    most grouped's and at most torch_xla's FSDP's; with
    ``reshard_after_forward=True`` each mode's peak is below its peak with
    ``False``; every parameter moved; at ``PARITY_XLA_FLAGS`` the modes agree
    bit for bit."""
    arms, failures = report["arms"], []
    for mode in ("grouped", "per-param"):
        if mode not in arms:
            continue
        for key in ("device_bytes", "device_bytes_last_rank"):
            held = arms[mode][key]
            needed = held["params"] + held["optimizer_state"] + held["batch"]
            if held["total"] > 1.05 * needed:
                failures.append(f"{mode}: {key} {held['total']} B > 1.05 x {needed} B")
            if "xla-fsdp" in arms and held["total"] > arms["xla-fsdp"][key]["total"]:
                failures.append(f"{mode}: {key} above torch_xla's FSDP's")
    for arm, entry in arms.items():
        if arm != "floor" and entry["moved"] != len(_initial_names(report)):
            failures.append(f"{arm}: {entry['moved']} parameters moved")
    for mode in ("grouped", "per-param"):
        peak_false = arms.get(mode, {}).get("peak_bytes_reshard_after_forward_false")
        if peak_false is not None and arms[mode]["peak_bytes_largest_graph"] >= peak_false:
            failures.append(
                f"{mode}: in-step peak with reshard_after_forward=True "
                f"({arms[mode]['peak_bytes_largest_graph']} B) not below False's ({peak_false} B)"
            )
    if (
        "per-param" in arms
        and "xla-fsdp" in arms
        and arms["per-param"]["peak_bytes_largest_graph"]
        > arms["xla-fsdp"]["peak_bytes_largest_graph"]
    ):
        failures.append("per-param's in-step peak > torch_xla's FSDP's")
    if "grouped" in arms and "per-param" in arms:
        if (
            arms["per-param"]["peak_bytes_largest_graph"]
            > arms["grouped"]["peak_bytes_largest_graph"]
        ):
            failures.append("per-param's in-step peak > grouped's")
        if PARITY_XLA_FLAGS in report["xla_flags"] and report["grouped_vs_per_param"]:
            failures.append(f"grouped vs per-param: {report['grouped_vs_per_param']}")
    return failures


def _initial_names(report: dict) -> range:
    return range(report["parameters"])


def _initial(args: argparse.Namespace) -> dict:
    return {k: v.detach() for k, v in build_model(**_model_args(args)).state_dict().items()}


def _first_difference(a, b) -> str:
    for k in a:
        if not torch_equal(a[k], b[k]):
            diff = (a[k].float() - b[k].float()).abs()
            return f"{k}: {int((diff > 0).sum())} elements differ, max {diff.max().item():.3e}"
    return ""


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def check(args: argparse.Namespace) -> int:
    retried: list[str] = []
    out: dict = {
        "counts": {config: {} for config in COUNT_CONFIGS},
        "configs": {},
        "parity_xla_flags": PARITY_XLA_FLAGS,
        "workers_run_again": retried,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for config in COUNT_CONFIGS:
            for mode in MODES:
                out["counts"][config][mode] = _run_worker(
                    args, mode, CONFIGS[config][0], [config], tmp, count=True, retried=retried
                )["counts"]
        runs: dict[str, dict[str, dict]] = {mode: {} for mode in MODES}
        for mode in MODES:
            for world_size in sorted({CONFIGS[c][0] for c in args.configs}):
                configs = [
                    c
                    for c in args.configs
                    if CONFIGS[c][0] == world_size and mode not in CONFIGS[c][1].get("not_in", ())
                ]
                if configs:
                    runs[mode].update(
                        _run_worker(
                            args, mode, world_size, configs, tmp, count=False, retried=retried
                        )["configs"]
                    )
    for config in args.configs:
        world_size = CONFIGS[config][0]
        results = {mode: runs[mode][config] for mode in MODES if config in runs[mode]}
        reference = results["grouped"]["params"]
        entry = {
            "world_size": world_size,
            "parameters": len(reference),
            "moved": {mode: len(r["moved"]) for mode, r in results.items()},
            "differences": {
                mode: _first_difference(reference, r["params"])
                for mode, r in results.items()
                if mode != "grouped"
            },
        }
        entry["parity"] = not any(entry["differences"].values()) and all(
            moved == entry["parameters"] for moved in entry["moved"].values()
        )
        out["configs"][config] = entry
        log.info("%s: parity %s, moved %s", config, entry["parity"], entry["moved"])
    out["parity"] = all(c["parity"] for c in out["configs"].values())
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    failures = [f"{c}: parity" for c, e in out["configs"].items() if not e["parity"]]
    for config, counts in out["counts"].items():
        failures += [f"{config}: {f}" for f in _count_failures(counts)]
    for failure in failures:
        log.error("check failed: %s", failure)
    return 1 if failures and args.check else 0


def _count_failures(counts: dict[str, dict]) -> list[str]:
    """What per-param (tuple) does per step that it must not: more
    collectives than grouped, before or after XLA's passes; any data-movement
    op more often than grouped after them; a concatenate where grouped has
    any; more host round trips or graphs."""
    grouped, per_param = counts["grouped"], counts["per-param"]
    failures = []
    checks = [
        (stage, op)
        for stage in ("before_optimizations", "after_optimizations")
        for op in ("all_gather", "reduce_scatter")
    ]
    checks += [("after_optimizations", op.replace("-", "_")) for op in DATA_MOVEMENT_OPS]
    for stage, op in checks:
        if per_param[stage][op] > grouped[stage][op]:
            failures.append(f"per-param {stage} {op} {per_param[stage][op]} > {grouped[stage][op]}")
    if per_param["before_optimizations"]["concatenate"] >= max(
        grouped["before_optimizations"]["concatenate"], 1
    ):
        failures.append("per-param concatenates")
    for key in ("host_round_trips", "graphs_executed"):
        if per_param[key] > grouped[key]:
            failures.append(f"per-param {key} {per_param[key]} > grouped {grouped[key]}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: python tools/xla_check.py --check --out xla.json",
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every config has parity with every parameter moved, and, "
        "in fp32 and bf16, per-param needs per step no more all-gathers, reduce-scatters, "
        "host round trips or graphs than grouped, fewer concatenates, and after XLA's "
        "passes no more of each data-movement op (DATA_MOVEMENT_OPS)",
    )
    parser.add_argument(
        "--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="default: all"
    )
    parser.add_argument(
        "--bench",
        action="store_true",
        help="time the modes and the floor (no FSDP) instead, alternating them in one "
        "process (use a larger model: see docs/xla.md for the command); --steps rounds "
        "after --warmup rounds",
    )
    parser.add_argument(
        "--bench-steps", type=int, default=4, help="--bench: steps of each mode per round"
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="--bench: fp32, or bf16 parameters with fp32 reduction (MixedPrecisionPolicy)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the counts")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--world-size", type=int, default=2, help="--bench, --memory: ranks")
    parser.add_argument(
        "--vocab", type=int, default=104, help="divisible by 4 (see docs/xla.md, the test bed)"
    )
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=76)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument(
        "--memory",
        action="store_true",
        help="device bytes after a step per arm (--arms) and parity against the unsharded "
        "CPU reference; --world-size, --precision, --optimizer, --reshard-after-forward",
    )
    parser.add_argument("--arms", nargs="+", choices=MEMORY_ARMS, default=list(MEMORY_ARMS))
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default="true")
    parser.add_argument("--memory-worker", choices=MEMORY_ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dump-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.worker:
        worker(args)
        return 0
    if args.memory_worker:
        memory_worker(args)
        return 0
    if args.memory:
        return memory(args)
    if args.bench:
        os.environ.update(
            PJRT_DEVICE="CPU",
            CPU_NUM_DEVICES=str(args.world_size),
            XLA_USE_DUMMY_STORE="1",
            TORCH_DIST_INIT_BARRIER="0",
        )
        bench(args)
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
