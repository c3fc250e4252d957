"""The FSDP backend registry end to end: a backend's forced-SUM default on
gloo, unregistering restores upstream bit for bit, registration from torch's
device-backend autoload, and the TorchTPU-style worked example in
``examples/fsdp_backend_tpu``."""

import contextlib
import copy
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from common_fsdp_ext import (
    EXT,
    UPSTREAM,
    FSDPExtTestMultiProcess,
    Model,
    ParityConfig,
    ParityMixin,
    make_input_fn,
    on_fsdp_modules,
    param_groups,
    registered_fsdp_backend,
    train_in_lockstep,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
from torch_fsdp_ext import DeterministicReduceScatter

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "fsdp_backend_tpu"
sys.path.insert(0, str(EXAMPLE))

import fsdp_backend_example_tpu  # noqa: E402


@pytest.mark.slow
class TestFullyShardBackendRegistryGloo(ParityMixin, FSDPExtTestMultiProcess):
    def test_registered_force_sum_reduction_is_the_setter(self):
        """Tests that on gloo, which rejects PREMUL_SUM, a backend registered
        for ``"cpu"`` with ``force_sum_reduction_for_comms=True`` trains with
        a gradient divide factor bitwise like
        ``set_force_sum_reduction_for_comms(True)``, in both modes, and that
        without either the divide factor raises gloo's own error in both modes,
        as upstream's FSDP2 does."""
        divide = on_fsdp_modules(lambda m: m.set_gradient_divide_factor(3.0))
        backend = torch_fsdp_ext.FSDPBackend(force_sum_reduction_for_comms=True)
        mesh = init_device_mesh("cpu", (self.world_size,))
        make_input = make_input_fn(self.rank, self.device)
        for impl, group_collectives in ((EXT, True), (EXT, False), (UPSTREAM, None)):
            kwargs = {} if group_collectives is None else {"group_collectives": group_collectives}
            torch.manual_seed(42)
            base = Model(16, 32)
            models = []
            for registered in (True, False, False):
                model = copy.deepcopy(base)
                with (
                    registered_fsdp_backend("cpu", backend)
                    if registered
                    else contextlib.nullcontext()
                ):
                    for module in (*model.blocks, model):
                        impl.fully_shard(module, mesh=mesh, **kwargs)
                divide(model)
                models.append(model)
            if impl is EXT:
                on_fsdp_modules(lambda m: m.set_force_sum_reduction_for_comms(True))(models[1])
                train_in_lockstep(self, models[0], models[1], make_input, num_steps=2)
            with self.assertRaisesRegex(RuntimeError, "PREMUL_SUM"):
                models[2](make_input(0)).sum().backward()

    def test_unregister_restores_upstream_bitwise(self):
        """Tests that after a backend was registered, used and unregistered,
        ``torch_fsdp_ext.fully_shard`` trains bitwise like upstream again."""
        backend = torch_fsdp_ext.FSDPBackend(
            group_collectives=False,
            reduce_scatter_comm=fsdp_backend_example_tpu.TPUReduceScatter,
        )
        with registered_fsdp_backend("cpu", backend):
            model = torch_fsdp_ext.fully_shard(torch.nn.Linear(8, 8))
            model(torch.randn(2, 8)).sum().backward()
            self.assertFalse(param_groups(model)[0].group_collectives)
        self.assertIsNone(torch_fsdp_ext.get_fsdp_backend("cpu"))
        self.check_parity(ParityConfig(), (EXT, {}), (UPSTREAM, {}))


class _Recording:
    """Records a comm's calls and what it was handed; keeps every allocation
    (so that no two share an address)."""

    def __init__(self):
        self.foreach_pairs: list[int] = []
        self.calls = 0
        self.allocated: list[torch.Tensor] = []

    def allocate(self, size, *, dtype, device):
        self.allocated.append(super().allocate(size, dtype=dtype, device=device))
        return self.allocated[-1]

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


class _RecordingTPUAllGather(_Recording, fsdp_backend_example_tpu.TPUAllGather):
    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        self.foreach_pairs.append(len(output_tensors))
        return super().foreach(output_tensors, input_tensors, group, async_op)


class _RecordingTPUReduceScatter(_Recording, fsdp_backend_example_tpu.TPUReduceScatter):
    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        self.foreach_pairs.append(len(output_tensors))
        return super().foreach(output_tensors, input_tensors, group, op, async_op)


class _TPUExampleParity(ParityMixin):
    """Trains a model sharded with the example backend registered for
    ``"cpu"`` (a stand-in device) against one sharded per parameter with
    FSDP's default comms, in lockstep, bitwise, and checks what the example's
    comms were handed."""

    num_steps = 3

    def _check_example_against_default(self, ref_after_shard=lambda model: None) -> None:
        torch.manual_seed(42)
        base = Model(16, 32).to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        backend = torch_fsdp_ext.FSDPBackend(
            group_collectives=False,
            all_gather_comm=_RecordingTPUAllGather,
            reduce_scatter_comm=_RecordingTPUReduceScatter,
        )
        models = []
        for registered in (True, False):
            model = copy.deepcopy(base)
            with (
                registered_fsdp_backend("cpu", backend) if registered else contextlib.nullcontext()
            ):
                for module in (*model.blocks, model):
                    torch_fsdp_ext.fully_shard(module, mesh=mesh, group_collectives=False)
            models.append(model)
        ref_after_shard(models[1])
        gen = torch.Generator()

        def make_input(step: int) -> torch.Tensor:
            gen.manual_seed(42 + self.rank + 1000 * step)
            return torch.randn(4, 16, generator=gen)

        train_in_lockstep(self, models[0], models[1], make_input, num_steps=self.num_steps)
        # Each group's comms got one ``foreach`` per all-gather and per
        # reduce-scatter, with a pair per parameter, no per-tensor call, and
        # packed them into buffers of their own ``allocate``
        for module in (*models[0].blocks, models[0]):
            (group,) = param_groups(module)
            num_params = len(group.fsdp_params)
            ag, rs = group._all_gather_comm, group._reduce_scatter_comm
            # Forward, and again in backward unless the root (no reshard)
            ag_per_step = 1 if group._module_fqn == "" else 2
            self.assertEqual(ag.foreach_pairs, [num_params] * ag_per_step * self.num_steps)
            self.assertEqual(rs.foreach_pairs, [num_params] * self.num_steps)
            self.assertEqual((ag.calls, rs.calls), (0, 0))
            self.assertTrue(ag.allocated and rs.allocated)


@pytest.mark.slow
class TestFullyShardBackendExample(_TPUExampleParity, FSDPExtTestMultiProcess):
    def test_one_fused_call_per_group_bitwise_default_comms(self):
        """Tests that with the worked TorchTPU example registered (stand-in
        device ``"cpu"``, world size 2, gloo) plain ``fully_shard`` trains
        bitwise like per-parameter FSDP with its default comms, while each
        parameter group's comm gets one ``foreach`` call per all-gather and
        per reduce-scatter (one c10d collective each), packed into buffers
        from its ``allocate``."""
        self._check_example_against_default()


@pytest.mark.slow
class TestFullyShardBackendExampleW4(_TPUExampleParity, FSDPExtTestMultiProcess):
    @property
    def world_size(self) -> int:
        return 4

    def test_bitwise_deterministic_reduce_scatter_at_world_size_4(self):
        """Tests that at world size 4, where gloo's own sums depend on message
        size, the example's fused reduce-scatter (rank-order sum) trains
        bitwise like per-parameter FSDP with ``DeterministicReduceScatter``."""
        self._check_example_against_default(
            on_fsdp_modules(lambda m: m.set_custom_reduce_scatter(DeterministicReduceScatter()))
        )


class TestFullyShardBackendAutoload(TestCase):
    def test_torch_device_autoload_registers_tpu_backend(self):
        """Tests that installing the example distribution registers the
        ``"tpu"`` backend at ``import torch``, through torch's own
        device-backend autoload (the ``torch.backends`` entry point, as
        torch_tpu uses), with no discovery in FSDP."""
        with tempfile.TemporaryDirectory() as tmp:
            # Build from a copy: setuptools writes egg-info next to the sources
            source, target = Path(tmp) / "src", Path(tmp) / "site"
            shutil.copytree(EXAMPLE, source)
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
            subprocess.run(
                [*pip, "--no-build-isolation", "--target", str(target), str(source)],
                check=True,
                capture_output=True,
            )
            script = (
                "import torch\n"
                "import torch_fsdp_ext\n"
                "backend = torch_fsdp_ext.get_fsdp_backend('tpu')\n"
                "print(backend.group_collectives, backend.reduce_scatter_comm.__name__)\n"
            )
            env = {**os.environ, "PYTHONPATH": str(target), "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}
            proc = subprocess.run(
                [sys.executable, "-c", script], env=env, capture_output=True, text=True
            )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "False TPUReduceScatter")


if __name__ == "__main__":
    run_tests()
