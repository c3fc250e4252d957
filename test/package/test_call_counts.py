"""Grouped mode makes torch's own FSDP2 Python calls, function by function.

Single process over the fake process group at world size 2, on CPU: a
4-block :class:`Model` from seed 42, ``fully_shard`` on each block then the
root, SGD; two warm-up steps (lazy init), then one steady step is counted
with ``sys.setprofile`` (``fsdp_ext_testing.call_counts``). The per-function
table for one configuration: ``python tools/probes/count_fsdp_calls.py``.

Imports from the package only ``fully_shard`` and ``MixedPrecisionPolicy``
(through ``call_counts``), and not ``common_fsdp_ext``, so that it also runs
against the stand-in package of ``tools/patches.py stack``, at every position
of the series.
"""

import torch.distributed as dist
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from fsdp_ext_testing.call_counts import (
    CONFIGS,
    count_differences,
    count_steady_step_calls,
    implementations,
    init_fake_process_group,
)


class TestFullyShardCallCounts(TestCase):
    def setUp(self) -> None:
        super().setUp()
        init_fake_process_group()

    def tearDown(self) -> None:
        dist.destroy_process_group()
        super().tearDown()

    @parametrize("config", list(CONFIGS), name_fn=lambda config: config.replace("-", "_"))
    def test_steady_step_calls_match_torch(self, config: str):
        """Tests that in one steady training step grouped mode (the package's
        ``fully_shard`` with no extra kwargs) calls every function of its
        ``_fully_shard`` files (generator expressions and lambdas included)
        exactly as often as torch's own FSDP2 calls the function of the same
        file and qualified name, and no other function. Prints each mode's
        total, per-parameter mode's too where the package has it (for
        information: it makes other calls by design)."""
        counts = {
            name: count_steady_step_calls(impl, CONFIGS[config])
            for name, impl in implementations().items()
        }
        print(
            f"{config}: calls in _fully_shard per steady step: "
            + ", ".join(f"{name} {calls.total()}" for name, calls in counts.items())
        )
        reference, ours = counts["torch"], counts["grouped"]
        differences = count_differences(reference, ours)
        # Both with every function called by either, uncalled ones at 0: on
        # mappings whose keys differ, TestCase.assertEqual drops ``msg``
        functions = reference.keys() | ours.keys()
        self.assertEqual(
            {key: ours[key] for key in functions},
            {key: reference[key] for key in functions},
            msg=f"{len(differences)} functions called a different number of times in grouped "
            f"mode than in torch's FSDP2 (torch -> grouped; totals {reference.total()} -> "
            f"{ours.total()}):\n" + "\n".join(differences),
        )


instantiate_parametrized_tests(TestFullyShardCallCounts)


if __name__ == "__main__":
    run_tests()
