"""Peak tensor memory of one training step: exactly with the profiler on CPU,
from the caching allocator's statistics on CUDA."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn as nn
from torch._C._profiler import _EventType
from torch.profiler import record_function

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]

# The ``record_function`` label of a parameter group's gradient reduction
# (the reduce-scatter copy-in of grouped mode, the collectives, the views)
REDUCE_LABEL = "FSDP::post_backward_reduce"


class StepPeaks(NamedTuple):
    """Peak allocated bytes of a measured step above its start: in forward,
    in backward, and inside FSDP's gradient reductions in backward
    (``REDUCE_LABEL``; ``None`` where not measured: on CUDA, or with no
    reduction)."""

    forward: int
    backward: int
    reduce: int | None


def walk_events(events) -> Iterator:
    """Every node of a kineto event tree."""
    stack = list(events)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        yield event


def sum_loss(model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """The default loss of a measured step: the sum of the model's output."""
    return model(inp).sum()


def profile_step(
    model: nn.Module, inp: torch.Tensor, loss_fn: LossFn = sum_loss
) -> torch.profiler.profile:
    """Profiles memory over a warm-up step (lazy init) and one measured step,
    marked ``{warmup,measured}_{forward,backward}`` with ``record_function``;
    the forward is ``loss_fn(model, inp)``. The cycle collector is off while
    profiling: tensors of an earlier profiled run that it frees would lower
    the allocator's running total in the middle of the measured step."""
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(profile_memory=True) as prof:
            for step in ("warmup", "measured"):
                with record_function(f"{step}_forward"):
                    loss = loss_fn(model, inp)
                with record_function(f"{step}_backward"):
                    loss.backward()
                del loss
                for param in model.parameters():
                    param.grad = None
    finally:
        gc.enable()
    return prof


def step_peak_bytes(model: nn.Module, inp: torch.Tensor, loss_fn: LossFn = sum_loss) -> StepPeaks:
    """Runs a warm-up step (lazy init), then one measured forward
    (``loss_fn(model, inp)``) and backward, on ``inp``'s device.

    Returns the peak allocated bytes during the measured forward, during the
    measured backward and, on CPU, inside its gradient reductions, each
    counted from the allocated bytes at the start of the measured step. The
    reduction peak is where grouped mode's reduce-scatter buffer lives next to
    the unsharded gradients. On CUDA the first two come from the caching allocator's
    peak statistics, reset before each phase and read after a device
    synchronize, so work still queued on FSDP's streams counts. On CPU both
    steps run under one profiler: the CPU allocator
    reports a free only for a block it saw allocated while profiling, and its
    running total carries over from earlier profiler sessions, hence the
    baseline taken from the measured step's first allocation.
    """
    if inp.device.type == "cuda":
        return _cuda_step_peak_bytes(model, inp, loss_fn)
    prof = profile_step(model, inp, loss_fn)
    events = list(walk_events(prof.profiler.kineto_results.experimental_event_tree()))
    spans = {e.name: (e.start_time_ns, e.end_time_ns) for e in events}
    allocations = sorted(
        (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated)
        for e in events
        if e.tag == _EventType.Allocation
    )
    fwd_start, fwd_end = spans["measured_forward"]
    bwd_start, bwd_end = spans["measured_backward"]
    _, first_size, first_total = next(a for a in allocations if a[0] >= fwd_start)
    baseline = first_total - first_size

    def peak(start: int, end: int) -> int | None:
        totals = [total for t, _, total in allocations if start <= t <= end]
        return max(totals) - baseline if totals else None

    reduce_peaks = [
        peak(e.start_time_ns, e.end_time_ns)
        for e in events
        if e.name.startswith(REDUCE_LABEL) and bwd_start <= e.start_time_ns <= bwd_end
    ]
    reduce_peaks = [p for p in reduce_peaks if p is not None]
    return StepPeaks(
        peak(fwd_start, fwd_end),
        peak(bwd_start, bwd_end),
        max(reduce_peaks) if reduce_peaks else None,
    )


def _cuda_step_peak_bytes(model: nn.Module, inp: torch.Tensor, loss_fn: LossFn) -> StepPeaks:
    device = inp.device
    loss_fn(model, inp).backward()  # lazy init
    for param in model.parameters():
        param.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    loss = loss_fn(model, inp)
    torch.cuda.synchronize(device)
    fwd = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    torch.cuda.synchronize(device)
    bwd = torch.cuda.max_memory_allocated(device) - baseline
    del loss
    for param in model.parameters():
        param.grad = None
    return StepPeaks(fwd, bwd, None)
