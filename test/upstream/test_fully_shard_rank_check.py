# Owner(s): ["oncall: distributed"]

import contextlib
import datetime
import gc
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch_fsdp_ext import fully_shard, MixedPrecisionPolicy
from torch_fsdp_ext._fully_shard._fsdp_common import ShardPlacementResult
from torch.distributed.tensor import Shard
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch_fsdp_ext import DeterministicReduceScatter
from torch.testing._internal.common_fsdp import (
    FSDPTestMultiThread,
    get_devtype,
)
from torch.testing._internal.common_utils import run_tests

device_type = torch.device(get_devtype())


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def _shard(model: nn.Sequential, check: bool | None = True, **kwargs) -> nn.Sequential:
    fully_shard(model[0], **kwargs)
    fully_shard(model, **kwargs)
    if check is not None:
        model.set_rank_consistency_check(check)
    return model


# The rank threads of ``FSDPTestMultiThread`` share the process: rank 0 alone
# changes ``dist``'s debug level and functions for every rank and restores
# them, with barriers, so that no rank runs before the change or restores it
# while another still runs
_shared: dict[str, object] = {}


@contextlib.contextmanager
def _debug_level(level: dist.DebugLevel, rank: int) -> Iterator[None]:
    if rank == 0:
        _shared["debug_level"] = dist.get_debug_level()
        dist.set_debug_level(level)
    dist.barrier()
    try:
        yield
        dist.barrier()
    finally:
        if rank == 0:
            dist.set_debug_level(_shared.pop("debug_level"))


@contextlib.contextmanager
def _recording_all_gather_object(rank: int) -> Iterator[list]:
    """Records what this rank passes to ``all_gather_object``."""
    if rank == 0:
        calls: dict[int, list] = {r: [] for r in range(dist.get_world_size())}
        all_gather_object = dist.all_gather_object

        def recording(output, obj, group=None):
            calls[dist.get_rank()].append(obj)
            return all_gather_object(output, obj, group=group)

        _shared["calls"] = calls
        _shared["all_gather_object"] = all_gather_object
        dist.all_gather_object = recording
    dist.barrier()
    own_calls = _shared["calls"][rank]
    try:
        yield own_calls
        dist.barrier()
    finally:
        if rank == 0:
            dist.all_gather_object = _shared.pop("all_gather_object")


class TestFullyShardRankCheck(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _per_rank_cases(self) -> dict[str, tuple[str, Callable[[int], dict]]]:
        """Misuse by name: the field the error must name, and the ``fully_shard``
        kwargs of each rank."""
        # A second mesh over the same ranks: a group of its own
        other_mesh = init_device_mesh(
            device_type.type, (self.world_size,), mesh_dim_names=("ep",)
        )
        return {
            "mode": ("group_collectives", lambda r: {"group_collectives": r == 0}),
            # Same shard size (8x8 on 2 ranks): would train on wrong data
            "placement": (
                "placement",
                lambda r: {"shard_placement_fn": lambda p: Shard(r % p.ndim)},
            ),
            "reshard_after_forward": (
                "reshard_after_forward",
                lambda r: {"reshard_after_forward": r == 0},
            ),
            "param_dtype": (
                "param_dtype",
                lambda r: {
                    "mp_policy": MixedPrecisionPolicy(
                        param_dtype=torch.bfloat16 if r == 0 else None
                    )
                },
            ),
            "second_mesh": (
                "parameters",
                lambda r: {
                    "shard_placement_fn": lambda p: (
                        ShardPlacementResult(Shard(0), mesh=other_mesh)
                        if r == 0 and p.ndim == 1
                        else None
                    )
                },
            ),
        }

    def test_mismatch_raises_on_every_rank(self):
        """Tests that ranks sharding a module differently each raise one
        ``ValueError`` at lazy init naming the module, the field and both
        ranks, before any FSDP collective, for each field that drives the
        collectives."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        self.run_subtests(
            {"case": list(self._per_rank_cases())},
            self._test_mismatch_raises_on_every_rank,
            mesh=mesh,
        )

    def _test_mismatch_raises_on_every_rank(self, case: str, mesh):
        field, kwargs_of = self._per_rank_cases()[case]
        model = _shard(_model(), mesh=mesh, **kwargs_of(self.rank))
        with self.assertRaisesRegex(
            ValueError,
            f"module '.*' on the mesh of ranks \\[0, 1\\]: .*{field}.* on rank "
            "\\d but .* on rank \\d",
        ):
            model(torch.randn(2, 8, device=device_type))

    def test_shape_mismatch_names_sharded_shape(self):
        """Tests that a parameter of another size on one rank is named with
        both sharded shapes."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        torch.manual_seed(0)
        model = nn.Linear(8, 8 if self.rank == 0 else 6)
        fully_shard(model, mesh=mesh)
        model.set_rank_consistency_check(True)
        with self.assertRaisesRegex(
            ValueError,
            "parameter 'weight' padded sharded shape is \\(4, 8\\) on rank 0 but \\(3, 8\\) on rank 1",
        ):
            model(torch.randn(2, 8, device=device_type))

    def test_custom_comm_on_one_rank_raises(self):
        """Tests that a custom reduce-scatter set on one rank only is named."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        model = _shard(_model(), mesh=mesh)
        if self.rank == 0:
            model.set_custom_reduce_scatter(DeterministicReduceScatter())
        with self.assertRaisesRegex(
            ValueError, "reduce-scatter comm is 'DeterministicReduceScatter' on rank 0"
        ):
            model(torch.randn(2, 8, device=device_type))

    def test_consistent_ranks_check_once(self):
        """Tests that agreeing ranks train, that the check exchanges one
        16-byte digest per mesh with one ``all_gather_object`` at lazy init and
        nothing in later steps, that each change made on every rank
        (``set_group_collectives``, ``set_reshard_after_forward``) is
        re-checked once, at the next forward, and that a setting toggled back
        within a step is not re-checked."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        model = _shard(_model(), mesh=mesh)
        with _recording_all_gather_object(self.rank) as calls:
            for _ in range(3):
                model(torch.randn(2, 8, device=device_type)).sum().backward()
        self.assertEqual(len(calls), 1)
        _, digests = calls[0]
        self.assertEqual([len(d) for d in digests.values()], [16])
        rank_check = model._get_fsdp_state()._state_ctx.rank_check
        self.assertEqual(rank_check.round, 0)
        model.set_group_collectives(False)
        model.set_group_collectives(False)
        model(torch.randn(2, 8, device=device_type)).sum().backward()
        self.assertEqual(rank_check.round, 1)
        # No change, no re-check
        model.set_group_collectives(False)
        model(torch.randn(2, 8, device=device_type)).sum().backward()
        self.assertEqual(rank_check.round, 1)
        # Toggled and back before the next forward (torchtitan's chunked loss)
        model[0].set_reshard_after_forward(False)
        model[0].set_reshard_after_forward(True)
        model(torch.randn(2, 8, device=device_type)).sum().backward()
        self.assertEqual(rank_check.round, 1)
        # The child stops resharding after forward: its backward all-gather goes
        model.set_reshard_after_forward(False)
        model(torch.randn(2, 8, device=device_type)).sum().backward()
        self.assertEqual(rank_check.round, 2)

    def test_off_unless_set(self):
        """Tests that the check issues nothing unless set, so that FSDP's
        collectives are exactly upstream's, also with
        ``TORCH_DISTRIBUTED_DEBUG`` at ``INFO`` or ``DETAIL``, and exchanges its
        digest once at lazy init when set."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        self.run_subtests(
            {
                "check_level_calls": [
                    (None, dist.DebugLevel.OFF, 0),
                    (None, dist.DebugLevel.INFO, 0),
                    (None, dist.DebugLevel.DETAIL, 0),
                    (True, dist.DebugLevel.OFF, 1),
                ]
            },
            self._test_off_unless_set,
            mesh=mesh,
        )

    def _test_off_unless_set(self, check_level_calls, mesh):
        check, level, expected_calls = check_level_calls
        model = _shard(_model(), check=check, mesh=mesh)
        with (
            _debug_level(level, self.rank),
            _recording_all_gather_object(self.rank) as calls,
        ):
            model(torch.randn(2, 8, device=device_type)).sum().backward()
        self.assertEqual(len(calls), expected_calls)

    def test_frozen_parameter_on_one_rank_raises(self):
        """Tests that a parameter frozen on one rank only, which would skip its
        reduce-scatter there, is named with ``requires_grad``."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        model = _model()
        if self.rank == 1:
            model[0].weight.requires_grad_(False)
        _shard(model, mesh=mesh)
        with self.assertRaisesRegex(
            ValueError,
            "parameter '0.weight' requires_grad is True on rank 0 but False on rank 1",
        ):
            model(torch.randn(2, 8, device=device_type))

    def test_enable_after_first_forward_raises(self):
        """Tests that turning the check on after lazy init, when ranks could no
        longer agree on when to exchange, raises."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        model = _shard(_model(), check=None, mesh=mesh)
        model(torch.randn(2, 8, device=device_type)).sum().backward()
        with self.assertRaisesRegex(RuntimeError, "before the first forward"):
            model.set_rank_consistency_check(True)

    def test_check_can_be_disabled(self):
        """Tests that ``set_rank_consistency_check(False)`` on the root after
        ``True`` skips the check: a placement mismatch of equal shard sizes
        then trains."""
        mesh = init_device_mesh(device_type.type, (self.world_size,))
        model = _shard(
            _model(),
            mesh=mesh,
            shard_placement_fn=lambda p: Shard(self.rank % p.ndim),
        )
        model.set_rank_consistency_check(False)
        model(torch.randn(2, 8, device=device_type)).sum().backward()


class TestFullyShardRankCheckChangeOnOneRank(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _init_process_group(self, timeout: datetime.timedelta) -> dist.Store:
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group(
            "gloo",
            rank=self.rank,
            world_size=self.world_size,
            store=store,
            timeout=timeout,
        )
        return store

    def test_two_roots_toggling_each_step(self):
        """Tests that two roots built one after another in one process, one
        grouped and one per-parameter, each toggling
        ``set_reshard_after_forward`` between steps (a real change each step),
        train with the check on and off: each root's re-checks read only its
        own keys, and none is left in the store."""
        store = self._init_process_group(datetime.timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (self.world_size,))
        keys_before = store.num_keys()
        for check in (True, False):
            roots = [
                _shard(
                    _model(),
                    check=check,
                    mesh=mesh,
                    group_collectives=group_collectives,
                )
                for group_collectives in (True, False)
            ]
            for step in range(4):
                for root in roots:
                    root.set_reshard_after_forward(step % 2 == 0)
                    root(torch.randn(2, 8)).sum().backward()
            for root in roots:
                self.assertEqual(
                    root._get_fsdp_state()._state_ctx.rank_check.round,
                    3 if check else 0,
                )
        # Every rank has read (and the last deleted) every key
        dist.barrier()
        self.assertEqual(store.num_keys(), keys_before)
        dist.destroy_process_group()

    def test_catches_a_mismatch_debug_detail_lets_through(self):
        """Tests a mismatch that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` lets
        through: rank 0 shards a square weight on dim 0 and rank 1 on dim 1,
        so every collective has the same sizes and dtypes on both ranks. Under
        DETAIL alone a step runs and each rank all-gathers a weight that is not
        the one it sharded; with the check on, lazy init raises on every rank,
        naming the placement."""
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        self._init_process_group(datetime.timedelta(seconds=60))
        # DETAIL wraps the c10d backend to compare each collective across ranks
        self.assertIsInstance(
            dist.group.WORLD._get_backend(torch.device("cpu")),
            dist.distributed_c10d._ProcessGroupWrapper,
        )
        mesh = init_device_mesh("cpu", (self.world_size,))
        for check in (False, True):
            torch.manual_seed(0)
            linear = nn.Linear(8, 8, bias=False)
            weight = linear.weight.detach().clone()
            fully_shard(
                linear, mesh=mesh, shard_placement_fn=lambda _: Shard(self.rank)
            )
            linear.set_rank_consistency_check(check)
            if check:
                with self.assertRaisesRegex(ValueError, "placement"):
                    linear(torch.randn(2, 8))
                continue
            out = linear(torch.randn(2, 8))
            # The root keeps its parameters unsharded after forward
            self.assertFalse(torch.equal(linear.weight.detach(), weight))
            out.sum().backward()
        # Drop the last references to DETAIL's wrapped process groups, so that
        # their worker threads are joined before the interpreter exits
        del linear, out, mesh
        gc.collect()
        dist.destroy_process_group()

    def test_different_changes_on_each_rank_raise(self):
        """Tests that a change after lazy init that leaves the ranks issuing
        different collectives (``set_group_collectives`` on one rank,
        ``set_reshard_after_forward`` on the other) raises a ``ValueError`` on
        every rank at the next forward, from the re-check through the store,
        before any FSDP collective of that forward."""
        self._init_process_group(datetime.timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = _shard(_model(), mesh=mesh)
        model(torch.randn(2, 8)).sum().backward()
        if self.rank == 0:
            model.set_group_collectives(False)
        else:
            model[0].set_reshard_after_forward(False, recurse=False)
        with self.assertRaisesRegex(
            ValueError, "FSDP ranks would issue different collectives"
        ):
            model(torch.randn(2, 8))
        dist.destroy_process_group()


if __name__ == "__main__":
    run_tests()
