"""``group_collectives=False`` against ``group_collectives=True``: bitwise-equal
losses, sharded gradients and sharded parameters at every step, multi-process.

At world size 2 a sum of two values does not depend on how tensors are packed,
so the default comms give identical bits (DESIGN.md, "Numerics").
"""

from common_fsdp_ext import EXT, FSDPExtTestMultiProcess, ParityMixin
from torch.testing._internal.common_utils import run_tests

PER_PARAM = (EXT, {"group_collectives": False})
GROUPED = (EXT, {"group_collectives": True})


class TestFullyShardPerParamParity(ParityMixin, FSDPExtTestMultiProcess):
    def test_per_param_matches_grouped(self):
        """Tests that per-parameter collectives give the same bits as grouped
        ones in every configuration of ``base_parity_configs``."""
        self.run_subtests(
            {"config": list(self.base_parity_configs())}, self._test_per_param_matches_grouped
        )

    def _test_per_param_matches_grouped(self, config: str):
        self.check_parity(self.base_parity_configs()[config](), PER_PARAM, GROUPED)


if __name__ == "__main__":
    run_tests()
