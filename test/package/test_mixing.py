"""``torch_fsdp_ext.fully_shard`` and ``torch.distributed.fsdp.fully_shard`` in
one process: separate models work, one model sharded by both fails at once.

Run: ``python -m pytest test/package/test_mixing.py``.
"""

import torch
import torch.nn as nn
from common_fsdp_ext import EXT, UPSTREAM, FakeProcessGroupTestCase
from torch.testing._internal.common_utils import run_tests

_NAMES = {
    UPSTREAM.name: "torch.distributed.fsdp.fully_shard",
    EXT.name: "torch_fsdp_ext.fully_shard",
}


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


class TestFullyShardMixingImplementations(FakeProcessGroupTestCase):
    world_size = 2

    def test_one_model_sharded_by_both_fails_naming_both(self):
        """Tests that either ``fully_shard`` refuses a model of which the other
        already shards a submodule, in either order, naming both packages and
        the submodule, instead of failing later ("Cannot concatenate
        overlapping meshes", or an invariant error at the first forward)."""
        for child_impl, parent_impl in ((UPSTREAM, EXT), (EXT, UPSTREAM)):
            with self.subTest(child=child_impl.name, parent=parent_impl.name):
                model = _model()
                child_impl.fully_shard(model[1])
                with self.assertRaisesRegex(
                    ValueError,
                    f"{_NAMES[parent_impl.name]} cannot shard a model in which "
                    f"{_NAMES[child_impl.name]} already shards '1'",
                ):
                    parent_impl.fully_shard(model)

    def test_separate_models_each_sharded_by_one(self):
        """Tests that two models, one per implementation, each shard and run
        forward and backward in the same process."""
        for impl in (UPSTREAM, EXT):
            model = _model()
            impl.fully_shard(model[0])
            impl.fully_shard(model)
            model(torch.randn(2, 4)).sum().backward()
            self.assertIsInstance(model, impl.FSDPModule)


if __name__ == "__main__":
    run_tests()
