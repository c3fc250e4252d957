#!/usr/bin/env python3
"""Benchmark FSDP2 side by side: upstream, grouped and per-parameter collectives.

For each process group and world size, each model is sharded five ways from
the same seed and trained in one run:

  upstream              torch.distributed.fsdp.fully_shard
  grouped               torch_fsdp_ext.fully_shard(..., group_collectives=True)
  per-param             torch_fsdp_ext.fully_shard(..., group_collectives=False),
                        a group's collectives coalesced (dist._coalescing_manager)
  per-param-nocoalesce  the same, one collective after another (bench-only knob:
                        _fsdp_collectives._COALESCING_BACKENDS = () around its steps;
                        a registered FSDP backend that decides coalescing for the
                        device overrides it, and the bench warns)
  deterministic         per-param with DeterministicReduceScatter on every module

Metrics per mode: median, quartiles and min/max of the step time (forward,
backward, AdamW step, zero_grad; the max over ranks of each step), also as a
ratio to upstream; FSDP-side copy bytes counted by dispatch (bytes written by
copy ops issued from FSDP's own code); peak bytes allocated in forward and in
backward (the exact profiler method of test/test_fully_shard_per_param_memory.py
on CPU, CUDA memory stats on GPU); number and bytes of collectives.

Models: two Llama-like transformers (tools/demo.py's, scaled to CPU), the
residual MLP stack of the memory test, a group of many small parameters
(64 of 64x64), a group of few large ones (2 of 2048x2048), and a sweep of one
group of n params at a fixed total size. The MoE model of issue 5 does not
exist yet and is not benchmarked.

Process groups: gloo (one process per rank), the fake process group (one
process; collectives move no data, so it measures FSDP's own work: copies,
allocations, Python and launch time) and NCCL on CUDA. On the fake process
group the bench adds "fake" to _COALESCING_BACKENDS for the coalesced modes,
so that it runs the same code path as gloo and NCCL (the package itself does
not coalesce on "fake").

Every rank runs one intra-op thread by default (--threads). Writes
OUT/bench.json (or --json PATH), OUT/bench.md (also printed) and PNG plots
(time, memory, copies, sweep) in OUT/, bench-out/ by default; --profile adds
torch.profiler tables and memory-peak sites in OUT/profiles/.
Results and commands for this repository's machine: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream_fsdp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ROOT = Path(__file__).resolve().parent.parent
# demo.py (the transformer) sits next to this file
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

from demo import Transformer  # noqa: E402

from torch_fsdp_ext._testing.comm_recorder import CommRecorder  # noqa: E402
from torch_fsdp_ext._testing.memory import profile_step, step_peak_bytes  # noqa: E402

log = logging.getLogger("torch_fsdp_ext.bench")

MiB = 1 << 20
LOG_FORMAT = "%(asctime)s %(message)s"


# ---------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str
    upstream: bool = False
    group_collectives: bool = True
    # None: not a per-parameter mode; True/False: coalesce a group's collectives
    coalesce: bool | None = None
    deterministic: bool = False


MODES = [
    Mode("upstream", upstream=True),
    Mode("grouped"),
    Mode("per-param", group_collectives=False, coalesce=True),
    Mode("per-param-nocoalesce", group_collectives=False, coalesce=False),
    Mode("deterministic", group_collectives=False, coalesce=True, deterministic=True),
]
MODES_BY_NAME = {m.name: m for m in MODES}
SWEEP_MODES = ["grouped", "per-param", "per-param-nocoalesce"]


@contextlib.contextmanager
def _coalescing(mode: Mode) -> Iterator[None]:
    """Bench-only knob: the backends the per-parameter path coalesces on.

    ``per-param-nocoalesce`` empties the list; the other per-parameter modes
    add "fake" to it so the fake process group runs the coalesced code path.
    """
    if mode.coalesce is None:
        yield
        return
    from torch_fsdp_ext._fully_shard import _fsdp_collectives

    saved = _fsdp_collectives._COALESCING_BACKENDS
    _fsdp_collectives._COALESCING_BACKENDS = (
        tuple(dict.fromkeys((*saved, "fake"))) if mode.coalesce else ()
    )
    try:
        yield
    finally:
        _fsdp_collectives._COALESCING_BACKENDS = saved


def _shard(model: nn.Module, mode: Mode, wrap: list[nn.Module], mesh: DeviceMesh) -> nn.Module:
    """Applies ``fully_shard`` to each of ``wrap`` (modules of ``model``), then to ``model``."""
    import torch_fsdp_ext

    if mode.upstream:
        fully_shard, kwargs = upstream_fsdp.fully_shard, {}
    else:
        fully_shard = torch_fsdp_ext.fully_shard
        kwargs = {"group_collectives": mode.group_collectives}
    for module in wrap:
        fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    if mode.deterministic:
        for module in model.modules():
            if isinstance(module, upstream_fsdp.FSDPModule):
                module.set_custom_reduce_scatter(torch_fsdp_ext.DeterministicReduceScatter())
    return model


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


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
    kind: str  # "llama" or "chain"
    config: dict[str, int]
    description: str

    def build(self) -> nn.Module:
        c = self.config
        if self.kind == "llama":
            return Transformer(c["vocab"], c["dim"], c["heads"], c["layers"])
        if self.kind == "mlp":
            from common_fsdp_ext import Model

            return Model(c["dim"], c["hidden"], c["blocks"])
        return LinearChain(c["num_params"], c["dim"])

    def wrap(self, model: nn.Module) -> list[nn.Module]:
        """Modules that get their own ``fully_shard`` before the root."""
        return list(model.blocks) if self.kind in ("llama", "mlp") else []

    def make_input(self, rank: int, device: torch.device) -> torch.Tensor:
        c = self.config
        gen = torch.Generator().manual_seed(42 + rank)
        if self.kind == "llama":
            inp = torch.randint(c["vocab"], (c["batch"], c["seq"]), generator=gen)
        else:
            inp = torch.randn(c["batch"], c["dim"], generator=gen)
        return inp.to(device)


def _llama(name: str, vocab: int, dim: int, heads: int, layers: int, batch: int, seq: int):
    return ModelSpec(
        name,
        "llama",
        dict(vocab=vocab, dim=dim, heads=heads, layers=layers, batch=batch, seq=seq),
        f"transformer (tools/demo.py): vocab {vocab}, dim {dim}, {heads} heads, "
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
            "residual MLP stack of test/common_fsdp_ext.py (dim 256, hidden 1024, 3 blocks, "
            "batch 4; the model of test/test_fully_shard_per_param_memory.py): parameters "
            "outweigh activations; fully_shard per block + root",
        ),
        _chain("many-small", num_params=64, dim=64, batch=32),
        _chain("few-large", num_params=2, dim=2048, batch=8),
    )
}
# The sweep: one group of n square params with a fixed total of 2**20
# elements (4 MiB fp32), so FLOPs per step are the same at every point
SWEEP_TOTAL_NUMEL = 1 << 20
SWEEP_BATCH = 16


def _sweep_spec(num_params: int) -> ModelSpec:
    dim = math.isqrt(SWEEP_TOTAL_NUMEL // num_params)
    assert dim * dim * num_params == SWEEP_TOTAL_NUMEL, num_params
    return _chain(f"sweep-{num_params}", num_params, dim, SWEEP_BATCH)


# ---------------------------------------------------------------------------
# Measurements (run on every rank)
# ---------------------------------------------------------------------------


@dataclass
class RunConfig:
    pg: str
    world_size: int
    device: str
    models: list[str]
    sweep: list[int]
    warmup: int
    steps: int
    threads: int
    profile_dir: str | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, inp: torch.Tensor) -> None:
    loss = model(inp).sum()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _forward_backward(model: nn.Module, inp: torch.Tensor) -> None:
    model(inp).sum().backward()
    for param in model.parameters():
        param.grad = None


def _cuda_step_peak_bytes(model: nn.Module, inp: torch.Tensor) -> tuple[int, int]:
    """Like ``step_peak_bytes`` but from CUDA memory stats."""
    device = inp.device
    _forward_backward(model, inp)  # lazy init
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    loss = model(inp).sum()
    _sync(device)
    fwd = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    _sync(device)
    bwd = torch.cuda.max_memory_allocated(device) - baseline
    del loss
    for param in model.parameters():
        param.grad = None
    return fwd, bwd


# Kineto's start/stop lines and the CPU allocator's warning about blocks
# allocated before profiling (expected: see ``step_peak_bytes``)
_PROFILER_NOISE = ("USDT:", "STAGE:", "Memory block of unknown size")


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[None]:
    """Drops the profiler's C++ log lines from stderr; other lines pass through."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not any(noise in line for noise in _PROFILER_NOISE):
                    sys.stderr.write(line)


def _step_peak_bytes(model: nn.Module, inp: torch.Tensor) -> tuple[int, int]:
    if inp.device.type == "cuda":
        return _cuda_step_peak_bytes(model, inp)
    with _quiet_profiler():
        return step_peak_bytes(model, inp)


def _reduce_scatter_buffer_bytes(model: nn.Module) -> list[int]:
    """Per parameter group: bytes of the grouped path's reduce-scatter input
    (the ``chunk_cat`` buffer: padded unsharded gradients, fp32 here)."""
    sizes = []
    for module in model.modules():
        if not isinstance(module, upstream_fsdp.FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            world_size = group.mesh_info.shard_mesh_size
            numel = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
            sizes.append(numel * world_size * 4)
    return sizes


def _stats(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": statistics.median(ordered),
        "q1": q1,
        "q3": q3,
        "min": ordered[0],
        "max": ordered[-1],
        "samples": samples,
    }


def _sharded_copy(spec: ModelSpec, base: nn.Module, mode: Mode, mesh: DeviceMesh) -> nn.Module:
    model = copy.deepcopy(base)
    return _shard(model, mode, spec.wrap(model), mesh)


def _bench_model(
    spec: ModelSpec,
    mode_names: list[str],
    cfg: RunConfig,
    mesh: DeviceMesh,
    rank: int,
    device: torch.device,
    *,
    memory: bool,
) -> dict[str, Any]:
    torch.manual_seed(42)
    base = spec.build().to(device)
    num_params = sum(p.numel() for p in base.parameters())
    inp = spec.make_input(rank, device)
    modes = [MODES_BY_NAME[n] for n in mode_names]
    models = {m.name: _sharded_copy(spec, base, m, mesh) for m in modes}
    optims = {
        name: torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        for name, model in models.items()
    }
    result: dict[str, Any] = {
        "model": spec.name,
        "description": spec.description,
        "config": spec.config,
        "numel": num_params,
        "num_tensors": sum(1 for _ in base.parameters()),
        "reduce_scatter_buffer_bytes": _reduce_scatter_buffer_bytes(models[mode_names[0]]),
        "modes": {},
    }
    # Warm-up, then timed rounds; the order of the modes rotates every round
    # so that load drift and cache effects do not favour one mode
    for _ in range(cfg.warmup):
        for mode in modes:
            with _coalescing(mode):
                _train_step(models[mode.name], optims[mode.name], inp)
    times = torch.zeros(len(modes), cfg.steps, dtype=torch.float64)
    for step in range(cfg.steps):
        for k in range(len(modes)):
            i = (step + k) % len(modes)
            mode = modes[i]
            dist.barrier()
            _sync(device)
            with _coalescing(mode):
                start = time.perf_counter()
                _train_step(models[mode.name], optims[mode.name], inp)
                _sync(device)
                times[i, step] = time.perf_counter() - start
    # A step takes as long as its slowest rank
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    for i, mode in enumerate(modes):
        with _coalescing(mode):
            _forward_backward(models[mode.name], inp)
            with CommRecorder() as recorder:
                _forward_backward(models[mode.name], inp)
        summary = recorder.summary()
        coll = summary["collectives"]
        if mode.coalesce is False and coll["ops"] != coll["tensors"] and rank == 0:
            # e.g. a registered FSDP backend (patch 0006) that decides coalescing
            log.warning(
                "%s: %s coalesced anyway (%d ops for %d tensors): the bench's knob "
                "_COALESCING_BACKENDS did not apply",
                spec.name,
                mode.name,
                coll["ops"],
                coll["tensors"],
            )
        result["modes"][mode.name] = {"step_time_s": _stats(times[i].tolist()), **summary}
    if cfg.profile_dir is not None:
        for mode in modes:
            _profile(spec, mode, models[mode.name], optims[mode.name], inp, cfg, rank)
    del models, optims
    if memory:
        for mode in modes:
            model = _sharded_copy(spec, base, mode, mesh)
            with _coalescing(mode):
                fwd, bwd = _step_peak_bytes(model, inp)
            result["modes"][mode.name].update(fwd_peak_bytes=fwd, bwd_peak_bytes=bwd)
            del model
    return result


def _peak_sites(model: nn.Module, inp: torch.Tensor) -> list[str]:
    """Where the forward and backward peaks of ``step_peak_bytes`` happen: the
    profiler's op stack at the allocation that reaches each peak (CPU only)."""
    from torch._C._profiler import _EventType

    with _quiet_profiler():
        prof = profile_step(model, inp)
    spans, allocations = {}, []
    stack = [(e, ()) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, path = stack.pop()
        stack.extend((child, (*path, event.name)) for child in event.children)
        spans[event.name] = (event.start_time_ns, event.end_time_ns)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            allocations.append(
                (event.start_time_ns, fields.alloc_size, fields.total_allocated, path)
            )
    allocations.sort(key=lambda a: a[0])
    first = next(a for a in allocations if a[0] >= spans["measured_forward"][0])
    baseline = first[2] - first[1]
    sites = []
    for phase in ("forward", "backward"):
        start, end = spans[f"measured_{phase}"]
        _, size, total, path = max(
            (a for a in allocations if start <= a[0] <= end), key=lambda a: a[2]
        )
        label = f"measured_{phase}"
        if label in path:
            where = " > ".join(path[path.index(label) + 1 :][-5:]) or label
        else:  # e.g. in a backend's own thread (gloo runs collectives in its threads)
            where = "another thread: " + (" > ".join(path[-5:]) or "no op")
        sites.append(
            f"{phase} peak: {(total - baseline) / MiB:.3f} MiB above the step's start, "
            f"reached allocating {size / MiB:.3f} MiB in {where}"
        )
    return sites


def _profile(spec, mode, model, optim, inp, cfg: RunConfig, rank: int) -> None:
    """Writes torch.profiler's key_averages table of one training step and,
    on CPU, where the forward and backward memory peaks happen."""
    sites = []
    if inp.device.type == "cpu":
        with _coalescing(mode):
            sites = _peak_sites(model, inp)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if inp.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with (
        _quiet_profiler(),
        _coalescing(mode),
        torch.profiler.profile(activities=activities) as prof,
    ):
        _train_step(model, optim, inp)
        _sync(inp.device)
    if rank == 0:
        path = Path(cfg.profile_dir) / f"{cfg.pg}-w{cfg.world_size}-{spec.name}-{mode.name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        sort_by = "self_device_time_total" if inp.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=30)
        path.write_text("".join(f"{site}\n" for site in sites) + table + "\n")


def _run_suite(rank: int, cfg: RunConfig) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    # Fake all-gathers leave parameters uninitialized; flushing denormals
    # keeps garbage values from slowing down the math (applied in every run)
    torch.set_flush_denormal(True)
    if cfg.device == "cuda":
        device = torch.device("cuda", rank if cfg.pg != "fake" else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (cfg.world_size,))
    run: dict[str, Any] = {
        "pg": cfg.pg,
        "world_size": cfg.world_size,
        "device": str(device.type),
        "threads_per_rank": cfg.threads,
        "warmup_steps": cfg.warmup,
        "timed_steps": cfg.steps,
        "loadavg_start": _loadavg(),
        "models": [],
        "sweep": [],
    }
    start = time.perf_counter()
    for name in cfg.models:
        if rank == 0:
            log.info("  %s W=%d: %s", cfg.pg, cfg.world_size, name)
        run["models"].append(
            _bench_model(
                MODELS[name], [m.name for m in MODES], cfg, mesh, rank, device, memory=True
            )
        )
    for num_params in cfg.sweep:
        if rank == 0:
            log.info("  %s W=%d: sweep, %d params per group", cfg.pg, cfg.world_size, num_params)
        run["sweep"].append(
            _bench_model(
                _sweep_spec(num_params), SWEEP_MODES, cfg, mesh, rank, device, memory=False
            )
        )
    run["wall_s"] = time.perf_counter() - start
    run["loadavg_end"] = _loadavg()
    return run


def _worker(rank: int, cfg: RunConfig, store_path: str, result_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, cfg.world_size)
    dist.init_process_group(cfg.pg, rank=rank, world_size=cfg.world_size, store=store)
    try:
        run = _run_suite(rank, cfg)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(run))


def _run(cfg: RunConfig) -> dict[str, Any]:
    log.info(
        "%s W=%d on %s, %d thread(s) per rank, %d warm-up + %d timed steps",
        cfg.pg,
        cfg.world_size,
        cfg.device,
        cfg.threads,
        cfg.warmup,
        cfg.steps,
    )
    if cfg.pg == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.world_size)
        try:
            return _run_suite(0, cfg)
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker,
            args=(cfg, os.path.join(tmp, "store"), result_path),
            nprocs=cfg.world_size,
            join=True,
        )
        return json.loads(Path(result_path).read_text())


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def _machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(OSError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / (1 << 30), 1)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _add_ratios(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        for entry in [*run["models"], *run["sweep"]]:
            modes = entry["modes"]
            ref = modes.get("upstream", modes.get("grouped"))["step_time_s"]["median"]
            grouped = modes["grouped"]["step_time_s"]["median"]
            for stats in modes.values():
                median = stats["step_time_s"]["median"]
                stats["time_ratio_to_upstream"] = median / ref if "upstream" in modes else None
                stats["time_ratio_to_grouped"] = median / grouped


TARGET_COPY_FRACTION = 0.05
TARGET_RS_BUFFER_FRACTION = 0.9
TARGET_TIME_RATIO = 1.05


def _targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, for every Llama-like model in every run (the
    issue states them for gloo at W=4)."""
    targets = []
    for run in runs:
        for entry in run["models"]:
            if not entry["model"].startswith(("llama", "mlp")):
                continue
            modes = entry["modes"]
            per_param, grouped = modes["per-param"], modes["grouped"]
            where = {"pg": run["pg"], "world_size": run["world_size"], "model": entry["model"]}
            rs_buffer = max(entry["reduce_scatter_buffer_bytes"])
            copy_limit = TARGET_COPY_FRACTION * grouped["copy_bytes"]
            mem_limit = grouped["bwd_peak_bytes"] - TARGET_RS_BUFFER_FRACTION * rs_buffer
            time_ratio = per_param["time_ratio_to_grouped"]
            targets += [
                {
                    **where,
                    "target": "per-param copy bytes <= 5% of grouped",
                    "value": per_param["copy_bytes"],
                    "limit": copy_limit,
                    "met": per_param["copy_bytes"] <= copy_limit,
                },
                {
                    **where,
                    "target": "per-param bwd peak <= grouped - 0.9 x RS buffer",
                    "value": per_param["bwd_peak_bytes"],
                    "limit": mem_limit,
                    "rs_buffer_bytes": rs_buffer,
                    "saving_in_rs_buffers": (
                        grouped["bwd_peak_bytes"] - per_param["bwd_peak_bytes"]
                    )
                    / rs_buffer,
                    "met": per_param["bwd_peak_bytes"] <= mem_limit,
                },
                {
                    **where,
                    "target": "per-param / grouped step time <= 1.05",
                    "value": time_ratio,
                    "limit": TARGET_TIME_RATIO,
                    "met": time_ratio <= TARGET_TIME_RATIO,
                },
            ]
    return targets


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.2f}"


def _ms(stats: dict[str, Any]) -> str:
    return f"{stats['median'] * 1e3:.1f} [{stats['q1'] * 1e3:.1f}-{stats['q3'] * 1e3:.1f}]"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    machine = meta["machine"]
    lines = [
        "# tools/bench.py results",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {machine.get('cpu_model', '?')}, {machine['cpus']} CPUs, "
        f"{machine.get('memory_gib', '?')} GiB, {machine['platform']}; torch {machine['torch']}"
        + (f"; GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else "")
        + ".",
        f"Load average at start / end: `{meta['loadavg_start']}` / `{meta['loadavg_end']}`. "
        f"Total {meta['wall_s']:.0f} s.",
        "",
        "Step time: median [quartiles] in ms over the timed steps of one training step "
        "(forward, backward, AdamW, zero_grad), the slowest rank per step. Peaks: bytes "
        "allocated above the step's start, in forward and in backward. Copies: bytes "
        "written by FSDP-side copy ops in one forward+backward; backend copies: those the "
        "process group dispatches when a collective completes (gloo's reduce-scatter "
        "copy-out). Collectives: ops issued / tensors / MiB of payload (all-gather outputs, "
        "reduce-scatter and all-to-all inputs) in one forward+backward.",
        "",
    ]
    for run in report["runs"]:
        lines += [
            f"## {run['pg']}, world size {run['world_size']} ({run['device']}, "
            f"{run['threads_per_rank']} thread(s) per rank, {run['warmup_steps']} warm-up + "
            f"{run['timed_steps']} timed steps, load {run['loadavg_start']})",
            "",
            "| model | mode | step ms | vs upstream | vs grouped | fwd peak MiB | "
            "bwd peak MiB | copy MiB | backend copy MiB | collectives ops / tensors / MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for entry in run["models"]:
            for name, stats in entry["modes"].items():
                coll = stats["collectives"]
                lines.append(
                    f"| {entry['model']} | {name} | {_ms(stats['step_time_s'])} | "
                    f"{_ratio(stats['time_ratio_to_upstream'])} | "
                    f"{_ratio(stats['time_ratio_to_grouped'])} | "
                    f"{_mib(stats['fwd_peak_bytes'])} | {_mib(stats['bwd_peak_bytes'])} | "
                    f"{_mib(stats['copy_bytes'])} | {_mib(stats['backend_copy_bytes'])} | "
                    f"{coll['ops']} / {coll['tensors']} / {_mib(coll['bytes'])} |"
                )
        if run["sweep"]:
            lines += [
                "",
                f"Sweep: one group of n square params, {SWEEP_TOTAL_NUMEL} elements in all, "
                f"batch {SWEEP_BATCH}; step ms median [quartiles] and ratio to grouped.",
                "",
                "| params per group | " + " | ".join(SWEEP_MODES) + " |",
                "|---|" + "---|" * len(SWEEP_MODES),
            ]
            for entry in run["sweep"]:
                cells = [
                    f"{_ms(entry['modes'][m]['step_time_s'])} "
                    f"(x{entry['modes'][m]['time_ratio_to_grouped']:.3f})"
                    for m in SWEEP_MODES
                ]
                lines.append(f"| {entry['config']['num_params']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Targets (issue 6; stated for gloo at W=4)",
        "",
        "| pg | W | model | target | value | limit | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in report["targets"]:
        if "bytes" in t["target"] or "peak" in t["target"]:
            value, limit = f"{_mib(t['value'])} MiB", f"{_mib(t['limit'])} MiB"
            if "saving_in_rs_buffers" in t:
                value += f" (saves {t['saving_in_rs_buffers']:.2f} RS buffers)"
        else:
            value, limit = f"{t['value']:.3f}", f"{t['limit']:.2f}"
        lines.append(
            f"| {t['pg']} | {t['world_size']} | {t['model']} | {t['target']} | {value} | "
            f"{limit} | {'yes' if t['met'] else 'NO'} |"
        )
    lines += [
        "",
        "The MoE model of issue 5 does not exist yet; it is not benchmarked.",
        "",
    ]
    return "\n".join(lines)


def _mode_colors() -> dict[str, str]:
    return dict(
        zip(
            [m.name for m in MODES],
            ["#7f7f7f", "#1f77b4", "#2ca02c", "#98df8a", "#d62728"],
            strict=True,
        )
    )


def render_plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = _mode_colors()
    runs = report["runs"]
    model_names = list(dict.fromkeys(e["model"] for r in runs for e in r["models"]))
    paths = []

    def grid(title: str):
        fig, axes = plt.subplots(
            len(runs),
            len(model_names),
            figsize=(3.2 * len(model_names), 2.6 * len(runs) + 0.6),
            squeeze=False,
            constrained_layout=True,
        )
        fig.suptitle(title)
        return fig, axes

    def each_panel(axes):
        for row, run in enumerate(runs):
            entries = {e["model"]: e for e in run["models"]}
            for col, model in enumerate(model_names):
                ax = axes[row][col]
                ax.set_title(f"{run['pg']} W={run['world_size']}: {model}", fontsize=8)
                ax.tick_params(labelsize=7)
                if model not in entries:
                    ax.set_axis_off()
                    continue
                yield ax, entries[model]

    # Step time
    fig, axes = grid("Step time: median, whiskers = quartiles (ms)")
    for ax, entry in each_panel(axes):
        names = list(entry["modes"])
        med = [entry["modes"][n]["step_time_s"]["median"] * 1e3 for n in names]
        lo = [
            m - entry["modes"][n]["step_time_s"]["q1"] * 1e3
            for m, n in zip(med, names, strict=True)
        ]
        hi = [
            entry["modes"][n]["step_time_s"]["q3"] * 1e3 - m
            for m, n in zip(med, names, strict=True)
        ]
        ax.bar(range(len(names)), med, yerr=[lo, hi], color=[colors[n] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    paths.append(out / "time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Peak memory
    fig, axes = grid(
        "Peak bytes allocated above the step's start (MiB): forward (light), backward (dark)"
    )
    for ax, entry in each_panel(axes):
        names = list(entry["modes"])
        x = range(len(names))
        fwd = [entry["modes"][n]["fwd_peak_bytes"] / MiB for n in names]
        bwd = [entry["modes"][n]["bwd_peak_bytes"] / MiB for n in names]
        ax.bar([i - 0.2 for i in x], fwd, 0.4, color=[colors[n] for n in names], alpha=0.5)
        ax.bar([i + 0.2 for i in x], bwd, 0.4, color=[colors[n] for n in names])
        ax.set_xticks(list(x), names, rotation=40, ha="right")
    paths.append(out / "memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Copy bytes
    fig, axes = grid("FSDP-side copy bytes in one forward + backward (MiB)")
    for ax, entry in each_panel(axes):
        names = list(entry["modes"])
        bars = ax.bar(
            range(len(names)),
            [entry["modes"][n]["copy_bytes"] / MiB for n in names],
            color=[colors[n] for n in names],
        )
        ax.bar_label(bars, fmt="%.3g", fontsize=6)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    paths.append(out / "copies.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Sweep
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    styles = ["-", "--", ":", "-."]
    for k, run in enumerate(r for r in runs if r["sweep"]):
        xs = [e["config"]["num_params"] for e in run["sweep"]]
        for mode in ("per-param", "per-param-nocoalesce"):
            ys = [e["modes"][mode]["time_ratio_to_grouped"] for e in run["sweep"]]
            ax.plot(
                xs,
                ys,
                styles[k % len(styles)],
                marker="o",
                color=colors[mode],
                label=f"{mode}, {run['pg']} W={run['world_size']}",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(TARGET_TIME_RATIO, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel(f"params per group ({SWEEP_TOTAL_NUMEL} elements in all)")
    ax.set_ylabel("median step time / grouped")
    ax.set_title("Per-parameter vs grouped collectives")
    ax.legend(fontsize=7)
    paths.append(out / "sweep.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


# few-large is the slowest model on gloo (its gloo collectives copy 32 MiB)
QUICK_MODELS = ["llama-S", "many-small", "few-large"]
QUICK_GLOO_MODELS = ["llama-S", "many-small"]
QUICK_SWEEP = [4, 64, 256]
FULL_SWEEP = [4, 16, 64, 256]


def _plan(args: argparse.Namespace) -> list[RunConfig]:
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU is available")
        gpus = torch.cuda.device_count()
        pgs = args.pg or (["nccl", "fake"] if gpus >= 2 else ["fake"])
    else:
        pgs = args.pg or ["gloo", "fake"]
    if "nccl" in pgs and args.device != "cuda":
        raise SystemExit("--pg nccl needs --device cuda")
    if "gloo" in pgs and args.device == "cuda":
        raise SystemExit("--pg gloo runs on CPU; use --device cpu")
    default_sizes = {
        "gloo": [2] if args.quick else [2, 4],
        "fake": [8],
        "nccl": [min(torch.cuda.device_count(), 8)] if args.device == "cuda" else [],
    }
    if args.quick:
        models, sweep, warmup, steps = QUICK_MODELS, QUICK_SWEEP, 1, 3
    else:
        models, sweep, warmup, steps = list(MODELS), FULL_SWEEP, 3, args.steps
    if args.models is not None:
        models = args.models
    if args.sweep is not None:
        sweep = args.sweep
    plan = []
    for pg in pgs:
        for world_size in args.world_size or default_sizes[pg]:
            if pg == "nccl" and world_size > torch.cuda.device_count():
                raise SystemExit(f"nccl W={world_size}: only {torch.cuda.device_count()} GPUs")
            threads = args.threads
            # Quick mode sweeps on the fake process group only
            plan.append(
                RunConfig(
                    pg=pg,
                    world_size=world_size,
                    device=args.device,
                    models=QUICK_GLOO_MODELS
                    if args.quick and pg == "gloo" and args.models is None
                    else models,
                    sweep=sweep if (not args.quick or pg == "fake" or args.sweep) else [],
                    warmup=warmup,
                    steps=steps,
                    threads=threads,
                    profile_dir=str(args.out / "profiles") if args.profile else None,
                )
            )
    return plan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out", help="output folder")
    parser.add_argument("--json", type=Path, help="JSON path (default: OUT/bench.json)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="gloo W=2 (llama-S, many-small) and fake W=8 (llama-S, many-small, few-large), "
        "1 warm-up + 3 timed steps, sweep on fake only (under a minute on 2 cores)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--pg",
        nargs="+",
        choices=["gloo", "fake", "nccl"],
        help="process groups (default: gloo and fake on cpu; nccl (>= 2 GPUs) and fake on cuda)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        help="world sizes for every process group (default: gloo 2 4, fake 8, nccl #GPUs)",
    )
    parser.add_argument(
        "--steps", type=int, default=15, help="timed steps per mode (full mode; >= 10)"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        help=f"models to run (default: all; --quick: {' '.join(QUICK_MODELS)})",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        help="params per group of the sweep, none to skip it (default: "
        f"{' '.join(map(str, FULL_SWEEP))}; --quick: {' '.join(map(str, QUICK_SWEEP))}, "
        "on fake only)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per rank (default 1: on a loaded machine, OpenMP threads "
        "that spin-wait for a busy core make step times erratic)",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="measure nothing: render OUT/bench.md and the plots again from a bench JSON",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also write torch.profiler key_averages of one step per mode to OUT/profiles/",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot is not None:
        _write_report(json.loads(args.replot.read_text()), args.out)
        return
    json_path = args.json or args.out / "bench.json"
    command = " ".join(["tools/bench.py", *(sys.argv[1:] if argv is None else argv)])

    start = time.perf_counter()
    meta = {
        "command": command,
        "quick": args.quick,
        "machine": _machine(args.device),
        "loadavg_start": _loadavg(),
        "modes": [asdict(m) for m in MODES],
        "models": {name: asdict(spec) for name, spec in MODELS.items()},
        "notes": [
            "MoE model of issue 5: not benchmarked, it does not exist yet",
            "fake process group: 'fake' added to _COALESCING_BACKENDS for the coalesced modes",
            "collective bytes: all-gather output, reduce-scatter and all-to-all input, "
            "all-reduce tensors",
        ],
    }
    runs = [_run(cfg) for cfg in _plan(args)]
    _add_ratios(runs)
    meta["loadavg_end"] = _loadavg()
    meta["wall_s"] = time.perf_counter() - start
    report = {"meta": meta, "runs": runs, "targets": _targets(runs)}

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    log.info("wrote %s", json_path)
    _write_report(report, args.out)


def _write_report(report: dict[str, Any], out: Path) -> None:
    markdown = render_markdown(report)
    (out / "bench.md").write_text(markdown)
    plots = render_plots(report, out)
    print(markdown)
    log.info("wrote %s, %s", out / "bench.md", ", ".join(map(str, plots)))


if __name__ == "__main__":
    main()
