"""The package tests' one helper module: process groups, bitwise and reference
checks, the two implementations side by side, torchtitan-style model building.

Multi-process tests run on CPU (gloo) or CUDA (NCCL): upstream ``FSDPTest``
skips every test when ``torch.accelerator.device_count()`` is below the world
size, which is always the case on CPU. This base runs the same test body on
gloo/CPU, and on NCCL when enough CUDA GPUs are present; a CUDA machine with
too few GPUs skips cleanly. The models, the collective recorder and the memory
measurements live in ``fsdp_ext_testing``, shared with the demos and the
benchmark.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import importlib
import os
import queue
import sys
import tempfile
import time
import traceback
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream_fsdp
import torch.distributed.fsdp._fully_shard._fsdp_common as upstream_common
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.common_distributed import TEST_SKIPS, get_timeout
from torch.testing._internal.common_fsdp import run_subtests
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext

# The tests take the residual MLP stack from here; it lives in fsdp_ext_testing, shared with the bench
from fsdp_ext_testing.models import Block, Model  # noqa: F401
from torch_fsdp_ext import _vendor as vendor

DEVICE_TYPE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "nccl" if DEVICE_TYPE == "cuda" else "gloo"


class _Ranks:
    """``world_size`` spawned processes, one per rank, in one process group
    (gloo on CPU, NCCL on CUDA), that run test methods one after another,
    each in a new instance of its class: a test pays no spawn of its own
    (importing torch costs each rank seconds of CPU)."""

    def __init__(self, world_size: int) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        with tempfile.NamedTemporaryFile(prefix="fsdp_ext_ranks_", delete=False) as f:
            self.store_file = f.name
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.processes = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, self.store_file, tasks, self.results),
                name=f"rank {rank}",
                daemon=True,
            )
            for rank, tasks in enumerate(self.tasks)
        ]
        for process in self.processes:
            process.start()
        self.alive = True

    def run(self, test: FSDPExtTestMultiProcess) -> None:
        """Runs ``test``'s method on every rank; fails with the first rank's
        traceback, skips if the ranks skip. After a failure or a timeout the
        ranks are ended (the others may wait in a collective)."""
        task = (type(test).__module__, type(test).__qualname__, test._testMethodName)
        for tasks in self.tasks:
            tasks.put(task)
        deadline = time.monotonic() + get_timeout(test.id())
        skip = None
        for _ in self.processes:
            rank, outcome, detail = self._next_result(deadline)
            if outcome == "error":
                self.close(wait=False)
                test.fail(f"rank {rank} failed:\n{detail}")
            if outcome == "skip":
                skip = detail
        if skip is not None:
            test.skipTest(skip)

    def _next_result(self, deadline: float) -> tuple[int, str, str | None]:
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                pass
            for rank, process in enumerate(self.processes):
                if process.exitcode is not None:
                    self.close(wait=False)
                    raise RuntimeError(f"rank {rank} exited with code {process.exitcode}")
            if time.monotonic() > deadline:
                self.close(wait=False)
                raise TimeoutError("the ranks did not finish in time")

    def close(self, wait: bool = True) -> None:
        """Ends the ranks: after their current test if ``wait``, else at once."""
        self.alive = False
        for tasks in self.tasks:
            if wait:
                tasks.put(None)
        for process in self.processes:
            if wait:
                process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()
        with contextlib.suppress(OSError):
            os.remove(self.store_file)


def _rank_main(rank: int, world_size: int, store_file: str, tasks, results) -> None:
    """One rank of :class:`_Ranks`: joins the process group, then runs each
    test sent until told to stop."""
    if DEVICE_TYPE == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=store)
    seed = torch.initial_seed()
    while (task := tasks.get()) is not None:
        module, qualname, method = task
        cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        test = cls(method)
        test.rank = rank
        test.file_name = store_file
        # Each test starts as in a new process: the default generator at its
        # initial seed. One intra-op thread: up to four ranks share few cores
        # (3x faster on 2 cores)
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            getattr(test, method)()
        except unittest.SkipTest as e:
            results.put((rank, "skip", str(e)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        else:
            results.put((rank, "ok", None))
    # Skip interpreter teardown. There, a gloo worker thread that drops the
    # last reference to a tensor Python has seen cannot take the GIL of the
    # finalizing interpreter and aborts the rank (seen 1 in 4 quick-loop runs
    # on a DTensor ``full_tensor()`` test; see
    # docs/upstream-gloo-funcol-heap-corruption.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Live ranks by key: the world size, or the class for ``own_processes``
_RANKS: dict[Any, _Ranks] = {}


@atexit.register
def _close_ranks() -> None:
    while _RANKS:
        _RANKS.popitem()[1].close()


class FSDPExtTestMultiProcess(TestCase):
    """Runs each test on ``world_size`` processes, one per rank, with a real
    process group (gloo on CPU, NCCL on CUDA); ``self.rank`` is the rank.

    The processes of a world size serve every such test of the session, one
    test after another, each as if in new processes (default generator at
    its initial seed, one intra-op thread); a failure ends them and the next
    test starts new ones. A class that changes what outlives a test (the
    environment at spawn, monkeypatched modules, Dynamo's caches) sets
    ``own_processes``: its tests get processes of their own, ended after the
    class. ``file_name`` is a path every rank of a test shares.
    """

    MAIN_PROCESS_RANK = -1
    rank = MAIN_PROCESS_RANK
    own_processes = False

    @property
    def world_size(self) -> int:
        return 2

    def __init__(self, methodName: str = "runTest") -> None:
        super().__init__(methodName)
        if methodName.startswith("test"):
            fn = getattr(self, methodName)

            @functools.wraps(fn)
            def on_ranks() -> None:
                if self.rank == self.MAIN_PROCESS_RANK:
                    self._ranks().run(self)
                else:
                    fn()

            setattr(self, methodName, on_ranks)

    def _ranks(self) -> _Ranks:
        if DEVICE_TYPE == "cuda" and torch.cuda.device_count() < self.world_size:
            self.skipTest(TEST_SKIPS[f"multi-gpu-{self.world_size}"].message)
        key = type(self) if self.own_processes else self.world_size
        if key not in _RANKS or not _RANKS[key].alive:
            _RANKS[key] = _Ranks(self.world_size)
        return _RANKS[key]

    @classmethod
    def tearDownClass(cls) -> None:
        if cls.own_processes and cls in _RANKS:
            _RANKS.pop(cls).close()
        super().tearDownClass()

    def run_subtests(self, *args, **kwargs):
        return run_subtests(self, *args, **kwargs)


class FakeProcessGroupTestCase(TestCase):
    """One process over the fake process group at ``world_size`` ranks, as rank 0.

    Collectives move no data and complete at once, holding no tensor after they
    return: memory measurements are deterministic (on gloo, a worker thread
    drops a finished collective's tensors on its own schedule)."""

    world_size = 4

    def setUp(self) -> None:
        super().setUp()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)

    def tearDown(self) -> None:
        dist.destroy_process_group()
        super().tearDown()


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Describe where two tensors first differ, for bitwise-equality failures."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{actual.shape=} {actual.dtype=} vs {expected.shape=} {expected.dtype=}"
    ne = ((actual != expected) & ~(actual.isnan() & expected.isnan())).reshape(-1)
    flat_idx = ne.nonzero().flatten()
    if flat_idx.numel() == 0:
        return "equal"
    first = flat_idx[0].item()
    where = tuple(int(i) for i in torch.unravel_index(flat_idx[0], actual.shape))
    return (
        f"{flat_idx.numel()} of {actual.numel()} elements differ; first at {where}: "
        f"{actual.reshape(-1)[first].item()!r} vs {expected.reshape(-1)[first].item()!r}"
    )


def assert_matches_reference(
    test: TestCase,
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    reduction_size: int,
    msg: str,
) -> None:
    """Asserts ``actual`` equals an unsharded reference's ``expected`` up to
    reordering sums of ``reduction_size`` terms: at most
    ``reduction_size * eps`` of the largest magnitude in ``expected`` (the
    worst-case rounding bound of recursive summation, Higham, "Accuracy and
    Stability of Numerical Algorithms", 4.2). The bound holds whatever order
    the CPU's kernels sum in, so the check does not depend on them."""
    tol = reduction_size * torch.finfo(expected.dtype).eps
    scale = expected.abs().max().item()
    torch.testing.assert_close(
        actual,
        expected,
        rtol=tol,
        atol=tol * scale,
        msg=lambda default: f"{msg}: {default}",
    )


def assert_model_matches_reference(
    test: TestCase,
    model: nn.Module,
    ref: nn.Module,
    *,
    grads: bool,
    reduction_size: int,
    what: str,
) -> None:
    """:func:`assert_matches_reference` for every full (DTensor) parameter of
    ``model``, or its gradient if ``grads``, against the unsharded ``ref``."""
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        actual, expected = (param.grad, ref_param.grad) if grads else (param, ref_param)
        assert_matches_reference(
            test,
            actual.full_tensor(),
            expected,
            reduction_size=reduction_size,
            msg=f"{what} {'grad' if grads else 'param'} {name}",
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
    before_forward: Callable[[nn.Module], None] = lambda model: None,
    no_all_reduce_microbatches: bool = False,
) -> list[float]:
    """Train two models side by side and require bitwise-equal losses, sharded
    gradients after every backward and sharded parameters after every step.

    ``make_input(step)`` must be deterministic; with ``microbatches > 1`` the
    gradients are accumulated, with ``no_sync_microbatches`` all but the last
    microbatch skip gradient sync (``set_requires_gradient_sync(False)``), with
    ``no_all_reduce_microbatches`` they reduce-scatter but skip the HSDP
    all-reduce (``set_requires_all_reduce(False)``). ``before_forward(model)``
    runs before each forward. Returns the losses.
    """
    optim = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=lr, foreach=True)
    losses = []
    for step in range(num_steps):
        for micro in range(microbatches):
            sync = micro == microbatches - 1
            inp = make_input(step * microbatches + micro)
            step_losses = []
            for m in (model, ref_model):
                if no_sync_microbatches:
                    m.set_requires_gradient_sync(sync)
                if no_all_reduce_microbatches:
                    m.set_requires_all_reduce(sync)
                before_forward(m)
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


# The two implementations under test. Mesh-info types are per implementation:
# each ``fully_shard`` recognizes only its own ``ShardPlacementResult``.
UPSTREAM = SimpleNamespace(
    name="upstream",
    fully_shard=upstream_fsdp.fully_shard,
    MixedPrecisionPolicy=upstream_fsdp.MixedPrecisionPolicy,
    CPUOffloadPolicy=upstream_fsdp.CPUOffloadPolicy,
    FSDPModule=upstream_fsdp.FSDPModule,
    FSDPMeshInfo=upstream_common.FSDPMeshInfo,
    # None on torch 2.11, where only the GPU lane's carried copy runs
    # (tools/carried/), with no upstream comparison, and on torch 2.9
    ShardPlacementResult=getattr(upstream_common, "ShardPlacementResult", None),
)
EXT = SimpleNamespace(
    name="ext",
    fully_shard=torch_fsdp_ext.fully_shard,
    MixedPrecisionPolicy=torch_fsdp_ext.MixedPrecisionPolicy,
    CPUOffloadPolicy=torch_fsdp_ext.CPUOffloadPolicy,
    FSDPModule=torch_fsdp_ext.FSDPModule,
    FSDPMeshInfo=torch_fsdp_ext.FSDPMeshInfo,
    # None where the base omits per-parameter meshes (torch 2.9.0)
    ShardPlacementResult=getattr(torch_fsdp_ext, "ShardPlacementResult", None),
)


def omitted_patch_reason(subject_prefix: str) -> str | None:
    """Why the installed torch's series leaves out the primary patch whose
    subject starts with ``subject_prefix`` (``[series.omitted]`` in its
    base.toml), as a skip reason; None if it carries the patch."""
    release = vendor.installed_release()
    omitted = vendor.read_base(vendor.patches_dir(release)).omitted
    for subject, reason in omitted.items():
        if subject.startswith(subject_prefix):
            return f"torch {release}'s series leaves out {subject!r}: {reason}"
    return None


# For tests of per-parameter meshes (``ShardPlacementResult(mesh=...)``)
PER_PARAM_MESHES_OMITTED = omitted_patch_reason("[FSDP2] Per-parameter meshes")
requires_per_param_meshes = unittest.skipIf(
    PER_PARAM_MESHES_OMITTED is not None, PER_PARAM_MESHES_OMITTED or ""
)


def unexpressible_configs() -> dict[str, str]:
    """The parity configurations (``base_parity_configs`` and the
    compositions) that the installed torch's FSDP2 cannot express, each with
    why; the parity tests leave them out and ``test_unexpressible_configs``
    reports them as one skip, so that none is dropped silently."""
    out = {}
    if PER_PARAM_MESHES_OMITTED is not None:
        # torch 2.9.0, where upstream has no ShardPlacementResult either
        out["per_param_mesh"] = PER_PARAM_MESHES_OMITTED
    if "param_dtype_override_fn" not in {f.name for f in fields(UPSTREAM.MixedPrecisionPolicy)}:
        out["bf16_params_fp32_norms"] = (
            "MixedPrecisionPolicy has no param_dtype_override_fn (torch 2.15 on)"
        )
    for name, setter in (
        ("unused_params_reduce_scattered", "set_reduce_scatter_unused_params"),
        ("reduce_scatter_max_input_buffers_2", "set_reduce_scatter_max_input_buffers"),
    ):
        if not hasattr(EXT.FSDPModule, setter):
            out[name] = f"FSDPModule has no {setter}"
    return out


class TestUnexpressibleConfigs(unittest.TestCase):
    """Imported by the parity test files: one visible skip per file, naming
    the configurations this torch cannot express."""

    def test_unexpressible_configs(self):
        left_out = unexpressible_configs()
        if left_out:
            self.skipTest("; ".join(f"{name}: {why}" for name, why in left_out.items()))


def param_groups(module: nn.Module) -> list[Any]:
    """The parameter groups of the FSDP state of ``module``: several with
    per-parameter meshes (torch 2.14 on), at most one on torch 2.9."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


def fsdp_modules(model: nn.Module) -> list[Any]:
    """The modules of ``model`` sharded by this package's ``fully_shard``."""
    return [m for m in model.modules() if isinstance(m, EXT.FSDPModule)]


def on_fsdp_modules(fn: Callable[[nn.Module], Any]) -> Callable[[nn.Module], None]:
    """An ``after_shard`` that calls ``fn`` on every FSDP module of the model."""

    def apply(model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, (EXT.FSDPModule, UPSTREAM.FSDPModule)):
                fn(module)

    return apply


@dataclass
class ParityConfig:
    """One training setup, applied identically to both implementations.

    ``fsdp_kwargs(impl)`` gives extra ``fully_shard`` kwargs, ``after_shard(model)``
    runs on each sharded model (setters, hooks), and ``train_kwargs`` go to
    :func:`train_in_lockstep`.
    """

    dim: int = 16
    hidden: int = 32
    mesh: DeviceMesh | None = None
    fsdp_kwargs: Callable[[SimpleNamespace], dict[str, Any]] = lambda impl: {}
    after_shard: Callable[[nn.Module], None] = lambda model: None
    train_kwargs: dict[str, Any] = field(default_factory=dict)
    # Runs a different model (e.g. with an unused parameter) if set
    model_fn: Callable[[int, int], nn.Module] | None = None


def _model_with_only_norms_1d_of_dim(dim: int, hidden: int) -> nn.Module:
    """:class:`Model` whose only 1-D parameters of size ``dim`` are the norms'."""
    model = Model(dim, hidden)
    model.inp = nn.Linear(dim, dim, bias=False)
    for block in model.blocks:
        block.w2 = nn.Linear(hidden, dim, bias=False)
    return model


def _fp32_norms_config() -> ParityConfig:
    kept_fp32: list[nn.Parameter] = []

    def keep_norms_fp32(param: nn.Parameter) -> torch.dtype | None:
        if param.ndim == 1 and param.numel() == 16:
            kept_fp32.append(param)
            return torch.float32
        return None

    def after_shard(model: nn.Module) -> None:
        # Each block's group must mix fp32 norms with bf16 linears
        if len(kept_fp32) < 2 * len(model.blocks):
            raise AssertionError(f"the policy kept {len(kept_fp32)} norm parameters in fp32")

    return ParityConfig(
        fsdp_kwargs=lambda impl: {
            "mp_policy": impl.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, param_dtype_override_fn=keep_norms_fp32
            )
        },
        after_shard=after_shard,
        model_fn=_model_with_only_norms_1d_of_dim,
    )


class ParityMixin:
    """Builds :class:`Model` twice from seed 42, shards it two ways and trains in lockstep.

    Works with both process models: :class:`FSDPExtTestMultiProcess` and
    upstream's threaded ``FSDPTestMultiThread``.
    """

    @property
    def device(self) -> torch.device:
        if DEVICE_TYPE == "cuda":
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    def check_parity(
        self,
        config: ParityConfig,
        variant: tuple[SimpleNamespace, dict[str, Any]],
        ref_variant: tuple[SimpleNamespace, dict[str, Any]],
        variant_after_shard: Callable[[nn.Module], None] = lambda model: None,
    ) -> list[float]:
        """Trains ``variant`` against ``ref_variant``; ``variant_after_shard``
        runs on the first model only, after ``config.after_shard``."""
        torch.manual_seed(42)
        base = (config.model_fn or Model)(config.dim, config.hidden).to(self.device)
        mesh = config.mesh or init_device_mesh(self.device.type, (self.world_size,))
        models = []
        for impl, extra_kwargs in (variant, ref_variant):
            model = copy.deepcopy(base)
            kwargs = {**config.fsdp_kwargs(impl), **extra_kwargs}
            for block in model.blocks:
                impl.fully_shard(block, mesh=mesh, **kwargs)
            impl.fully_shard(model, mesh=mesh, **kwargs)
            config.after_shard(model)
            models.append(model)
        variant_after_shard(models[0])
        # Same input on both models: seed 42 + rank, advanced per step
        make_input = make_input_fn(self.rank, self.device, config.dim)
        return train_in_lockstep(self, models[0], models[1], make_input, **config.train_kwargs)

    def base_parity_configs(self) -> dict[str, Callable[[], ParityConfig]]:
        """The configurations of the vendored-vs-upstream parity proof.

        Factories, since meshes and process groups must be built inside the test.
        """
        configs = {
            "fp32": ParityConfig,
            "bf16_params_fp32_reduce": lambda: ParityConfig(
                fsdp_kwargs=lambda impl: {
                    "mp_policy": impl.MixedPrecisionPolicy(
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                    )
                }
            ),
            "shard_dim1_for_2d_params": lambda: ParityConfig(
                fsdp_kwargs=lambda impl: {
                    "shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else None
                }
            ),
            "grad_accumulation_no_sync": lambda: ParityConfig(
                train_kwargs={"microbatches": 3, "no_sync_microbatches": True}
            ),
            # dim-0 sizes not divisible by the world size: padded shards
            "uneven_dim0": lambda: ParityConfig(dim=15, hidden=21),
        }
        # Left out where the base cannot express them (unexpressible_configs();
        # test_unexpressible_configs reports them as a skip)
        if "per_param_mesh" not in unexpressible_configs():
            configs["per_param_mesh"] = self._per_param_mesh_config
        if "bf16_params_fp32_norms" not in unexpressible_configs():
            # per-parameter param dtypes, so one group reduces bf16 and fp32
            # gradients together (in their promoted dtype)
            configs["bf16_params_fp32_norms"] = _fp32_norms_config
        if self.world_size == 4:
            configs["reshard_after_forward_2"] = lambda: ParityConfig(
                fsdp_kwargs=lambda impl: {"reshard_after_forward": 2}
            )
            configs["hsdp_2x2"] = lambda: ParityConfig(
                mesh=init_device_mesh(
                    self.device.type, (2, 2), mesh_dim_names=("replicate", "shard")
                )
            )
        return configs

    def _per_param_mesh_config(self) -> ParityConfig:
        # ``ShardPlacementResult`` puts each block's w1 on a second process group
        other_pg = dist.new_group(list(range(self.world_size)))
        other_mesh = DeviceMesh.from_group(other_pg, self.device.type)

        def fsdp_kwargs(impl):
            info = impl.FSDPMeshInfo(other_mesh, shard_mesh_dim=0)

            def shard_placement_fn(param: nn.Parameter):
                # w1's weight is (hidden, dim) and its bias is (hidden,)
                if param.shape[0] == 32:
                    return impl.ShardPlacementResult(Shard(0), info)
                return None

            return {"shard_placement_fn": shard_placement_fn}

        return ParityConfig(fsdp_kwargs=fsdp_kwargs)


@contextlib.contextmanager
def registered_fsdp_backend(
    device_type: str, backend: torch_fsdp_ext.FSDPBackend
) -> Iterator[None]:
    """Registers ``backend`` for ``device_type``, then restores the previous
    registration (or none). (``test/upstream/test_fully_shard_backend.py`` has
    its own ``_registered``: it travels in the series without this module.)"""
    previous = torch_fsdp_ext.get_fsdp_backend(device_type)
    torch_fsdp_ext.register_fsdp_backend(device_type, backend, override=True)
    try:
        yield
    finally:
        torch_fsdp_ext.unregister_fsdp_backend(device_type)
        if previous is not None:
            torch_fsdp_ext.register_fsdp_backend(device_type, previous)


# torchtitan-style building, for the interop tests. Order per block: activation
# checkpointing, then ``torch.compile``, then ``fully_shard``; then the root;
# then, for meta-device init, ``to_empty`` and ``reset_parameters`` under seed
# 42. The same function builds the upstream and the vendored model, so any
# difference comes from the implementation.

# How a block is checkpointed:
# - "checkpoint_wrapper": ``checkpoint_wrapper(block)`` (non-reentrant), FSDP on the wrapper
# - "utils_checkpoint": ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)``
#   in a parent module, FSDP on that parent (FSDP outside AC, as torchtitan)
# - "fsdp_inside_checkpoint": FSDP on the block, checkpoint around it (the FSDP
#   hooks run again in the recompute)
AC_KINDS = ("none", "checkpoint_wrapper", "utils_checkpoint", "fsdp_inside_checkpoint")


class CheckpointedBlock(nn.Module):
    """Runs ``inner`` under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def reset_parameters(model: nn.Module) -> None:
    """Re-initializes every parameter in module order (the meta-init step)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.reset_parameters()


def shard_titan_style(
    model: nn.Module,
    impl: SimpleNamespace,
    mesh: DeviceMesh,
    *,
    ac: str = "none",
    compile_blocks: bool = False,
    fullgraph: bool = False,
    fsdp_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Checkpoints, compiles and shards each block of ``model``, then the root."""
    if ac not in AC_KINDS:
        raise ValueError(f"{ac=} is not one of {AC_KINDS}")
    kwargs = {"mesh": mesh, **(fsdp_kwargs or {})}
    for i, block in enumerate(model.blocks):
        shard_target: nn.Module
        if ac == "checkpoint_wrapper":
            block = shard_target = checkpoint_wrapper(block)
        elif ac == "utils_checkpoint":
            block = shard_target = CheckpointedBlock(block)
        elif ac == "fsdp_inside_checkpoint":
            shard_target = block
            block = CheckpointedBlock(block)
        else:
            shard_target = block
        if compile_blocks:
            block.compile(fullgraph=fullgraph)
        impl.fully_shard(shard_target, **kwargs)
        model.blocks[i] = block
    impl.fully_shard(model, **kwargs)
    return model


def build_titan_style(
    impl: SimpleNamespace,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    meta_init: bool = False,
    dim: int = 16,
    hidden: int = 32,
    **shard_kwargs: Any,
) -> nn.Module:
    """Builds :class:`Model` (seed 42), on the meta device if ``meta_init``, and
    shards it with :func:`shard_titan_style`. Uses the global RNG: not for the
    threaded process group, whose ranks share it."""
    torch.manual_seed(42)
    with torch.device("meta" if meta_init else device):
        model = Model(dim, hidden)
    shard_titan_style(model, impl, mesh, **shard_kwargs)
    if meta_init:
        model.to_empty(device=device)
        torch.manual_seed(42)
        reset_parameters(model)
    return model


def make_input_fn(rank: int, device: torch.device, dim: int = 16) -> Callable[[int], torch.Tensor]:
    """Deterministic per-step inputs, seeded with 42 + rank."""
    gen = torch.Generator(device.type)

    def make_input(step: int) -> torch.Tensor:
        gen.manual_seed(42 + rank + 1000 * step)
        return torch.randn(4, dim, device=device, generator=gen)

    return make_input
