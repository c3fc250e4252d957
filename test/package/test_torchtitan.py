"""torchtitan 0.3 on ``torch_fsdp_ext.fully_shard`` (``torch_fsdp_ext.torchtitan``).

The switch itself (``use_fsdp_ext`` and the ``--override.imports`` entry), and
parity: torchtitan's debug models, built through its model registry and
parallelized by its own ``parallelize_fn``, trained from one seed three ways --
torch's ``fully_shard`` (``upstream``), ours grouped and ours per-parameter --
with bitwise-equal losses, gradient norms and every rank's parameter and
gradient shards at every step. llama3 at W=2; deepseek_v3 (MoE) at W=4 with
expert parallelism 2, where the routed experts go to the efsdp mesh through
torch's ``ShardPlacementResult``. Multi-process gloo on CPU ranks, with the CPU
shims of ``fsdp_ext_testing.torchtitan.apply_cpu_shims``.
"""

import math
import unittest

import pytest
import torch

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not importable (requirements.txt pins torchtitan==0.3.0; a base may "
    "exclude it: [requirements.exclude] in patches/<version>/base.toml)",
)

import torch.distributed.fsdp as upstream_fsdp  # noqa: E402
import torchtitan  # noqa: E402
import torchtitan.distributed.fsdp as titan_fsdp  # noqa: E402
from common_fsdp_ext import (  # noqa: E402
    FakeProcessGroupTestCase,
    FSDPExtTestMultiProcess,
    assert_bitwise_equal,
    param_groups,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.testing._internal.common_utils import TestCase, run_tests  # noqa: E402
from torchtitan.config import ConfigManager, apply_overrides  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402

import torch_fsdp_ext  # noqa: E402
from fsdp_ext_testing.torchtitan import DebugRun, debug_config  # noqa: E402
from torch_fsdp_ext.torchtitan import (  # noqa: E402
    FSDPExtSettings,
    TorchtitanLayoutError,
    active_settings,
    use_fsdp_ext,
)

OVERRIDE = "torch_fsdp_ext.torchtitan.fsdp_ext"


class TestFullyShardTorchtitanSwitch(TestCase):
    """The switch, without training; single process."""

    def setUp(self) -> None:
        super().setUp()
        # Whatever a test does, torchtitan gets torch's fully_shard back
        self.addCleanup(setattr, titan_fsdp, "fully_shard", upstream_fsdp.fully_shard)

    def test_use_fsdp_ext_rebinds_and_restores(self):
        """Tests that use_fsdp_ext points torchtitan's fully_shard at ours with
        the settings, stacks, and restores torch's on leaving the block."""
        self.assertIsNone(active_settings())
        with use_fsdp_ext(group_collectives=False) as outer:
            self.assertEqual(active_settings(), FSDPExtSettings(group_collectives=False))
            self.assertEqual(outer.settings, active_settings())
            with use_fsdp_ext(True, deterministic_reduce_scatter=True):
                self.assertEqual(active_settings(), FSDPExtSettings(True, True))
            self.assertEqual(active_settings(), FSDPExtSettings(group_collectives=False))
        self.assertIsNone(active_settings())
        self.assertIs(titan_fsdp.fully_shard, upstream_fsdp.fully_shard)

    def test_bad_settings_raise_before_rebinding(self):
        """Tests that a non-bool group_collectives raises TypeError and leaves torch's fully_shard."""
        with self.assertRaisesRegex(TypeError, "group_collectives must be a bool"):
            use_fsdp_ext("no")
        self.assertIsNone(active_settings())

    def test_unsupported_torchtitan_raises(self):
        """Tests that another torchtitan release, or a fully_shard that someone
        else replaced, raises TorchtitanLayoutError naming the problem."""
        version = torchtitan.__version__
        self.addCleanup(setattr, torchtitan, "__version__", version)
        torchtitan.__version__ = "0.4.0"
        with self.assertRaisesRegex(
            TorchtitanLayoutError, "supports torchtitan 0.3.x, found 0.4.0"
        ):
            use_fsdp_ext()
        torchtitan.__version__ = version
        titan_fsdp.fully_shard = lambda module, **kwargs: module
        with self.assertRaisesRegex(TorchtitanLayoutError, "expected torch.distributed.fsdp"):
            use_fsdp_ext()

    def test_override_imports_cli_flag(self):
        """Tests that the documented CLI flag, parsed by torchtitan's
        ConfigManager and applied by its apply_overrides (as Trainer.__init__
        does before parallelize_fn), switches torchtitan to ours."""
        config = ConfigManager().parse_args(
            [
                "--module",
                "llama3",
                "--config",
                "llama3_debugmodel",
                "--override.imports",
                f'{OVERRIDE}={{"group_collectives": false}}',
            ]
        )
        self.assertEqual(config.override.imports, [(OVERRIDE, {"group_collectives": False})])
        self.assertIsNone(active_settings())
        model_config = config.model_spec.model
        lines = apply_overrides(config.override, config)
        self.assertEqual(len(lines), 1, lines)
        self.assertIn(f"[Override] {OVERRIDE}: model_spec.model ", lines[0])
        self.assertEqual(active_settings(), FSDPExtSettings(group_collectives=False))
        # The hook leaves the model config as it was
        self.assertIs(config.model_spec.model, model_config)


class TestFullyShardTorchtitanPolicies(FakeProcessGroupTestCase):
    """torchtitan passes torch's policy classes."""

    def setUp(self) -> None:
        super().setUp()
        self.addCleanup(setattr, titan_fsdp, "fully_shard", upstream_fsdp.fully_shard)

    def test_torch_policies_reach_ours(self):
        """Tests that torch's CPUOffloadPolicy and MixedPrecisionPolicy, as
        torchtitan passes them, take effect in our fully_shard (our copy checks
        its own CPUOffloadPolicy class, so unconverted it would not offload)."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        with use_fsdp_ext(group_collectives=False):
            module = titan_fsdp.fully_shard(
                torch.nn.Linear(8, 8),
                mesh=mesh,
                mp_policy=upstream_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                offload_policy=upstream_fsdp.CPUOffloadPolicy(pin_memory=False),
            )
        self.assertIsInstance(module, torch_fsdp_ext.FSDPModule)
        group = module._get_fsdp_state()._fsdp_param_group
        self.assertFalse(group.group_collectives)
        self.assertTrue(all(p.offload_to_cpu for p in group.fsdp_params))
        self.assertTrue(all(p.mp_policy.param_dtype == torch.bfloat16 for p in group.fsdp_params))


# The three ways every parity test trains; the first is the reference
ARMS = {
    "upstream": None,
    "grouped": FSDPExtSettings(group_collectives=True),
    "per-param": FSDPExtSettings(group_collectives=False),
}
# Three steps: the first from the same init, two after AdamW updates
STEPS = 3


# The parity harness builds CPU models (apply_cpu_shims); the base class would
# run NCCL on a CUDA machine
cpu_only = unittest.skipIf(
    torch.cuda.is_available(),
    "trains on CPU ranks over gloo; on GPUs run torchtitan itself (docs/torchtitan.md)",
)


class ThreeWayMixin:
    # apply_cpu_shims patches torchtitan, whose spmd_types backend keeps the
    # meshes of a process's first ParallelDims
    own_processes = True

    def check_three_ways(self, model: str, *, ep: int = 1, param_dtypes=("bfloat16",)):
        """Trains ``model``'s debug config three ways (:data:`ARMS`) from seed
        42 for :data:`STEPS` steps on the same tokens (seed 42 + rank + 1000 *
        step), per parameter dtype; everything each rank holds must be bitwise
        equal at every step."""
        # One ParallelDims per process: torchtitan's spmd_types backend keeps
        # the meshes of the first in module state
        config = debug_config(model, ep=ep, steps=STEPS)
        parallel_dims = ParallelDims.from_config(config.parallelism, self.world_size)
        for param_dtype in param_dtypes:
            self.check_dtype(model, ep, param_dtype, parallel_dims)

    def check_dtype(self, model: str, ep: int, param_dtype: str, parallel_dims: ParallelDims):
        def config():
            return debug_config(model, ep=ep, steps=STEPS, param_dtype=param_dtype)

        runs = {
            name: DebugRun(config(), parallel_dims, fsdp, seed=42) for name, fsdp in ARMS.items()
        }
        self.check_arms_are_distinct(runs)
        ref = runs["upstream"]
        if ep > 1:
            # EP engaged: routed experts FSDP-sharded on the efsdp mesh (check_shards
            # then requires the same meshes in every arm)
            meshes = {p.device_mesh.mesh_dim_names for p in ref.model.parameters()}
            self.assertTrue(any("efsdp" in names for names in meshes), meshes)
        vocab = ref.model_config.vocab_size
        shape = (ref.config.training.local_batch_size, ref.config.training.seq_len + 1)
        losses = []
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(42 + self.rank + 1000 * step)
            tokens = torch.randint(vocab, shape, generator=gen)
            results = {name: run.step(tokens) for name, run in runs.items()}
            ref_loss, ref_norm = results["upstream"]
            for name in ("grouped", "per-param"):
                loss, norm = results[name]
                what = f"{model} {param_dtype} step {step} {name} vs upstream"
                assert_bitwise_equal(self, loss, ref_loss, f"{what}: loss")
                assert_bitwise_equal(self, norm, ref_norm, f"{what}: grad norm")
                self.check_shards(runs[name], ref, what)
            losses.append(ref_loss.item())
        self.assertTrue(all(math.isfinite(loss) for loss in losses), losses)
        # The optimizer moved the parameters: equality is not that of untouched models
        self.assertNotEqual(losses[0], losses[-1])

    def check_arms_are_distinct(self, runs: dict[str, DebugRun]) -> None:
        """The arms really run three implementations: torch's modules in
        ``upstream``, ours with the arm's ``group_collectives`` in the others,
        over the same FSDP units."""
        units = {}
        for name, run in runs.items():
            modules = [m for m in run.model.modules() if isinstance(m, upstream_fsdp.FSDPModule)]
            units[name] = len(modules)
            settings = ARMS[name]
            for module in modules:
                ours = isinstance(module, torch_fsdp_ext.FSDPModule)
                self.assertEqual(ours, settings is not None, msg=f"{name}: {type(module)}")
                if ours:
                    for group in param_groups(module):
                        self.assertEqual(group.group_collectives, settings.group_collectives)
        self.assertEqual(len(set(units.values())), 1, units)

    def check_shards(self, run: DebugRun, ref: DebugRun, what: str) -> None:
        params = list(run.model.named_parameters())
        ref_params = list(ref.model.named_parameters())
        for (name, param), (ref_name, ref_param) in zip(params, ref_params, strict=True):
            self.assertEqual(name, ref_name)
            self.assertEqual(param.placements, ref_param.placements, msg=f"{what}: {name}")
            self.assertEqual(
                param.device_mesh.mesh_dim_names,
                ref_param.device_mesh.mesh_dim_names,
                msg=f"{what}: {name}",
            )
            assert_bitwise_equal(self, param, ref_param, f"{what}: param {name}")
            self.assertEqual(param.grad is None, ref_param.grad is None, msg=f"{what}: {name}")
            if param.grad is not None:
                assert_bitwise_equal(self, param.grad, ref_param.grad, f"{what}: grad {name}")


@cpu_only
class TestFullyShardTorchtitanLlama3(ThreeWayMixin, FSDPExtTestMultiProcess):
    @property
    def world_size(self) -> int:
        return 2

    @pytest.mark.slow
    def test_llama3_debugmodel_three_ways(self):
        """Tests that llama3's debug model trains bitwise alike with torch's
        fully_shard and ours grouped and per-parameter at W=2, with bf16
        parameters (torchtitan's default) and with fp32 parameters, both with
        fp32 reduction."""
        self.check_three_ways("llama3", param_dtypes=("bfloat16", "float32"))


@cpu_only
class TestFullyShardTorchtitanDeepSeekV3(ThreeWayMixin, FSDPExtTestMultiProcess):
    @property
    def world_size(self) -> int:
        return 4

    @pytest.mark.slow
    def test_deepseek_v3_debugmodel_ep2_three_ways(self):
        """Tests that deepseek_v3's debug model (MoE) with expert parallelism 2
        trains bitwise alike with torch's fully_shard and ours grouped and
        per-parameter at W=4, the routed experts FSDP-sharded on the efsdp mesh
        through torch's ShardPlacementResult. Default comms: gloo's sums agree
        across the three here (measured), so no DeterministicReduceScatter."""
        self.check_three_ways("deepseek_v3", ep=2)


if __name__ == "__main__":
    run_tests()
