"""The public surface of ``torch_fsdp_ext``: upstream's FSDP2 names, the private
per-parameter mesh types, and ``isinstance`` compatibility with torch's ``FSDPModule``."""

import ast
import copy
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.fsdp as upstream_fsdp
import torch.distributed.fsdp._fully_shard._fsdp_common as _upstream_common
import torch.nn as nn
from common_fsdp_ext import param_groups, requires_per_param_meshes
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.testing._internal.common_fsdp import MLP, FSDPTestMultiThread
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from torch_fsdp_ext import _vendor
from torch_fsdp_ext._fully_shard import _fsdp_common


def _series_fsdp2_exports() -> tuple[set[str], set[str]]:
    """The FSDP2 names that ``torch/distributed/fsdp/__init__.py`` exports with
    the installed torch's series applied (imported from ``._fully_shard`` and
    in ``__all__``), and those of them it moves to ``torch.distributed.fsdp``
    (``__module__``), read from the patched file itself."""
    root, pdir = _vendor.installed_series()
    with tempfile.TemporaryDirectory() as tmp:
        _vendor.apply_series(root, pdir, Path(tmp))
        tree = ast.parse((Path(tmp) / "torch/distributed/fsdp/__init__.py").read_text())
    imported, listed, moved = set(), set(), set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "_fully_shard":
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Assign) and isinstance(target := node.targets[0], ast.Name):
            if target.id == "__all__":
                listed = set(ast.literal_eval(node.value))
        elif isinstance(node, ast.Assign) and isinstance(target, ast.Attribute):
            if target.attr == "__module__" and isinstance(target.value, ast.Name):
                moved.add(target.value.id)
    return imported & listed, moved


class TestFullyShardExtPublicAPI(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_exports_what_the_series_exports(self):
        """Tests that the package exports the FSDP2 names of
        ``torch.distributed.fsdp`` as the series patches it (upstream's, plus
        the backend registry, each also in ``_fully_shard.__all__`` and moved
        to ``torch.distributed.fsdp`` by ``__module__``), and besides them only
        ``ShardPlacementResult`` (where the base has per-parameter meshes),
        ``FSDPMeshInfo``, ``HSDPMeshInfo``, ``clip_grad_norm_`` and
        ``DeterministicReduceScatter`` (a test utility in torch's
        ``common_fsdp``, generated from there)."""
        fsdp2_names, moved = _series_fsdp2_exports()
        upstream_names = {
            name
            for name in upstream_fsdp.__all__
            if getattr(upstream_fsdp, name).__module__ == "torch.distributed.fsdp"
            and name in upstream_fsdp._fully_shard.__all__
        }
        self.assertIn("fully_shard", upstream_names)
        self.assertEqual(
            fsdp2_names - upstream_names,
            {
                "FSDPBackend",
                "get_fsdp_backend",
                "register_fsdp_backend",
                "unregister_fsdp_backend",
            },
        )
        self.assertLessEqual(fsdp2_names, moved)
        self.assertLessEqual(fsdp2_names, set(torch_fsdp_ext._fully_shard.__all__))
        extra = {
            "DeterministicReduceScatter",
            "FSDPMeshInfo",
            "HSDPMeshInfo",
            "clip_grad_norm_",
        }
        if hasattr(_fsdp_common, "ShardPlacementResult"):
            extra.add("ShardPlacementResult")
        self.assertEqual(set(torch_fsdp_ext.__all__), fsdp2_names | extra)
        for name in torch_fsdp_ext.__all__:
            self.assertTrue(hasattr(torch_fsdp_ext, name), name)
        if "ShardPlacementResult" in extra:
            self.assertIs(torch_fsdp_ext.ShardPlacementResult, _fsdp_common.ShardPlacementResult)

    def test_sharded_module_is_upstream_fsdp_module(self):
        """Tests that a module sharded by ``torch_fsdp_ext.fully_shard`` is an
        instance of torch's ``FSDPModule`` (torch code checks this), keeps its
        original class, and still indexes into containers as the original class."""
        model = nn.Sequential(MLP(8), MLP(8))
        for mlp in model:
            torch_fsdp_ext.fully_shard(mlp)
        torch_fsdp_ext.fully_shard(model)
        for module in (model, model[0]):
            self.assertIsInstance(module, upstream_fsdp.FSDPModule)
            self.assertIsInstance(module, torch_fsdp_ext.FSDPModule)
        self.assertIsInstance(model[0], MLP)
        # FSDPModule.__new__ constructs the original class, skipping both FSDPModule bases
        self.assertIs(type(model[0]).__new__(type(model[0]), 8).__class__, MLP)
        self.assertIsNot(torch_fsdp_ext.FSDPModule, upstream_fsdp.FSDPModule)

    @requires_per_param_meshes
    def test_accepts_upstream_shard_placement_result(self):
        """Tests that ``torch_fsdp_ext.fully_shard`` takes torch's own
        ``ShardPlacementResult``/``FSDPMeshInfo`` (as torchtitan builds them),
        grouping equal mesh infos, and trains bitwise like ours."""
        other_pg = dist.new_group(list(range(self.world_size)))
        other_mesh = DeviceMesh.from_group(other_pg, "cpu", mesh_dim_names=("efsdp",))
        torch.manual_seed(42)
        base = MLP(8)
        results = []
        for common in (_upstream_common, _fsdp_common):
            model = copy.deepcopy(base)
            torch_fsdp_ext.fully_shard(
                model,
                shard_placement_fn=lambda p, c=common: (
                    c.ShardPlacementResult(Shard(0), c.FSDPMeshInfo(other_mesh, shard_mesh_dim=0))
                    if p.ndim == 2
                    else None
                ),
            )
            self.assertEqual(len(param_groups(model)), 2)
            self.assertEqual(model.in_proj.weight.device_mesh, other_mesh)
            model(torch.ones(2, 8)).sum().backward()
            results.append([p.grad.to_local() for p in model.parameters()])
        for grad, ref_grad in zip(*results, strict=True):
            self.assertTrue(torch.equal(grad, ref_grad))

    def test_upstream_fully_shard_is_untouched(self):
        """Tests that importing ``torch_fsdp_ext`` leaves torch's own ``fully_shard``
        (and its ``fsdp::`` ops) as they were: the two coexist in one process."""
        model = MLP(8)
        upstream_fsdp.fully_shard(model)
        self.assertNotIsInstance(model, torch_fsdp_ext.FSDPModule)
        with self.assertRaisesRegex(TypeError, "group_collectives"):
            upstream_fsdp.fully_shard(MLP(8), group_collectives=False)


if __name__ == "__main__":
    run_tests()
