"""Measurements, run on every rank: the configuration of one run, a timed
training step, peak memory (profiler on CPU, CUDA memory stats on GPU),
reduce-scatter buffer sizes, step-time statistics and the collectives and
copies of a step, for one model in every mode (:func:`bench_model`); with
``--profile`` also a profiler table and the memory-peak sites per mode."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream_fsdp
import torch.nn as nn

from fsdp_ext_testing.comm_recorder import CommRecorder
from fsdp_ext_testing.memory import (
    REDUCE_LABEL,
    LossFn,
    StepPeaks,
    profile_step,
    step_peak_bytes,
)

from .fsdp_time import TIMER
from .models import ModelSpec
from .modes import MODES_BY_NAME, Mode, coalescing

MiB = 1 << 20


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
    mp: str = "fp32"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(
    model: nn.Module, optim: torch.optim.Optimizer, inp: torch.Tensor, loss_fn: LossFn
) -> None:
    loss_fn(model, inp).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _forward_backward(model: nn.Module, inp: torch.Tensor, loss_fn: LossFn) -> None:
    loss_fn(model, inp).backward()
    for param in model.parameters():
        param.grad = None


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


def _step_peak_bytes(model: nn.Module, inp: torch.Tensor, loss_fn: LossFn) -> StepPeaks:
    # Only the CPU path profiles
    with _quiet_profiler() if inp.device.type == "cpu" else contextlib.nullcontext():
        return step_peak_bytes(model, inp, loss_fn)


def _reduce_scatter_buffer_bytes(model: nn.Module) -> list[int]:
    """Per parameter group: bytes of the grouped path's reduce-scatter input
    (the ``chunk_cat`` buffer: padded unsharded gradients, fp32 here)."""
    sizes = []
    for module in model.modules():
        if not isinstance(module, upstream_fsdp.FSDPModule):
            continue
        state = module._get_fsdp_state()
        # torch 2.9's FSDP2 has one optional group per state
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group else []
        for group in groups:
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


def bench_model(
    spec: ModelSpec,
    mode_names: list[str],
    cfg: RunConfig,
    rank: int,
    device: torch.device,
    *,
    memory: bool,
) -> dict[str, Any]:
    """Trains ``spec``'s model sharded in each of ``mode_names`` and returns its
    JSON entry: step times, collectives and copies, and with ``memory`` peaks."""
    TIMER.install()
    mesh = spec.mesh(device.type, cfg.world_size)
    loss_fn = spec.loss_fn
    inp = spec.make_input(rank, device)
    modes = [MODES_BY_NAME[n] for n in mode_names]
    models = {m.name: _build(spec, m, mesh, cfg.mp, device.type) for m in modes}
    optims = {
        name: torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        for name, model in models.items()
    }
    # Sharded parameters are DTensors: numel() is the unsharded one
    params = list(models[mode_names[0]].parameters())
    result: dict[str, Any] = {
        "model": spec.name,
        "description": spec.description,
        "config": spec.config,
        "numel": sum(p.numel() for p in params),
        "num_tensors": len(params),
        "reduce_scatter_buffer_bytes": _reduce_scatter_buffer_bytes(models[mode_names[0]]),
        "modes": {},
    }
    # Warm-up, then timed rounds; the order of the modes rotates every round
    # so that load drift and cache effects do not favour one mode
    for _ in range(cfg.warmup):
        for mode in modes:
            _train_step(models[mode.name], optims[mode.name], inp, loss_fn)
    # Per mode and step: step time, FSDP's own time and process-group time
    times = torch.zeros(3, len(modes), cfg.steps, dtype=torch.float64)
    for step in range(cfg.steps):
        for k in range(len(modes)):
            i = (step + k) % len(modes)
            mode = modes[i]
            dist.barrier()
            _sync(device)
            start, fsdp_start, pg_start = time.perf_counter(), TIMER.fsdp_s(), TIMER.pg_s
            _train_step(models[mode.name], optims[mode.name], inp, loss_fn)
            _sync(device)
            times[:, i, step] = torch.tensor(
                [
                    time.perf_counter() - start,
                    TIMER.fsdp_s() - fsdp_start,
                    TIMER.pg_s - pg_start,
                ]
            )
    # A step takes as long as its slowest rank (and so for each part)
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    for i, mode in enumerate(modes):
        _forward_backward(models[mode.name], inp, loss_fn)
        with CommRecorder() as recorder:
            _forward_backward(models[mode.name], inp, loss_fn)
        summary = recorder.summary()
        coll = summary["collectives"]
        if mode.coalesce is False and coll["ops"] != coll["tensors"]:
            raise RuntimeError(
                f"{spec.name}: {mode.name} issued {coll['ops']} collectives for "
                f"{coll['tensors']} tensors, not one per tensor: the FSDP backend "
                f"registered for {device.type!r} with one-by-one comms did not apply"
            )
        result["modes"][mode.name] = {
            "step_time_s": _stats(times[0, i].tolist()),
            "fsdp_time_s": _stats(times[1, i].tolist()),
            "pg_time_s": _stats(times[2, i].tolist()),
            **summary,
        }
    if cfg.profile_dir is not None:
        for mode in modes:
            _profile(spec, mode, models[mode.name], optims[mode.name], inp, cfg, rank)
    del models, optims
    if memory:
        for mode in modes:
            model = _build(spec, mode, mesh, cfg.mp, device.type)
            peaks = _step_peak_bytes(model, inp, loss_fn)
            result["modes"][mode.name].update(
                fwd_peak_bytes=peaks.forward,
                bwd_peak_bytes=peaks.backward,
                reduce_peak_bytes=peaks.reduce,
            )
            del model
    return result


def _peak_sites(model: nn.Module, inp: torch.Tensor, loss_fn: LossFn) -> list[str]:
    """Where the forward and backward peaks of ``step_peak_bytes`` happen: the
    profiler's op stack at the allocation that reaches each peak (CPU only)."""
    from torch._C._profiler import _EventType

    with _quiet_profiler():
        prof = profile_step(model, inp, loss_fn)
    spans, allocations, reduce_starts = {}, [], []
    stack = [(e, ()) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, path = stack.pop()
        stack.extend((child, (*path, event.name)) for child in event.children)
        spans[event.name] = (event.start_time_ns, event.end_time_ns)
        if event.name.startswith(REDUCE_LABEL):
            reduce_starts.append(event.start_time_ns)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            allocations.append(
                (event.start_time_ns, fields.alloc_size, fields.total_allocated, path)
            )
    allocations.sort(key=lambda a: a[0])
    first = next(a for a in allocations if a[0] >= spans["measured_forward"][0])
    baseline = first[2] - first[1]
    bwd_start, bwd_end = spans["measured_backward"]
    reductions = [start for start in reduce_starts if bwd_start <= start <= bwd_end]
    sites = []
    for phase in ("forward", "backward"):
        start, end = spans[f"measured_{phase}"]
        at, size, total, path = max(
            (a for a in allocations if start <= a[0] <= end), key=lambda a: a[2]
        )
        label = f"measured_{phase}"
        if label in path:
            where = " > ".join(path[path.index(label) + 1 :][-5:]) or label
        else:  # e.g. in a backend's own thread (gloo runs collectives in its threads)
            where = "another thread: " + (" > ".join(path[-5:]) or "no op")
        when = ""
        if phase == "backward":
            when = f", {(at - start) / 1e6:.1f} ms into a {(end - start) / 1e6:.1f} ms backward"
            if reductions:
                when += f" (first gradient reduction at {(min(reductions) - start) / 1e6:.1f} ms)"
        sites.append(
            f"{phase} peak: {(total - baseline) / MiB:.3f} MiB above the step's start, "
            f"reached allocating {size / MiB:.3f} MiB in {where}{when}"
        )
    return sites


def _build(spec: ModelSpec, mode: Mode, mesh: Any, mp: str, device_type: str) -> nn.Module:
    """``spec.build`` with the mode's coalescing registered (FSDP reads it at
    ``fully_shard``)."""
    with coalescing(mode, device_type):
        return spec.build(mode, mesh, mp)


def _profile(
    spec: ModelSpec,
    mode: Mode,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    inp: torch.Tensor,
    cfg: RunConfig,
    rank: int,
) -> None:
    """Writes torch.profiler's key_averages table of one training step and,
    on CPU, where the forward and backward memory peaks happen."""
    sites = []
    device_type = inp.device.type
    if device_type == "cpu":
        sites = _peak_sites(model, inp, spec.loss_fn)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with (
        _quiet_profiler(),
        torch.profiler.profile(activities=activities) as prof,
    ):
        _train_step(model, optim, inp, spec.loss_fn)
        _sync(inp.device)
    if rank == 0:
        path = Path(cfg.profile_dir) / f"{cfg.pg}-w{cfg.world_size}-{spec.name}-{mode.name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        sort_by = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=30)
        path.write_text("".join(f"{site}\n" for site in sites) + table + "\n")
