"""Property tests: ``group_collectives=False`` gives the same bits as grouped
collectives for models built from hypothesis-drawn lists of parameter shapes.

Each example draws 1 to 5 parameter shapes (1-D to 3-D, size-1 dims, dim-0
below the world size), a precision (fp32; bf16 parameters with fp32 reduce;
fp16 parameters with fp16 reduce, FSDP's sum-with-pre/post-divide path), a
``Shard(0)``/``Shard(1)`` choice per parameter (``Shard(1)`` applied where
dim-1 divides by the world size), how many trailing parameters go to a child
module sharded on its own (a second parameter group), and
``reshard_after_forward``. Two copies of the same model, one per mode, train
for 2 steps; losses, every sharded gradient and every sharded parameter must
be bitwise equal. At world size > 2 both models use
``DeterministicReduceScatter``; at 2, a sum of two values does not depend on
packing, so the default comms must already agree.

Hypothesis and threads: the threaded process group runs the test body in one
thread per rank, and each rank must issue the same collectives. Running
``@given`` on every rank would give each its own engine, and a failure seen on
one rank only would make that rank's engine shrink (re-running collectives)
while the others move on. So only rank 0 runs the ``@given`` function. Each
call broadcasts the drawn example to the other ranks, which loop on
``broadcast_object_list`` until a ``None`` sentinel; every rank trains the
example, records (not raises) each mismatch so that all ranks finish the same
collectives, and the mismatches of all ranks are gathered to rank 0, which
raises. Hypothesis therefore sees every rank's result, shrinks normally and
reports the falsifying example. A crash (any other exception) is not a
property failure: it may leave ranks in different collectives, so it aborts
the run without shrinking and fails the test naming the example.

Profiles: ``HYPOTHESIS_PROFILE=ci`` (default; derandomized, seeded by world
size, 70 examples per world size, 210 in all, about a minute) or ``dev``
(1000 random examples per world size, about 15 minutes on 2 cores).
"""

import copy
import os
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from common_fsdp_ext import assert_bitwise_equal, param_groups
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard
from torch.testing._internal import common_distributed
from torch.testing._internal.common_fsdp import FSDPTestMultiThread
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext import DeterministicReduceScatter, FSDPModule, MixedPrecisionPolicy, fully_shard

settings.register_profile(
    "ci",
    max_examples=70,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

PRECISIONS = {
    "fp32": MixedPrecisionPolicy(),
    "bf16_params_fp32_reduce": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    ),
    "fp16_params_fp16_reduce": MixedPrecisionPolicy(
        param_dtype=torch.float16, reduce_dtype=torch.float16
    ),
}
NUM_STEPS = 2


@dataclass(frozen=True)
class Example:
    """One drawn configuration; the same on every rank."""

    shapes: tuple[tuple[int, ...], ...]
    # Drawn per parameter; applied only where valid (see ``placement``)
    want_shard_dim1: tuple[bool, ...]
    precision: str
    # The last ``num_child_params`` parameters live in a child module that is
    # sharded by itself (a second parameter group); the rest in the root
    num_child_params: int
    reshard_after_forward: bool

    def placement(self, index: int, world_size: int) -> Shard:
        shape = self.shapes[index]
        if self.want_shard_dim1[index] and len(shape) >= 2 and shape[1] % world_size == 0:
            return Shard(1)
        return Shard(0)


def examples(world_size: int) -> st.SearchStrategy[Example]:
    # Small sizes (incl. 1 and others below the world size) and multiples of
    # the world size, so that ``Shard(1)`` is often valid
    size = st.integers(1, 7) | st.sampled_from([world_size, 2 * world_size])
    shape = st.lists(size, min_size=1, max_size=3).map(tuple)

    @st.composite
    def example(draw) -> Example:
        num_params = draw(st.integers(1, 5))
        shapes = tuple(draw(st.lists(shape, min_size=num_params, max_size=num_params)))
        return Example(
            shapes=shapes,
            want_shard_dim1=tuple(
                draw(st.lists(st.booleans(), min_size=num_params, max_size=num_params))
            ),
            precision=draw(st.sampled_from(list(PRECISIONS))),
            num_child_params=draw(st.integers(0, num_params)),
            reshard_after_forward=draw(st.booleans()),
        )

    return example()


class ElementwiseModel(nn.Module):
    """One parameter per shape, each used elementwise: parameter ``p`` reads
    its own slice ``a, b`` of each of the input's two rows and adds
    ``(sin(p * a) * b).sum()`` to the loss, so its gradient
    ``cos(p * a) * a * b`` differs per element, per rank and per step."""

    def __init__(
        self, shapes: list[tuple[int, ...]], child_shapes: list[tuple[int, ...]], gen
    ) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes
        )
        self.child = ElementwiseModel(child_shapes, [], gen) if child_shapes else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = x.new_zeros(())
        offset = 0
        for weight in self.weights:
            numel = weight.numel()
            a, b = x[:, offset : offset + numel].view(2, *weight.shape).unbind(0)
            loss = loss + (torch.sin(weight * a) * b).sum()
            offset += numel
        if self.child is not None:
            loss = loss + self.child(x[:, offset:])
        return loss


class _ExampleCrashed(BaseException):
    """A crash while checking an example. A ``BaseException``, so that
    hypothesis lets it through instead of shrinking (the ranks may be in
    different collectives); the test re-raises it as a ``RuntimeError``."""


class TestFullyShardPerParamProperties(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        # The harness fails a test whose rank threads take longer than
        # ``TIMEOUT_DEFAULT`` (300 s) to join; allow 1 s per example so that
        # the dev profile fits (the ci profile takes about 25 s per class)
        timeout = max(common_distributed.TIMEOUT_DEFAULT, settings.default.max_examples)
        patcher = mock.patch.object(common_distributed, "TIMEOUT_DEFAULT", timeout)
        patcher.start()
        self.addCleanup(patcher.stop)
        super().setUp()

    def test_per_param_matches_grouped(self):
        """Tests that per-parameter collectives give bitwise-equal losses,
        sharded gradients and sharded parameters to grouped ones over 2
        training steps, for hypothesis-drawn parameter shapes, precisions,
        ``Shard(0)``/``Shard(1)`` placements and one or two parameter groups."""
        try:
            self._run_examples()
        except _ExampleCrashed as e:
            # The harness reports only ``Exception``s from rank threads
            raise RuntimeError(str(e)) from e.__cause__

    def _run_examples(self) -> None:
        if self.rank != 0:
            # Follow rank 0's examples until the sentinel
            while (example := self._receive_example()) is not None:
                self._check_and_gather(example)
            return

        @given(example=examples(self.world_size))
        def check(example: Example) -> None:
            dist.broadcast_object_list([example], src=0)
            self._check_and_gather(example)

        if settings.default.derandomize:
            # Different (still fixed) examples per world size
            check = seed(self.world_size)(check)

        try:
            check()
        except Exception:
            # A property failure, shrunk: release the other ranks. (A crash,
            # ``_ExampleCrashed``, does not: the harness stops them.)
            dist.broadcast_object_list([None], src=0)
            raise
        dist.broadcast_object_list([None], src=0)

    def _receive_example(self) -> Example | None:
        received = [None]
        dist.broadcast_object_list(received, src=0)
        return received[0]

    def _check_and_gather(self, example: Example) -> None:
        try:
            failures = self._check_example(example)
        except Exception as e:
            raise _ExampleCrashed(f"rank {self.rank} crashed on {example!r}") from e
        all_failures = [None] * self.world_size
        dist.all_gather_object(all_failures, failures)
        if self.rank == 0:
            lines = [f"rank {r}: {f}" for r, fs in enumerate(all_failures) for f in fs]
            if lines:
                raise AssertionError(
                    f"per-parameter != grouped (world size {self.world_size}) for "
                    f"{example!r}:\n" + "\n".join(lines)
                )

    def _check_example(self, example: Example) -> list[str]:
        """Trains both models on this rank and returns each mismatch found,
        without raising, so that every rank runs the same collectives."""
        failures: list[str] = []

        def check_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
            try:
                assert_bitwise_equal(self, actual, expected, what)
            except AssertionError as e:
                failures.append(str(e))

        per_param, grouped = self._build_models(example)
        for model, group_collectives in ((per_param, False), (grouped, True)):
            modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
            groups = [g for m in modules for g in param_groups(m)]
            expected_groups = 1 + (0 < example.num_child_params < len(example.shapes))
            if len(groups) != expected_groups or any(
                g.group_collectives is not group_collectives for g in groups
            ):
                failures.append(
                    f"expected {expected_groups} groups with group_collectives="
                    f"{group_collectives}, got {[g.group_collectives for g in groups]}"
                )
        params = list(per_param.named_parameters())
        ref_params = list(grouped.named_parameters())
        # ``named_parameters`` lists the root's weights, then the child's: the
        # order of ``example.shapes``
        for index, ((name, param), (_, ref_param)) in enumerate(
            zip(params, ref_params, strict=True)
        ):
            placement = example.placement(index, self.world_size)
            if param.placements != (placement,) or ref_param.placements != (placement,):
                failures.append(
                    f"{name}: placements {param.placements} / {ref_param.placements}, "
                    f"expected {placement}"
                )

        optims = [
            torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
            for model in (per_param, grouped)
        ]
        total_numel = sum(torch.Size(shape).numel() for shape in example.shapes)
        gen = torch.Generator().manual_seed(42 + self.rank)
        for step in range(NUM_STEPS):
            inp = torch.randn(2, total_numel, generator=gen)
            losses = [model(inp) for model in (per_param, grouped)]
            for loss in losses:
                loss.backward()
            check_equal(losses[0].detach(), losses[1].detach(), f"step {step} loss")
            for (name, param), (_, ref_param) in zip(params, ref_params, strict=True):
                if param.grad is None or ref_param.grad is None:
                    failures.append(f"step {step}: grad {name} is None")
                    continue
                check_equal(param.grad, ref_param.grad, f"step {step} grad {name}")
            for optim in optims:
                optim.step()
                optim.zero_grad(set_to_none=step % 2 == 0)
            for (name, param), (_, ref_param) in zip(params, ref_params, strict=True):
                check_equal(param, ref_param, f"step {step} after optim: param {name}")
        return failures

    def _build_models(self, example: Example) -> tuple[nn.Module, nn.Module]:
        num_root = len(example.shapes) - example.num_child_params
        shapes = list(example.shapes)
        base = ElementwiseModel(
            shapes[:num_root], shapes[num_root:], torch.Generator().manual_seed(42)
        )
        models = []
        for group_collectives in (False, True):
            model = copy.deepcopy(base)
            placements = {
                param: example.placement(index, self.world_size)
                for index, param in enumerate(model.parameters())
            }
            kwargs = {
                "mp_policy": PRECISIONS[example.precision],
                "reshard_after_forward": example.reshard_after_forward,
                "shard_placement_fn": placements.get,
                "group_collectives": group_collectives,
            }
            if model.child is not None:
                fully_shard(model.child, **kwargs)
            fully_shard(model, **kwargs)
            if self.world_size > 2:
                for module in model.modules():
                    if isinstance(module, FSDPModule):
                        module.set_custom_reduce_scatter(DeterministicReduceScatter())
            models.append(model)
        return models[0], models[1]


@pytest.mark.slow
class TestFullyShardPerParamPropertiesW3(TestFullyShardPerParamProperties):
    @property
    def world_size(self) -> int:
        return 3


@pytest.mark.slow
class TestFullyShardPerParamPropertiesW4(TestFullyShardPerParamProperties):
    @property
    def world_size(self) -> int:
        return 4


if __name__ == "__main__":
    run_tests()
