"""The FSDP backend registry end to end: capability-aware reductions on gloo,
unregistering restores upstream bit for bit, entry-point discovery, and the
TorchTPU-style worked example in ``examples/fsdp_backend_tpu``."""

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
    ParityConfig,
    ParityMixin,
    on_fsdp_modules,
)
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fsdp_backend_tpu"
sys.path[:0] = [str(Path(__file__).resolve().parent / "upstream"), str(EXAMPLE)]

import fsdp_backend_example_tpu  # noqa: E402
from test_fully_shard_backend import _registered  # noqa: E402


@pytest.mark.slow
class TestFullyShardBackendRegistryGloo(ParityMixin, FSDPExtTestMultiProcess):
    def test_divide_factor_on_gloo_equals_force_sum(self):
        """Tests that ``set_gradient_divide_factor`` works on CPU/gloo, which
        rejects PREMUL_SUM, and gives the bits of
        ``set_force_sum_reduction_for_comms(True)``, in both modes."""
        for group_collectives in (True, False):
            config = ParityConfig(
                fsdp_kwargs=lambda impl, gc=group_collectives: {"group_collectives": gc},
                after_shard=on_fsdp_modules(lambda m: m.set_gradient_divide_factor(3.0)),
            )
            self.check_parity(
                config,
                (EXT, {}),
                (EXT, {}),
                variant_after_shard=on_fsdp_modules(
                    lambda m: m.set_force_sum_reduction_for_comms(True)
                ),
            )

    def test_unregister_restores_upstream_bitwise(self):
        """Tests that after a backend was registered, used and unregistered,
        ``torch_fsdp_ext.fully_shard`` trains bitwise like upstream again."""
        backend = torch_fsdp_ext.FSDPBackend(
            group_collectives=False,
            reduce_scatter_comm=fsdp_backend_example_tpu.TPUReduceScatter,
        )
        with _registered("cpu", backend):
            model = torch_fsdp_ext.fully_shard(torch.nn.Linear(8, 8))
            model(torch.randn(2, 8)).sum().backward()
            self.assertFalse(model._get_fsdp_state()._fsdp_param_groups[0].group_collectives)
            torch_fsdp_ext.unregister_fsdp_backend("cpu")
            try:
                self.check_parity(ParityConfig(), (EXT, {}), (UPSTREAM, {}))
            finally:
                torch_fsdp_ext.register_fsdp_backend("cpu", backend)

    def test_tpu_example_trains_on_cpu(self):
        """Tests that the worked TorchTPU example, registered for ``"cpu"`` as
        a stand-in, makes plain ``fully_shard`` per-parameter with its comms,
        and trains bitwise like default grouped FSDP (world size 2)."""
        previous = torch_fsdp_ext.get_fsdp_backend("cpu")
        fsdp_backend_example_tpu.register("cpu")
        try:
            calls_before = fsdp_backend_example_tpu.TPUReduceScatter.calls
            self.check_parity(
                ParityConfig(),
                (EXT, {}),
                (EXT, {"group_collectives": True}),
                variant_after_shard=lambda model: self.assertFalse(
                    model._get_fsdp_state()._fsdp_param_groups[0].group_collectives
                ),
            )
            self.assertGreater(fsdp_backend_example_tpu.TPUReduceScatter.calls, calls_before)
        finally:
            torch_fsdp_ext.unregister_fsdp_backend("cpu")
            torch_fsdp_ext.register_fsdp_backend("cpu", previous)


class TestFullyShardBackendEntryPoints(TestCase):
    def test_entry_point_registers_tpu_backend(self):
        """Tests that installing the example distribution makes FSDP find the
        ``"tpu"`` backend through the ``torch_fsdp_ext.backends`` entry point,
        in a process where PrivateUse1 is renamed ``"tpu"`` (as torch_tpu does)."""
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
                "torch.utils.rename_privateuse1_backend('tpu')\n"
                "import torch_fsdp_ext\n"
                "backend = torch_fsdp_ext.get_fsdp_backend('tpu')\n"
                "print(backend.group_collectives, backend.reduce_scatter_comm.__name__)\n"
            )
            env = {**os.environ, "PYTHONPATH": str(target)}
            proc = subprocess.run(
                [sys.executable, "-c", script], env=env, capture_output=True, text=True
            )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "False TPUReduceScatter")


if __name__ == "__main__":
    run_tests()
