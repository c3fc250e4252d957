"""Smoke test of ``tools/bench --quick``, run as a new user runs it.

Checks what the bench writes and the counts that do not depend on timing;
it asserts nothing about step times (CONTRIBUTING.md: performance claims
belong in benchmarks, never in timed assertions).
"""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import pytest
import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext

REPO = Path(__file__).resolve().parents[2]
MODES = {"upstream", "grouped", "per-param", "per-param-nocoalesce", "deterministic"}
MODE_KEYS = {
    "step_time_s",
    "time_ratio_to_upstream",
    "time_ratio_to_grouped",
    "fsdp_time_s",
    "pg_time_s",
    "fsdp_ratio_to_grouped",
    "fwd_peak_bytes",
    "bwd_peak_bytes",
    "reduce_peak_bytes",
    "copy_bytes",
    "copy_ops",
    "backend_copy_bytes",
    "collectives",
}
PLOTS = ("time.png", "memory.png", "copies.png", "sweep.png")


@pytest.mark.slow
class TestBenchQuick(TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._tmp = tempfile.TemporaryDirectory()
        cls.out = Path(cls._tmp.name)
        cls.proc = subprocess.run(
            [
                sys.executable,
                "tools/bench",
                "--quick",
                "--out",
                str(cls.out),
                "--json",
                str(cls.out / "x.json"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()
        super().tearDownClass()

    def _report(self) -> dict:
        self.assertEqual(self.proc.returncode, 0, msg=self.proc.stderr[-4000:])
        return json.loads((self.out / "x.json").read_text())

    def test_writes_json_markdown_and_plots(self):
        """Tests that the quick mode exits 0 and writes the JSON at ``--json``,
        the markdown table (also printed) and the four PNG plots in ``--out``."""
        self._report()
        markdown = (self.out / "bench.md").read_text()
        self.assertIn("| llama-S | per-param |", markdown)
        self.assertIn("| llama-S | per-param |", self.proc.stdout)
        for plot in PLOTS:
            with self.subTest(plot=plot):
                self.assertEqual((self.out / plot).read_bytes()[:8], b"\x89PNG\r\n\x1a\n")

    def test_json_has_every_mode_and_metric(self):
        """Tests that the JSON holds a gloo and a fake run, each with every mode's
        metrics for every model, time ratios to upstream and grouped that match
        the reported medians, FSDP's own time within each step, the sweep on the
        fake process group, and the targets."""
        report = self._report()
        self.assertEqual(set(report), {"meta", "runs", "targets"})
        self.assertEqual({run["pg"] for run in report["runs"]}, {"gloo", "fake"})
        for run in report["runs"]:
            for entry in run["models"]:
                with self.subTest(pg=run["pg"], model=entry["model"]):
                    self.assertEqual(set(entry["modes"]), MODES)
                    for stats in entry["modes"].values():
                        self.assertLessEqual(MODE_KEYS, set(stats))
                        self.assertLessEqual(
                            {"median", "q1", "q3", "min", "max", "samples"},
                            set(stats["step_time_s"]),
                        )
                        self.assertLessEqual({"ops", "tensors", "bytes"}, set(stats["collectives"]))
                    # Each ratio is that mode's median step time over upstream's
                    # and grouped's, from the same samples the JSON reports
                    upstream = entry["modes"]["upstream"]["step_time_s"]["median"]
                    grouped = entry["modes"]["grouped"]["step_time_s"]["median"]
                    self.assertGreater(upstream, 0)
                    for stats in entry["modes"].values():
                        median = stats["step_time_s"]["median"]
                        self.assertLessEqual(stats["step_time_s"]["min"], median)
                        self.assertLessEqual(median, stats["step_time_s"]["max"])
                        self.assertAlmostEqual(stats["time_ratio_to_upstream"], median / upstream)
                        self.assertAlmostEqual(stats["time_ratio_to_grouped"], median / grouped)
                        # FSDP's own time is part of every step
                        fsdp = stats["fsdp_time_s"]["median"]
                        self.assertGreater(fsdp, 0)
                        self.assertLessEqual(fsdp, median)
                        self.assertAlmostEqual(
                            stats["fsdp_ratio_to_grouped"],
                            fsdp / entry["modes"]["grouped"]["fsdp_time_s"]["median"],
                        )
        fake = next(run for run in report["runs"] if run["pg"] == "fake")
        self.assertEqual([e["config"]["num_params"] for e in fake["sweep"]], [4, 64, 256])
        self.assertTrue(report["targets"])

    @unittest.skipUnless(
        hasattr(torch_fsdp_ext, "ShardPlacementResult"),
        f"torch {torch.__version__}'s series leaves out per-parameter meshes "
        "(patches/<version>/base.toml), which the MoE model needs; the bench skips it",
    )
    def test_moe_on_fake_process_group(self):
        """Tests that the fake run holds the MoE model with every mode and its peaks,
        that its per-parameter collectives carry the tensors of grouped's and more
        (experts and dense parameters each per tensor), coalesced or one op per
        tensor, and that its only target row is FSDP's own time."""
        report = self._report()
        fake = next(run for run in report["runs"] if run["pg"] == "fake")
        modes = next(e for e in fake["models"] if e["model"] == "moe")["modes"]
        self.assertEqual(set(modes), MODES)
        for stats in modes.values():
            self.assertLessEqual(MODE_KEYS, set(stats))
            self.assertGreater(stats["bwd_peak_bytes"], 0)
        coalesced = modes["per-param"]["collectives"]
        uncoalesced = modes["per-param-nocoalesce"]["collectives"]
        grouped = modes["grouped"]["collectives"]
        self.assertEqual(coalesced["ops"], grouped["ops"])
        self.assertGreater(coalesced["tensors"], grouped["tensors"])
        self.assertEqual(uncoalesced["ops"], uncoalesced["tensors"])
        self.assertEqual(coalesced["tensors"], uncoalesced["tensors"])
        self.assertEqual(
            [t["target"] for t in report["targets"] if t["model"] == "moe"],
            ["per-param / grouped FSDP time <= 1.0"],
        )

    def test_per_param_copies_nothing_for_even_fp32_transformer(self):
        """Tests that per-parameter collectives write no FSDP-side copy bytes
        for the transformer, whose fp32 parameters all divide evenly on dim 0,
        while grouped collectives copy in and out; and that the coalescing
        knob works: coalesced per-parameter collectives go out as many ops as
        grouped ones, uncoalesced ones as one op per tensor."""
        report = self._report()
        for run in report["runs"]:
            modes = next(e for e in run["models"] if e["model"] == "llama-S")["modes"]
            with self.subTest(pg=run["pg"], world_size=run["world_size"]):
                self.assertEqual(modes["per-param"]["copy_bytes"], 0)
                self.assertEqual(modes["per-param-nocoalesce"]["copy_bytes"], 0)
                self.assertGreater(modes["grouped"]["copy_bytes"], 0)
                coalesced = modes["per-param"]["collectives"]
                uncoalesced = modes["per-param-nocoalesce"]["collectives"]
                self.assertEqual(coalesced["ops"], modes["grouped"]["collectives"]["ops"])
                self.assertEqual(uncoalesced["ops"], uncoalesced["tensors"])
                self.assertEqual(coalesced["tensors"], uncoalesced["tensors"])
                self.assertGreater(coalesced["tensors"], coalesced["ops"])


if __name__ == "__main__":
    run_tests()
