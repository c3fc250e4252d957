"""What runs inside FSDP's own files during one steady training step:
executed lines, Python calls and builtin calls, torch's own FSDP2 against the
generated copy.

Shared by ``test/package/test_call_counts.py`` (grouped mode runs exactly
torch's lines, Python calls and builtin calls) and
``tools/probes/count_fsdp_calls.py`` (the per-key table). Code counts when it lies in a directory named
``_fully_shard``: torch's ``torch/distributed/fsdp/_fully_shard/`` or the
package's ``torch_fsdp_ext/_fully_shard/``. Three counters, each keyed so
that the two copies compare function by function and lines moved by a patch
still match:

- ``lines``: ``'line'`` events of ``sys.settrace`` (a line starting, or a
  loop jumping back to it), keyed by (file name, ``co_qualname``, the line's
  stripped source text, with the package's op namespace and self-imports
  rewritten back to torch's: :data:`PACKAGE_TEXT_REWRITES`);
- ``calls``: ``'call'`` events of ``sys.setprofile`` (a Python frame starting
  or a generator resuming; generator expressions and lambdas are frames too),
  keyed by (file name, ``co_qualname``);
- ``builtins``: ``'c_call'`` events of ``sys.setprofile`` made from those
  files (a builtin function or method: ``isinstance``, ``Tensor.size``,
  ``torch.empty``), keyed by the caller's (file name, ``co_qualname``) and
  the builtin's name (:func:`builtin_name`).

Single process, CPU, over the fake process group (collectives move no data
and complete at once): :func:`init_fake_process_group` first,
``dist.destroy_process_group()`` after. Imports from the package only
``fully_shard`` and ``MixedPrecisionPolicy``, so that it also runs against
the stand-in package of ``tools/patches.py stack`` (the generated copy only).
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_ext_testing.models import Model

WORLD_SIZE = 2
# Every dim-0 divides by the world size: no padding
DIM, HIDDEN, NUM_BLOCKS, BATCH = 16, 32, 4, 4
WARMUP_STEPS = 2  # lazy init, then a step with everything in place
SEED = 42

# (file name, qualified name) of a function in a ``_fully_shard`` directory
CallKey = tuple[str, str]
# (file name, qualified name, stripped source text) of a line of such a function
LineKey = tuple[str, str, str]
# (file name, qualified name) of the calling function, then the builtin's name
BuiltinKey = tuple[str, str, str]
COUNTERS = ("lines", "calls", "builtins")

# The package's rewrites of the generated copy (``REWRITES`` in
# torch_fsdp_ext/_vendor.py) that change lines a step runs, undone in its
# line texts: its ops live in their own namespace, and its absolute
# self-imports name the package. Any other rewritten line shows as a
# difference.
PACKAGE_TEXT_REWRITES = (
    ("torch.ops.fsdp_ext.", "torch.ops.fsdp."),
    ("from torch_fsdp_ext._fully_shard.", "from torch.distributed.fsdp._fully_shard."),
)


def init_fake_process_group() -> None:
    """The default process group: fake, this process rank 0 of ``WORLD_SIZE``."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)


@dataclass(frozen=True)
class StepConfig:
    """How the model is sharded and trained.

    ``fsdp_kwargs(mp_policy_cls)`` gives extra ``fully_shard`` kwargs, built
    with the implementation's own ``MixedPrecisionPolicy``; with
    ``async_unshard`` every FSDP module unshards with ``async_op=True``; a
    step runs ``microbatches`` forward/backward passes, all but the last
    without gradient sync."""

    description: str
    fsdp_kwargs: Callable[[type], dict[str, Any]] = field(default=lambda mp_policy_cls: {})
    async_unshard: bool = False
    microbatches: int = 1


CONFIGS: dict[str, StepConfig] = {
    "fp32": StepConfig("fp32 parameters and gradients"),
    "bf16": StepConfig(
        "bf16 parameters, fp32 gradient reduction",
        fsdp_kwargs=lambda mp_policy_cls: {
            "mp_policy": mp_policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        },
    ),
    "no-reshard": StepConfig(
        "reshard_after_forward=False",
        fsdp_kwargs=lambda mp_policy_cls: {"reshard_after_forward": False},
    ),
    # ``FSDPModule._set_unshard_async_op``: torch 2.9, 2.14 and 2.15 have it
    "async": StepConfig("_set_unshard_async_op(True)", async_unshard=True),
    "accum": StepConfig(
        "2 microbatches, the first under set_requires_gradient_sync(False)", microbatches=2
    ),
}


@dataclass(frozen=True)
class Implementation:
    """A ``fully_shard`` with its ``MixedPrecisionPolicy`` and extra kwargs."""

    name: str
    fully_shard: Callable[..., Any]
    mp_policy_cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)


def implementations() -> dict[str, Implementation]:
    """``torch`` (torch's own FSDP2, the reference), ``grouped`` (the package,
    no extra kwargs) and, where the package's ``fully_shard`` takes
    ``group_collectives``, ``per-param`` (``group_collectives=False``)."""
    import torch.distributed.fsdp as torch_fsdp

    import torch_fsdp_ext

    impls = {
        "torch": Implementation("torch", torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy),
        "grouped": Implementation(
            "grouped", torch_fsdp_ext.fully_shard, torch_fsdp_ext.MixedPrecisionPolicy
        ),
    }
    if "group_collectives" in inspect.signature(torch_fsdp_ext.fully_shard).parameters:
        impls["per-param"] = Implementation(
            "per-param",
            torch_fsdp_ext.fully_shard,
            torch_fsdp_ext.MixedPrecisionPolicy,
            {"group_collectives": False},
        )
    return impls


def build_model(impl: Implementation, config: StepConfig) -> nn.Module:
    """:class:`Model` of ``NUM_BLOCKS`` blocks from seed 42, ``fully_shard`` on
    each block, then the root."""
    torch.manual_seed(SEED)
    model = Model(DIM, HIDDEN, NUM_BLOCKS)
    kwargs = {**config.fsdp_kwargs(impl.mp_policy_cls), **impl.kwargs}
    for block in model.blocks:
        impl.fully_shard(block, **kwargs)
    impl.fully_shard(model, **kwargs)
    if config.async_unshard:
        # Sets it on every FSDP module under the root, the root's own included
        model._set_unshard_async_op(True)
    return model


def train_step(model: nn.Module, optim: torch.optim.Optimizer, config: StepConfig, step: int):
    """Forward and backward per microbatch, then ``optim.step()`` and ``zero_grad()``."""
    for micro in range(config.microbatches):
        if config.microbatches > 1:
            model.set_requires_gradient_sync(micro == config.microbatches - 1)
        gen = torch.Generator().manual_seed(SEED + 1000 * step + micro)
        model(torch.randn(BATCH, DIM, generator=gen)).sum().backward()
    optim.step()
    optim.zero_grad()


def _in_fully_shard_dir(code: CodeType) -> bool:
    return os.path.basename(os.path.dirname(code.co_filename)) == "_fully_shard"


def builtin_name(func: Any) -> str:
    """``isinstance``; ``Tensor.size`` or ``list.append`` for a method;
    ``torch.empty`` or ``torch._C._get_tracing_state`` for a module's function."""
    module = getattr(func, "__module__", None)
    if module is None:
        return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    name = getattr(func, "__name__", repr(func))
    return name if module == "builtins" else f"{module}.{name}"


@dataclass
class StepCounts:
    """The three counters of one step (see the module docstring)."""

    lines: Counter[LineKey] = field(default_factory=Counter)
    calls: Counter[CallKey] = field(default_factory=Counter)
    builtins: Counter[BuiltinKey] = field(default_factory=Counter)

    def counter(self, name: str) -> Counter[tuple[str, ...]]:
        return getattr(self, name)

    def totals(self) -> dict[str, int]:
        return {name: self.counter(name).total() for name in COUNTERS}

    def flat(self) -> Counter[tuple[str, ...]]:
        """One counter, each key prefixed with its counter's name."""
        return Counter(
            {(name, *key): n for name in COUNTERS for key, n in self.counter(name).items()}
        )


@contextlib.contextmanager
def counting_fsdp_execution() -> Iterator[StepCounts]:
    """Counts, on this thread, the lines, Python calls and builtin calls run in
    a ``_fully_shard`` directory while the block runs (autograd's CPU backward
    runs here too); restores the previous trace and profile functions after.
    Only frames of those files get a local trace function, so other code
    reports no line events."""
    counts = StepCounts()
    functions: dict[CodeType, CallKey | None] = {}
    line_keys: dict[tuple[CodeType, int], LineKey] = {}

    def function_key(code: CodeType) -> CallKey | None:
        try:
            return functions[code]
        except KeyError:
            key = functions[code] = (
                (
                    os.path.basename(code.co_filename),
                    getattr(code, "co_qualname", code.co_name),
                )
                if _in_fully_shard_dir(code)
                else None
            )
            return key

    def trace_lines(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            code, lineno = frame.f_code, frame.f_lineno
            try:
                key = line_keys[code, lineno]
            except KeyError:
                text = linecache.getline(code.co_filename, lineno).strip()
                for old, new in PACKAGE_TEXT_REWRITES:
                    text = text.replace(old, new)
                key = line_keys[code, lineno] = (*functions[code], text)
            counts.lines[key] += 1
        return trace_lines

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        # The global trace function sees only 'call' events
        return trace_lines if function_key(frame.f_code) is not None else None

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            key = function_key(frame.f_code)
            if key is not None:
                counts.calls[key] += 1
        elif event == "c_call":
            key = function_key(frame.f_code)
            if key is not None:
                counts.builtins[(*key, builtin_name(arg))] += 1

    previous_trace, previous_profile = sys.gettrace(), sys.getprofile()
    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous_profile)
        sys.settrace(previous_trace)


def count_steady_step(impl: Implementation, config: StepConfig) -> StepCounts:
    """Builds and shards the model with ``impl``, runs ``WARMUP_STEPS`` steps
    with SGD, and returns the counts of the next one."""
    model = build_model(impl, config)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(WARMUP_STEPS):
        train_step(model, optim, config, step)
    with counting_fsdp_execution() as counts:
        train_step(model, optim, config, WARMUP_STEPS)
    return counts


def format_key(key: tuple[str, ...]) -> str:
    """``file:qualname``, then the line's text or the builtin's name in
    backquotes, if any."""
    file, qualname, *rest = key
    return f"{file}:{qualname}" + "".join(f" `{part}`" for part in rest)


def count_differences(
    reference: StepCounts, ours: StepCounts, names: tuple[str, str] = ("torch", "grouped")
) -> list[str]:
    """``counter file:qualname [`text` or `builtin`]: <names[0]> n, <names[1]> m``
    for every key of every counter whose count differs, sorted by counter
    (lines, calls, builtins), then key."""
    return [
        f"{name} {format_key(key)}: {names[0]} {reference.counter(name)[key]}, "
        f"{names[1]} {ours.counter(name)[key]}"
        for name in COUNTERS
        for key in sorted(reference.counter(name).keys() | ours.counter(name).keys())
        if reference.counter(name)[key] != ours.counter(name)[key]
    ]
