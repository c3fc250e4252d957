"""Peak tensor memory of one training step: exactly with the profiler on CPU,
from the caching allocator's statistics on CUDA."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
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


# c10's CPU allocator keeps the profiler's running total of allocated bytes
# (``ProfiledCPUMemoryReporter``). It updates that total only on a thread where
# memory profiling is on, or everywhere while this c10 flag is set. A block
# freed on any other thread (a gloo worker thread dropping the last reference
# to a collective's temporary, e.g. the clone of every reduce-scatter input)
# stayed in the total for the rest of the profile, with no free event: each
# such collective raised every later peak by its temporary's bytes
_REPORT_CPU_MEMORY_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"
_C10_LIBRARY = {"darwin": "libc10.dylib", "win32": "c10.dll"}.get(sys.platform, "libc10.so")
# How long the measured step waits after the warm-up for gloo's worker
# threads to drop the warm-up's last collective temporaries; one still held
# then and freed during the measured step would lower its peaks
_SETTLE_S = 0.05


def _report_cpu_memory_flag() -> ctypes.c_bool | None:
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / _C10_LIBRARY))
        return ctypes.c_bool.in_dll(library, _REPORT_CPU_MEMORY_FLAG)
    except (OSError, ValueError):  # not this build's library or symbol
        return None


@contextlib.contextmanager
def count_cpu_frees_on_every_thread() -> Iterator[None]:
    """Makes the profiler's running total of CPU bytes count blocks allocated
    and freed on every thread, not only on threads it profiles (free events
    are still recorded only there). With the flag set, c10 also formats an
    INFO log line per allocation, printed only at that log level."""
    flag = _report_cpu_memory_flag()
    if flag is None:
        yield
        return
    saved = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = saved


def profile_step(
    model: nn.Module, inp: torch.Tensor, loss_fn: LossFn = sum_loss
) -> torch.profiler.profile:
    """Profiles memory over a warm-up step (lazy init) and one measured step,
    marked ``{warmup,measured}_{forward,backward}`` with ``record_function``;
    the forward is ``loss_fn(model, inp)``. The cycle collector is off while
    profiling: tensors of an earlier profiled run that it frees would lower
    the allocator's running total in the middle of the measured step. Frees
    on threads the profiler does not follow count
    (:func:`count_cpu_frees_on_every_thread`), and the measured step starts
    once gloo's worker threads have had time to drop the warm-up's last
    collective temporaries."""
    gc.collect()
    gc.disable()
    try:
        with (
            count_cpu_frees_on_every_thread(),
            torch.profiler.profile(profile_memory=True) as prof,
        ):
            for step in ("warmup", "measured"):
                if step == "measured":
                    time.sleep(_SETTLE_S)
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
    baseline taken from the measured step's first allocation. Blocks freed on
    threads the profiler does not follow (gloo's workers) leave the total
    when freed (:func:`profile_step`).
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
