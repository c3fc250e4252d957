"""MoE with expert parallelism and per-parameter meshes: the three wrappings of
``test/fsdp_ext_testing/moe.py`` train bitwise alike, their collectives come in the
expected order, and DCP round-trips them.

- ``old``: ``fully_shard(block.moe.experts, mesh=efsdp)`` + ``fully_shard(block, mesh=dp)``;
- ``grouped``: one ``fully_shard(block, mesh=dp)`` with expert params on the
  efsdp mesh (``ShardPlacementResult(Shard(1), mesh=efsdp)``);
- ``per-param``: ``grouped`` with ``group_collectives=False``.

Routed experts are DTensors ``Shard(0)`` on the "ep" dim of an ("efsdp", "ep")
world mesh. All multi-process gloo: parity at W=2 with default comms and at
W=4 with ``DeterministicReduceScatter`` (gloo's W=4 sums depend on message
size); at W=4 also an unsharded reference, collective traces and DCP.
"""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from common_fsdp_ext import (
    DEVICE_TYPE,
    PER_PARAM_MESHES_OMITTED,
    FSDPExtTestMultiProcess,
    assert_bitwise_equal,
    assert_model_matches_reference,
    assert_models_bitwise_equal,
    registered_fsdp_backend,
    train_in_lockstep,
)
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.common_utils import run_tests

from fsdp_ext_testing import moe
from fsdp_ext_testing.coalescing import COALESCED

ARGS = moe.MoEArgs()

# Every test compares wrappings that put the experts on the efsdp mesh with
# ``ShardPlacementResult(mesh=...)``
pytestmark = pytest.mark.skipif(
    PER_PARAM_MESHES_OMITTED is not None, reason=PER_PARAM_MESHES_OMITTED or ""
)


class MoEMixin:
    def make_tokens(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(42 + self.rank + 1000 * step)
        return torch.randint(ARGS.vocab, (2, 9), generator=gen).to(DEVICE_TYPE)

    def build(self, mode: str | None, meshes: moe.MoEMeshes, deterministic: bool, **kwargs):
        model = moe.build_model(ARGS, mode, meshes, **kwargs)
        if deterministic:
            moe.set_deterministic_reduce_scatter(model)
        return model

    def check_parity(
        self, efsdp: int, ep: int, mode: str, deterministic: bool, ref_mode: str = "old"
    ) -> None:
        """Trains ``mode`` against ``ref_mode`` in lockstep: loss, every sharded
        gradient and every sharded parameter bitwise equal at every step."""
        meshes = moe.build_meshes(DEVICE_TYPE, efsdp, ep)
        ref = self.build(ref_mode, meshes, deterministic)
        model = self.build(mode, meshes, deterministic)
        self.check_expert_layout(model, meshes)
        train_in_lockstep(self, model, ref, self.make_tokens, num_steps=3)

    def check_expert_layout(self, model: torch.nn.Module, meshes: moe.MoEMeshes) -> None:
        efsdp, ep = meshes.efsdp.size(), meshes.ep.size()
        for layer in model.layers:
            for name, param in layer.moe.experts.named_parameters():
                # Shard(1) on efsdp (FSDP), Shard(0) on ep (expert parallel)
                self.assertIsInstance(param, DTensor, msg=name)
                self.assertEqual(param.device_mesh.mesh_dim_names, ("efsdp", "ep"))
                self.assertEqual(param.placements, (Shard(1), Shard(0)))
                full = {"w2": (ARGS.num_experts, ARGS.expert_hidden, ARGS.dim)}.get(
                    name, (ARGS.num_experts, ARGS.dim, ARGS.expert_hidden)
                )
                self.assertEqual(tuple(param.shape), full)
                local = (full[0] // ep, full[1] // efsdp, full[2])
                self.assertEqual(tuple(param.to_local().shape), local)
            # Dense params stay on the flattened dp mesh
            self.assertEqual(layer.attn.qkv.weight.device_mesh.mesh_dim_names, ("dp",))

    def check_unsharded_reference(self, mode: str, efsdp: int, ep: int) -> None:
        """Trains ``mode`` and one unsharded model fed every rank's tokens with
        SGD; every gradient and parameter within the rounding bound of
        reordering the largest sum (all ranks' tokens times the model dim).

        SGD, not Adam: Adam's first step moves every element by about ``lr``
        whatever the gradient's size, so rounding-level gradient differences
        would become parameter differences of any size."""
        meshes = moe.build_meshes(DEVICE_TYPE, efsdp, ep)
        model = self.build(mode, meshes, deterministic=False)
        torch.manual_seed(42)
        ref = moe.MoETransformer(ARGS).to(DEVICE_TYPE)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
        reduction_size = self.world_size * self.make_tokens(0).numel() * ARGS.dim
        for step in range(2):
            tokens = []
            for rank in range(self.world_size):
                gen = torch.Generator().manual_seed(42 + rank + 1000 * step)
                tokens.append(torch.randint(ARGS.vocab, (2, 9), generator=gen).to(DEVICE_TYPE))
            moe.loss_fn(model, tokens[self.rank]).backward()
            (sum(moe.loss_fn(ref, t) for t in tokens) / self.world_size).backward()
            assert_model_matches_reference(
                self, model, ref, grads=True, reduction_size=reduction_size, what=f"step {step}"
            )
            for o in (optim, ref_optim):
                o.step()
                o.zero_grad()
            assert_model_matches_reference(
                self, model, ref, grads=False, reduction_size=reduction_size, what=f"step {step}"
            )


@pytest.mark.slow
class TestFullyShardMoEParity(MoEMixin, FSDPExtTestMultiProcess):
    def test_moe_matches_old_wrapping(self):
        """Tests that one ``fully_shard`` per block with expert params on the
        efsdp mesh, grouped and per-parameter, trains bitwise like the old
        separate ``fully_shard(experts)`` at world size 2 with default comms
        on an (efsdp=1, ep=2) mesh."""
        self.run_subtests(
            {"mode": ["grouped", "per-param"]},
            self.check_parity,
            efsdp=1,
            ep=2,
            deterministic=False,
        )

    @pytest.mark.reference
    def test_moe_matches_unsharded_reference_on_1_rank_efsdp(self):
        """Tests, within float tolerance, that with experts on a 1-rank efsdp
        mesh (efsdp=1, ep=2) every wrapping trains like the unsharded model:
        FSDP skips the reduce-scatter there and must divide expert gradients
        by the divide factor once (the series' 1-rank divide patch; upstream
        divided twice)."""
        self.run_subtests({"mode": list(moe.MODES)}, self.check_unsharded_reference, efsdp=1, ep=2)

    def test_moe_per_param_matches_grouped_without_ep(self):
        """Tests that with ep=1, where the efsdp and dp meshes are two meshes
        over one process group, per-parameter collectives train bitwise like
        grouped ones.

        Not against the old wrapping here: its separate experts module puts
        FSDP's post-backward autograd node on the experts' inputs, so autograd
        sums the MoE input's three gradients (router, experts, shared expert)
        in another order and the last bits differ. With ep>1 the token
        all-gather's node sits there in every wrapping."""
        self.check_parity(2, 1, "per-param", deterministic=False, ref_mode="grouped")


@pytest.mark.slow
class TestFullyShardMoEParityW4(MoEMixin, FSDPExtTestMultiProcess):
    @property
    def world_size(self) -> int:
        return 4

    def test_moe_matches_old_wrapping_deterministic(self):
        """Tests that on a 2x2 (efsdp, ep) mesh with ``DeterministicReduceScatter``
        everywhere, grouped and per-parameter per-mesh wrapping train bitwise
        like the old wrapping."""
        self.run_subtests(
            {"mode": ["grouped", "per-param"]},
            self.check_parity,
            efsdp=2,
            ep=2,
            deterministic=True,
        )

    @pytest.mark.reference
    def test_moe_matches_unsharded_reference(self):
        """Tests, as a sanity check within float tolerance, that the EP model
        on a 2x2 (efsdp, ep) mesh, sharded each way, trains like one unsharded
        model fed every rank's tokens: the token all-gather / reduce-scatter
        routes correctly, and the dp-size gradient divide factor scales expert
        gradients like dense ones."""
        self.run_subtests({"mode": list(moe.MODES)}, self.check_unsharded_reference, efsdp=2, ep=2)

    def test_dcp_round_trip(self):
        """Tests that saving model and AdamW state with DCP, loading it into a
        freshly built model (another seed) and training on stays bitwise equal
        to an uninterrupted run."""
        self.run_subtests({"mode": ["grouped", "per-param"]}, self._test_dcp_round_trip)

    def _test_dcp_round_trip(self, mode: str):
        meshes = moe.build_meshes(DEVICE_TYPE, 2, 2)
        model = self.build(mode, meshes, deterministic=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

        def train_step(m, o, step):
            loss = moe.loss_fn(m, self.make_tokens(step))
            loss.backward()
            o.step()
            o.zero_grad()
            return loss.detach()

        for step in range(2):
            train_step(model, optim, step)
        # Every rank uses the same directory: the store file's path is shared
        ckpt = f"{self.file_name}.{mode}.ckpt"
        dcp.save(
            {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optim),
            },
            checkpoint_id=ckpt,
        )

        resumed = self.build(mode, meshes, deterministic=True, seed=7)
        resumed_optim = torch.optim.AdamW(resumed.parameters(), lr=1e-2, foreach=True)
        state = {
            "model": get_model_state_dict(resumed),
            "optim": get_optimizer_state_dict(resumed, resumed_optim),
        }
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(resumed, state["model"])
        set_optimizer_state_dict(resumed, resumed_optim, state["optim"])
        assert_models_bitwise_equal(self, resumed, model, "after load", grads=False)
        for p, ref_p in zip(resumed.parameters(), model.parameters(), strict=True):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert_bitwise_equal(
                    self, resumed_optim.state[p][key], optim.state[ref_p][key], key
                )

        for step in range(2, 5):
            loss = train_step(resumed, resumed_optim, step)
            ref_loss = train_step(model, optim, step)
            assert_bitwise_equal(self, loss, ref_loss, f"step {step} loss")
            assert_models_bitwise_equal(self, resumed, model, f"step {step}", grads=False)


@pytest.mark.slow
class TestFullyShardMoEMemorySafety(MoEMixin, FSDPExtTestMultiProcess):
    """Regression test for heap corruption in the W=4 MoE tests:
    the EP token dispatch used asynchronous functional collectives, and on
    gloo an all-gather in flight while the caller keeps computing corrupts
    the heap now and then (``docs/upstream-gloo-funcol-heap-corruption.md``)."""

    ITERATIONS = 1500
    # The environment is read at spawn
    own_processes = True

    @property
    def world_size(self) -> int:
        return 4

    def setUp(self) -> None:
        # Spawned ranks inherit it: glibc fills freed memory with this byte, so
        # a write after free breaks the allocator's lists and aborts the rank
        os.environ.setdefault("MALLOC_PERTURB_", "165")
        super().setUp()

    def test_ep_dispatch_survives_heap_perturbation(self):
        """Tests that the MoE layer with its expert-parallel token dispatch
        (all-gather tokens, local experts, reduce-scatter back) runs 1500
        forward and backward passes at world size 4 with ``MALLOC_PERTURB_``
        set, every loss finite. With the functional-collective dispatch a
        rank died of heap corruption in most runs."""
        meshes = moe.build_meshes(DEVICE_TYPE, 2, 2)
        model = self.build(None, meshes, deterministic=False)
        layer = model.layers[0].moe
        gen = torch.Generator().manual_seed(42 + self.rank)
        for _ in range(self.ITERATIONS):
            x = torch.randn(2, 9, ARGS.dim, generator=gen).to(DEVICE_TYPE)
            loss = layer(x).square().mean()
            loss.backward()
            self.assertTrue(torch.isfinite(loss).item())
            layer.zero_grad(set_to_none=True)


@pytest.mark.slow
class TestFullyShardMoETrace(MoEMixin, FSDPExtTestMultiProcess):
    # Multi-process: the threaded process group bypasses the c10d ops that
    # FSDPCollectiveTrace records
    @property
    def world_size(self) -> int:
        return 4

    def _trace_step(self, mode: str) -> moe.FSDPCollectiveTrace:
        meshes = moe.build_meshes(DEVICE_TYPE, 2, 2)
        # Coalesced (NCCL's default, comms that coalesce on gloo): a mesh
        # group's per-parameter collectives read as one line of the trace
        with registered_fsdp_backend(DEVICE_TYPE, COALESCED):
            model = self.build(mode, meshes, deterministic=False)
        tokens = self.make_tokens(0)
        moe.loss_fn(model, tokens).backward()  # lazy init
        trace = moe.FSDPCollectiveTrace(meshes)
        with trace:
            moe.loss_fn(model, tokens).backward()
        return trace

    def test_collective_order(self):
        """Tests the FSDP collectives of one training step on a 2x2 (efsdp, ep) mesh:

        - grouped: one all-gather and one reduce-scatter per mesh group per
          block; backward all-gathers interleave blocks (both groups of block 1,
          then both of block 0) ahead of the reduce-scatters;
        - per-parameter: the same order, one collective per parameter,
          coalesced into one op per mesh group per block (NCCL coalesces by
          default, gloo here with ``COALESCED``);
        - old wrapping, for comparison: experts are a separate FSDP module, so
          block 0's experts all-gather waits until block 1's gradients are
          reduce-scattered.
        """
        traces = {mode: self._trace_step(mode) for mode in moe.MODES}
        if self.rank != 0:
            return
        self.assertExpectedInline(
            traces["grouped"].lines(),
            """\
forward all_gather root.dense 1032
forward all_gather block0.dense 1840
forward all_gather block0.experts 3072
forward all_gather block1.dense 1840
forward all_gather block1.experts 3072
backward all_gather block1.experts 3072
backward all_gather block1.dense 1840
backward all_gather block0.experts 3072
backward all_gather block0.dense 1840
backward reduce_scatter block1.experts 6144
backward reduce_scatter block1.dense 7360
backward reduce_scatter block0.experts 6144
backward reduce_scatter block0.dense 7360
backward reduce_scatter root.dense 4128""",
        )
        self.assertExpectedInline(
            traces["per-param"].lines(),
            """\
forward all_gather root.dense 512+8+512
forward all_gather block0.dense 8+768+256+8+32+256+256+256
forward all_gather block0.experts 1024+1024+1024
forward all_gather block1.dense 8+768+256+8+32+256+256+256
forward all_gather block1.experts 1024+1024+1024
backward all_gather block1.experts 1024+1024+1024
backward all_gather block1.dense 8+768+256+8+32+256+256+256
backward all_gather block0.experts 1024+1024+1024
backward all_gather block0.dense 8+768+256+8+32+256+256+256
backward reduce_scatter block1.experts 2048+2048+2048
backward reduce_scatter block1.dense 32+3072+1024+32+128+1024+1024+1024
backward reduce_scatter block0.experts 2048+2048+2048
backward reduce_scatter block0.dense 32+3072+1024+32+128+1024+1024+1024
backward reduce_scatter root.dense 2048+32+2048""",
        )
        self.assertExpectedInline(
            traces["old"].order("backward", ("all_gather", "reduce_scatter")),
            """AG block1.dense, AG block1.experts, AG block0.dense, RS block1.experts, RS block1.dense, AG block0.experts, RS block0.experts, RS block0.dense, RS root.dense""",
        )


if __name__ == "__main__":
    run_tests()
