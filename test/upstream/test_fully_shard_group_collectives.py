# Owner(s): ["oncall: distributed"]

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.common_fsdp import MLP, FSDPTestMultiThread
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext import fully_shard
from torch_fsdp_ext._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult


class TestFullyShardGroupCollectivesInit(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_group_collectives_default_is_grouped(self):
        """Tests that ``group_collectives`` defaults to ``True`` on every parameter group."""
        model = MLP(8)
        fully_shard(model)
        groups = model._get_fsdp_state()._fsdp_param_groups
        self.assertEqual([g.group_collectives for g in groups], [True])

    def test_group_collectives_stored_on_every_param_group(self):
        """Tests that the flag reaches every parameter group, including the
        extra groups that per-parameter meshes create."""
        self.run_subtests(
            {"group_collectives": [False, True], "per_param_mesh": [False, True]},
            self._test_group_collectives_stored_on_every_param_group,
        )

    def _test_group_collectives_stored_on_every_param_group(
        self, group_collectives: bool, per_param_mesh: bool
    ):
        torch.manual_seed(42)
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        shard_placement_fn = None
        if per_param_mesh:
            # A second group over the same ranks but its own process group
            other_pg = dist.new_group(list(range(self.world_size)))
            other_mesh = DeviceMesh.from_group(other_pg, "cpu")
            other_info = FSDPMeshInfo(other_mesh, shard_mesh_dim=0)
            other_params = set(model[1].parameters())

            def shard_placement_fn(param: nn.Parameter):
                if param in other_params:
                    return ShardPlacementResult(Shard(0), other_info)
                return None

        fully_shard(
            model,
            mesh=mesh,
            shard_placement_fn=shard_placement_fn,
            group_collectives=group_collectives,
        )
        groups = model._get_fsdp_state()._fsdp_param_groups
        self.assertEqual(len(groups), 2 if per_param_mesh else 1)
        for group in groups:
            self.assertIs(group.group_collectives, group_collectives)

    def test_group_collectives_rejects_non_bool(self):
        """Tests that a non-bool ``group_collectives`` raises a ``TypeError``
        naming the value instead of being coerced by truthiness."""
        for bad in ("no", 0, 1, None, torch.tensor(True)):
            with self.assertRaisesRegex(TypeError, "group_collectives.*bool") as cm:
                fully_shard(MLP(8), group_collectives=bad)
            self.assertIn(repr(bad), str(cm.exception))


if __name__ == "__main__":
    run_tests()
