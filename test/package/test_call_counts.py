"""Grouped mode runs torch's own FSDP2 lines, Python calls and builtin calls.

Single process over the fake process group at world size 2, on CPU: a
4-block :class:`Model` from seed 42, ``fully_shard`` on each block then the
root, SGD; two warm-up steps (lazy init), then one steady step is counted
with ``sys.settrace`` and ``sys.setprofile`` (``fsdp_ext_testing.call_counts``):
the lines run, the Python calls and the builtin calls made in FSDP's
``_fully_shard`` files, each keyed by file and function (lines by their text
too, so that a line a patch moves still matches). The per-key table for one
configuration: ``python tools/probes/count_fsdp_calls.py``.

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
    count_steady_step,
    implementations,
    init_fake_process_group,
)

# Differing keys shown in a failure message; the probe lists them all
MAX_DIFFERENCES_SHOWN = 30


class TestFullyShardCallCounts(TestCase):
    def setUp(self) -> None:
        super().setUp()
        init_fake_process_group()

    def tearDown(self) -> None:
        dist.destroy_process_group()
        super().tearDown()

    @parametrize("config", list(CONFIGS), name_fn=lambda config: config.replace("-", "_"))
    def test_steady_step_matches_torch(self, config: str):
        """Tests that in one steady training step grouped mode (the package's
        ``fully_shard`` with no extra kwargs) runs every line of its
        ``_fully_shard`` files, calls every function there (generator
        expressions and lambdas included) and makes every builtin call from
        them exactly as often as torch's own FSDP2 does in the function of the
        same file and qualified name, and nothing else. Prints each mode's
        totals, per-parameter mode's too where the package has it (for
        information: it runs other code by design)."""
        counts = {
            name: count_steady_step(impl, CONFIGS[config])
            for name, impl in implementations().items()
        }
        print(
            f"{config}: per steady step in _fully_shard (lines/calls/builtins): "
            + ", ".join(
                f"{name} {'/'.join(map(str, step.totals().values()))}"
                for name, step in counts.items()
            )
        )
        reference, ours = counts["torch"], counts["grouped"]
        differences = count_differences(reference, ours)
        shown = differences[:MAX_DIFFERENCES_SHOWN]
        if len(differences) > len(shown):
            shown.append(
                f"... {len(differences) - len(shown)} more: "
                f"python tools/probes/count_fsdp_calls.py --config {config} --differing"
            )
        totals = ", ".join(
            f"{name} {reference.totals()[name]} -> {ours.totals()[name]}"
            for name in reference.totals()
        )
        # Both with every key counted by either, absent ones at 0: on
        # mappings whose keys differ, TestCase.assertEqual drops ``msg``
        expected, actual = reference.flat(), ours.flat()
        keys = expected.keys() | actual.keys()
        self.assertEqual(
            {key: actual[key] for key in keys},
            {key: expected[key] for key in keys},
            msg=f"{config}: {len(differences)} keys differ between torch's FSDP2 and grouped "
            f"mode (totals torch -> grouped: {totals}):\n" + "\n".join(shown),
        )


instantiate_parametrized_tests(TestFullyShardCallCounts)


if __name__ == "__main__":
    run_tests()
