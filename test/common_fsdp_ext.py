"""Test harness: multi-process FSDP tests on CPU (gloo) or CUDA (NCCL), bitwise checks.

Upstream ``FSDPTest`` skips every test when ``torch.accelerator.device_count()``
is below the world size, which is always the case on CPU. This base runs the
same test body on gloo/CPU, and on NCCL when enough CUDA GPUs are present; a
CUDA machine with too few GPUs skips cleanly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcessTestCase
from torch.testing._internal.common_fsdp import run_subtests
from torch.testing._internal.common_utils import TestCase

DEVICE_TYPE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "nccl" if DEVICE_TYPE == "cuda" else "gloo"


class FSDPExtTestMultiProcess(MultiProcessTestCase):
    """One process per rank with a real process group (gloo on CPU, NCCL on CUDA)."""

    @property
    def world_size(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        if DEVICE_TYPE == "cuda":
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe, **kwargs) -> None:
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        if DEVICE_TYPE == "cuda":
            if torch.cuda.device_count() < self.world_size:
                sys.exit(TEST_SKIPS[f"multi-gpu-{self.world_size}"].exit_code)
            torch.cuda.set_device(rank)
        store = dist.FileStore(file_name, self.world_size)
        dist.init_process_group(BACKEND, rank=rank, world_size=self.world_size, store=store)
        self.run_test(test_name, parent_pipe)

    def run_subtests(self, *args, **kwargs):
        return run_subtests(self, *args, **kwargs)


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Describe where two tensors first differ, for bitwise-equality failures."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{actual.shape=} {actual.dtype=} vs {expected.shape=} {expected.dtype=}"
    ne = (actual != expected) & ~(actual.isnan() & expected.isnan())
    idx = ne.nonzero()
    if idx.numel() == 0:
        return "equal"
    first = tuple(idx[0].tolist())
    return (
        f"{idx.size(0)} of {actual.numel()} elements differ; first at {first}: "
        f"{actual[first].item()!r} vs {expected[first].item()!r}"
    )


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def assert_bitwise_equal(
    test: TestCase, actual: torch.Tensor, expected: torch.Tensor, what: str
) -> None:
    """``torch.equal`` on the local shards; the failure names the first differing element."""
    actual, expected = local(actual), local(expected)
    if not torch.equal(actual, expected):
        test.fail(f"{what}: {first_difference(actual, expected)}")


def sharded_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    for name, param in model.named_parameters():
        yield name, param, param.grad


def assert_models_bitwise_equal(
    test: TestCase, model: nn.Module, ref_model: nn.Module, what: str, *, grads: bool
) -> None:
    """Compare every sharded parameter (and gradient) of two identically built models."""
    pairs = list(zip(sharded_state(model), sharded_state(ref_model), strict=True))
    for (name, param, grad), (ref_name, ref_param, ref_grad) in pairs:
        test.assertEqual(name, ref_name)
        if isinstance(param, DTensor):
            test.assertEqual(param.placements, ref_param.placements, msg=f"{what} {name}")
        assert_bitwise_equal(test, param, ref_param, f"{what}: param {name}")
        if grads:
            test.assertEqual(grad is None, ref_grad is None, msg=f"{what}: grad {name} is None")
            if grad is not None:
                assert_bitwise_equal(test, grad, ref_grad, f"{what}: grad {name}")


def train_in_lockstep(
    test: TestCase,
    model: nn.Module,
    ref_model: nn.Module,
    make_input: Callable[[int], torch.Tensor],
    *,
    num_steps: int = 4,
    microbatches: int = 1,
    no_sync_microbatches: bool = False,
    lr: float = 1e-2,
) -> list[float]:
    """Train two models side by side and require bitwise-equal losses, sharded
    gradients after every backward and sharded parameters after every step.

    ``make_input(step)`` must be deterministic; with ``microbatches > 1`` the
    gradients are accumulated, with ``no_sync_microbatches`` all but the last
    microbatch skip gradient sync (``set_requires_gradient_sync(False)``).
    Returns the losses.
    """
    optim = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=lr, foreach=True)
    losses = []
    for step in range(num_steps):
        for micro in range(microbatches):
            sync = not no_sync_microbatches or micro == microbatches - 1
            inp = make_input(step * microbatches + micro)
            step_losses = []
            for m in (model, ref_model):
                if no_sync_microbatches:
                    m.set_requires_gradient_sync(sync)
                loss = m(inp).sum()
                loss.backward()
                step_losses.append(loss.detach())
            assert_bitwise_equal(test, step_losses[0], step_losses[1], f"step {step} loss")
            losses.append(step_losses[0].item())
            assert_models_bitwise_equal(
                test, model, ref_model, f"step {step} micro {micro} after backward", grads=True
            )
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
        assert_models_bitwise_equal(test, model, ref_model, f"step {step} after optim", grads=False)
    return losses
