"""The Python calls made inside FSDP's own files during one steady training
step, per function: torch's own FSDP2 against the generated copy.

Shared by ``test/package/test_call_counts.py`` (grouped mode makes exactly
torch's calls) and ``tools/probes/count_fsdp_calls.py`` (the per-function
table). A call is a ``'call'`` event of ``sys.setprofile`` (a Python frame
starting or a generator resuming; generator expressions and lambdas are
frames too) whose code lies in a directory named ``_fully_shard``: torch's
``torch/distributed/fsdp/_fully_shard/`` or the package's
``torch_fsdp_ext/_fully_shard/``. A call is keyed by (file name,
``co_qualname``), so that the two copies compare function by function.

Single process, CPU, over the fake process group (collectives move no data
and complete at once): :func:`init_fake_process_group` first,
``dist.destroy_process_group()`` after. Imports from the package only
``fully_shard`` and ``MixedPrecisionPolicy``, so that it also runs against
the stand-in package of ``tools/patches.py stack`` (the generated copy only).
"""

from __future__ import annotations

import contextlib
import inspect
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


@contextlib.contextmanager
def counting_fsdp_calls() -> Iterator[Counter[CallKey]]:
    """Counts, on this thread, every Python call into a ``_fully_shard``
    directory while the block runs (autograd's CPU backward runs here too);
    restores the previous profile function after."""
    counts: Counter[CallKey] = Counter()
    keys: dict[CodeType, CallKey | None] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        try:
            key = keys[code]
        except KeyError:
            key = keys[code] = (
                (
                    os.path.basename(code.co_filename),
                    getattr(code, "co_qualname", code.co_name),
                )
                if _in_fully_shard_dir(code)
                else None
            )
        if key is not None:
            counts[key] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


def count_steady_step_calls(impl: Implementation, config: StepConfig) -> Counter[CallKey]:
    """Builds and shards the model with ``impl``, runs ``WARMUP_STEPS`` steps
    with SGD, and returns the calls of the next one."""
    model = build_model(impl, config)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(WARMUP_STEPS):
        train_step(model, optim, config, step)
    with counting_fsdp_calls() as counts:
        train_step(model, optim, config, WARMUP_STEPS)
    return counts


def format_key(key: CallKey) -> str:
    return f"{key[0]}:{key[1]}"


def count_differences(reference: Counter[CallKey], ours: Counter[CallKey]) -> list[str]:
    """``file:function: reference -> ours`` for every function whose count
    differs, sorted."""
    return [
        f"{format_key(key)}: {reference[key]} -> {ours[key]}"
        for key in sorted(reference.keys() | ours.keys())
        if reference[key] != ours[key]
    ]
