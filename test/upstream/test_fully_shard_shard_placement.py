# Owner(s): ["oncall: distributed"]

import copy
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch_fsdp_ext import DataParallelMeshDims, fully_shard
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather
from torch_fsdp_ext._fully_shard._fsdp_common import (
    FSDPMeshInfo,
    ShardPlacementResult,
)
from torch.distributed.tensor import distribute_tensor, DTensor, Replicate, Shard
from torch_fsdp_ext import DeterministicReduceScatter
from torch.testing._internal.common_fsdp import (
    FSDPTest,
    FSDPTestMultiThread,
    get_devtype,
)
from torch.testing._internal.common_utils import run_tests

device_type = torch.device(get_devtype())
# Parity needs real collectives: one process per accelerator on its default
# backend (NCCL on CUDA), as FSDP2's training tests do, skipped without enough
# accelerators; on CPU, the threaded process group
_ParityTestCase = FSDPTestMultiThread if device_type.type == "cpu" else FSDPTest


class _Experts(nn.Module):
    """Grouped expert weights ``(num_experts, dim, dim)``, optionally an EP DTensor."""

    def __init__(self, num_experts: int, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(num_experts, dim, dim) / dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.to_local() if isinstance(self.w, DTensor) else self.w
        return x + torch.einsum("bd,edh->bh", x, w)


class _MoEBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.experts = _Experts(4, dim)
        # The same values on every rank and call: the threads of the threaded
        # process group share the global RNG
        gen = torch.Generator().manual_seed(42)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) / dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.dense(x))


def _is_expert(param: nn.Parameter) -> bool:
    return param.ndim == 3


class _MoEMeshTestCase(_ParityTestCase):
    @property
    def world_size(self) -> int:
        return 4

    def _train(self, model: nn.Module, steps: int = 2) -> list[torch.Tensor]:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        gen = torch.Generator()
        for step in range(steps):
            gen.manual_seed(42 + self.rank + 1000 * step)
            loss = model(torch.randn(2, 8, generator=gen).to(device_type)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        return losses

    def _train_both_modes(
        self,
        dp_mesh: DeviceMesh,
        expert_placement: ShardPlacementResult,
        check_model: Callable[[nn.Module], None],
        ep_mesh: DeviceMesh | None = None,
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Shards one ``_MoEBlock`` per collective mode with experts at
        ``expert_placement`` (EP DTensors ``Shard(0)`` on ``ep_mesh`` if given),
        runs ``check_model`` on it, trains it, and checks that both modes give
        the same losses and sharded params, which it returns."""
        base = _MoEBlock(8)
        states = []
        for group_collectives in (True, False):
            model = copy.deepcopy(base)
            if ep_mesh is not None:
                model.experts.w = nn.Parameter(
                    distribute_tensor(model.experts.w.detach(), ep_mesh, [Shard(0)])
                )
            fully_shard(
                model,
                mesh=dp_mesh,
                group_collectives=group_collectives,
                shard_placement_fn=lambda p: (
                    expert_placement if _is_expert(p) else None
                ),
            )
            check_model(model)
            states.append(
                (self._train(model), [p.to_local() for p in model.parameters()])
            )
        self._assert_states_equal(*states)
        return states

    def _assert_states_equal(self, state, ref_state) -> None:
        """Compares (losses, tensors) pairs with ``torch.equal``."""
        for tensor, ref_tensor in zip(
            itertools.chain(*state), itertools.chain(*ref_state), strict=True
        ):
            self.assertTrue(torch.equal(tensor, ref_tensor))


class TestFullyShardShardPlacementResultMesh(_MoEMeshTestCase):
    def test_device_mesh_groups_params_per_mesh(self):
        """Tests that ``ShardPlacementResult(mesh=...)`` gives one param group
        per mesh, FSDP on a 1D mesh and HSDP on a 2D mesh, and that both
        collective modes train it to the same bits."""
        world_mesh = init_device_mesh(
            device_type.type, (2, 2), mesh_dim_names=("efsdp", "ep")
        )
        dp_mesh = init_device_mesh(device_type.type, (self.world_size,))
        for expert_mesh, expected_placements in (
            (world_mesh["efsdp"], (Shard(1),)),
            (world_mesh, (Replicate(), Shard(1))),
        ):

            def check_model(
                model, expert_mesh=expert_mesh, placements=expected_placements
            ):
                self.assertEqual(len(model._get_fsdp_state()._fsdp_param_groups), 2)
                self.assertEqual(model.experts.w.device_mesh, expert_mesh)
                self.assertEqual(model.experts.w.placements, placements)
                self.assertEqual(model.dense.weight.device_mesh, dp_mesh)

            self._train_both_modes(
                dp_mesh, ShardPlacementResult(Shard(1), mesh=expert_mesh), check_model
            )

    def test_meshes_sharing_a_process_group_keep_their_own_mesh(self):
        """Tests that with ep=1, where the "efsdp" and "dp" meshes are distinct
        meshes over one process group, experts stay DTensors on "efsdp" in a
        param group of their own, and both collective modes give the same bits."""
        world_mesh = init_device_mesh(
            device_type.type, (self.world_size, 1), mesh_dim_names=("efsdp", "ep")
        )

        def check_model(model):
            self.assertEqual(len(model._get_fsdp_state()._fsdp_param_groups), 2)
            self.assertEqual(model.experts.w.device_mesh.mesh_dim_names, ("efsdp",))
            self.assertEqual(model.dense.weight.device_mesh.mesh_dim_names, ("dp",))

        self._train_both_modes(
            world_mesh["efsdp", "ep"]._flatten("dp"),
            ShardPlacementResult(Shard(1), mesh=world_mesh["efsdp"]),
            check_model,
        )

    def test_fsdp_mesh_info_on_2d_mesh_raises_naming_sub_mesh(self):
        """Tests that ``FSDPMeshInfo`` on one dim of a 2D mesh, which would put
        the params on the 2D mesh with one placement and fail at the optimizer
        step, raises at ``fully_shard`` naming the sub-mesh to pass instead."""
        world_mesh = init_device_mesh(
            device_type.type, (2, 2), mesh_dim_names=("efsdp", "ep")
        )
        dp_mesh = init_device_mesh(device_type.type, (self.world_size,))
        mesh_info_2d = FSDPMeshInfo(world_mesh, shard_mesh_dim=0)
        with self.assertRaisesRegex(
            ValueError, r"ShardPlacementResult\(placement, mesh=mesh\['efsdp'\]\)"
        ):
            fully_shard(
                _MoEBlock(8),
                mesh=dp_mesh,
                shard_placement_fn=lambda p: (
                    ShardPlacementResult(Shard(1), mesh_info_2d)
                    if _is_expert(p)
                    else None
                ),
            )

    def test_ep_dtensor_experts_sharded_on_efsdp_sub_mesh(self):
        """Tests that expert params that are already ``Shard(0)`` DTensors on the
        "ep" dim get FSDP's ``Shard(1)`` on the "efsdp" dim of the same mesh and
        that both collective modes train them to the same bits."""
        world_mesh = init_device_mesh(
            device_type.type, (2, 2), mesh_dim_names=("efsdp", "ep")
        )

        def check_model(model):
            self.assertEqual(model.experts.w.device_mesh, world_mesh)
            self.assertEqual(model.experts.w.placements, (Shard(1), Shard(0)))

        self._train_both_modes(
            world_mesh["efsdp", "ep"]._flatten("dp"),
            ShardPlacementResult(Shard(1), mesh=world_mesh["efsdp"]),
            check_model,
            ep_mesh=world_mesh["ep"],
        )


class _GroupAllocAllGather(AllGather):
    """Allocates from the process group it was made for, as
    ``ProcessGroupAllocAllGather`` does, and refuses to serve another."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.calls = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if group is not self.group:
            raise AssertionError(
                f"made for a group of size {self.group.size()}, called with one "
                f"of size {group.size()}"
            )
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group)


class TestFullyShardShardPlacementResultCustomComms(_MoEMeshTestCase):
    def test_custom_comm_factory_makes_a_comm_per_mesh_group(self):
        """Tests that ``set_custom_all_gather`` and ``set_custom_reduce_scatter``
        with a factory on a module with experts on another mesh make one comm
        per param group, for that group's process group, which serves only
        it, and that with ``DeterministicReduceScatter`` both collective modes
        give the same bits."""
        world_mesh = init_device_mesh(
            device_type.type, (2, 2), mesh_dim_names=("efsdp", "ep")
        )
        all_gathers: list[_GroupAllocAllGather] = []

        def make_all_gather(group: dist.ProcessGroup) -> _GroupAllocAllGather:
            all_gathers.append(_GroupAllocAllGather(group))
            return all_gathers[-1]

        def set_comms(model):
            model.set_custom_all_gather(make_all_gather)
            model.set_custom_reduce_scatter(lambda group: DeterministicReduceScatter())
            param_groups = model._get_fsdp_state()._fsdp_param_groups
            self.assertEqual(len(param_groups), 2)
            for param_group in param_groups:
                comm = param_group._all_gather_comm
                self.assertIs(comm.group, param_group._all_gather_process_group)
                self.assertIsInstance(
                    param_group._reduce_scatter_comm, DeterministicReduceScatter
                )

        self._train_both_modes(
            init_device_mesh(device_type.type, (self.world_size,)),
            ShardPlacementResult(Shard(1), mesh=world_mesh["efsdp"]),
            set_comms,
        )
        self.assertEqual(
            sorted(all_gather.group.size() for all_gather in all_gathers), [2, 2, 4, 4]
        )
        self.assertTrue(all(all_gather.calls for all_gather in all_gathers))

    def test_shared_comm_on_several_mesh_groups_raises(self):
        """Tests that one comm for a module with a param group per mesh raises,
        naming the factory form, since a comm that allocates from one process
        group would serve the other's collectives; and that a factory that
        makes no comm raises a ``TypeError``."""
        world_mesh = init_device_mesh(
            device_type.type, (2, 2), mesh_dim_names=("efsdp", "ep")
        )
        model = fully_shard(
            _MoEBlock(8),
            mesh=init_device_mesh(device_type.type, (self.world_size,)),
            shard_placement_fn=lambda p: (
                ShardPlacementResult(Shard(1), mesh=world_mesh["efsdp"])
                if _is_expert(p)
                else None
            ),
        )
        group = model._get_fsdp_state()._fsdp_param_groups[0]._all_gather_process_group
        with self.assertRaisesRegex(ValueError, "pass a factory"):
            model.set_custom_all_gather(_GroupAllocAllGather(group))
        with self.assertRaisesRegex(ValueError, "pass a factory"):
            model.set_custom_reduce_scatter(DeterministicReduceScatter())
        with self.assertRaisesRegex(TypeError, "which is not a AllGather"):
            model.set_custom_all_gather(lambda group: None)


class TestFullyShardShardPlacementResultValidation(_MoEMeshTestCase):
    def _shard(self, shard_placement_fn) -> None:
        model = _MoEBlock(8)
        model.dense = nn.Linear(6, 6)
        model.experts = _Experts(4, 6)
        fully_shard(model, shard_placement_fn=shard_placement_fn)

    def test_shard_placement_result_arguments(self):
        """Tests that ``ShardPlacementResult`` takes exactly one of ``mesh`` and
        ``mesh_info`` and only 1D or named 2D meshes."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        with self.assertRaisesRegex(TypeError, "pass it as .*mesh="):
            ShardPlacementResult(Shard(0), mesh)
        with self.assertRaisesRegex(ValueError, "exactly one of mesh and mesh_info"):
            ShardPlacementResult(Shard(0))
        with self.assertRaisesRegex(ValueError, "exactly one of mesh and mesh_info"):
            ShardPlacementResult(
                Shard(0), FSDPMeshInfo(mesh, shard_mesh_dim=0), mesh=mesh
            )
        mesh_3d = init_device_mesh(
            device_type.type, (1, 2, 2), mesh_dim_names=("a", "b", "c")
        )
        with self.assertRaisesRegex(ValueError, "1D mesh .* or a 2D mesh"):
            ShardPlacementResult(Shard(0), mesh=mesh_3d)
        with self.assertRaisesRegex(
            TypeError, "mesh to be a DeviceMesh but got 'cpu' of type str"
        ):
            ShardPlacementResult(Shard(0), mesh="cpu")

    def test_rejects_mesh_without_this_rank(self):
        """Tests that a per-parameter mesh that leaves out this rank fails on
        that rank with an error naming the rank, instead of an ``IndexError``."""
        half_mesh = DeviceMesh(device_type.type, [0, 1])
        if self.rank < 2:
            ShardPlacementResult(Shard(0), mesh=half_mesh)
        else:
            with self.assertRaisesRegex(
                ValueError, f"mesh without this rank \\({self.rank}\\)"
            ):
                ShardPlacementResult(Shard(0), mesh=half_mesh)

    def test_rejects_mesh_of_other_device_type(self):
        """Tests that a per-param mesh on another device type fails at
        ``fully_shard`` time."""
        pg = dist.new_group(list(range(self.world_size)))
        meta_mesh = DeviceMesh.from_group(pg, "meta")
        with self.assertRaisesRegex(
            ValueError, f"returned a meta mesh .* manages {device_type.type}"
        ):
            self._shard(lambda p: ShardPlacementResult(Shard(0), mesh=meta_mesh))

    def test_rejects_placement_dim_out_of_range(self):
        """Tests that a shard dim the parameter does not have fails naming the
        parameter, for positive and negative dims, with the error type and
        message start of upstream's check."""
        for placement in (Shard(3), Shard(-4)):
            with self.assertRaisesRegex(
                AssertionError,
                f"Shard dim {placement.dim} is invalid for 3D tensor: .* for parameter 'w'",
            ):
                self._shard(lambda p, s=placement: s if _is_expert(p) else None)

    def test_rejects_uneven_shard_on_nonzero_dim(self):
        """Tests that ``Shard(1)`` of a dim not divisible by the mesh size fails
        and names the parameter and the fix."""
        with self.assertRaisesRegex(
            NotImplementedError, "'weight'; shard it on a dim divisible by 4"
        ):
            self._shard(lambda p: Shard(1) if p.ndim == 2 else None)

    def test_rejects_disagreeing_mesh_infos_on_one_mesh(self):
        """Tests that two mesh infos on the same mesh that are not equal (here:
        one names SPMD mesh dims) fail instead of silently picking one."""
        mesh = init_device_mesh(
            device_type.type, (self.world_size,), mesh_dim_names=("dp",)
        )
        plain = FSDPMeshInfo(mesh, shard_mesh_dim=0)
        spmd = FSDPMeshInfo(
            mesh,
            shard_mesh_dim=0,
            dp_mesh_dims=DataParallelMeshDims(shard="dp"),
            spmd_mesh=mesh,
        )
        with self.assertRaisesRegex(ValueError, "same mesh must use equal mesh info"):
            self._shard(
                lambda p: ShardPlacementResult(
                    Shard(0), spmd if _is_expert(p) else plain
                )
            )


if __name__ == "__main__":
    run_tests()
