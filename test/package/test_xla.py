"""torch_fsdp_ext.xla without torch_xla: the parts that are plain torch.

The XLA lane itself (grouped vs per-param on PJRT CPU) is
``bash tools/xla_check.sh``, which CI runs; these tests hold on every base.
"""

import sys
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_fsdp_ext import get_fsdp_backend, xla


class TestFullyShardXLAKernels(TestCase):
    @settings(max_examples=50, deadline=None)
    @given(
        rows=st.lists(st.integers(1, 9), min_size=1, max_size=4),
        cols=st.integers(1, 3),
        num_chunks=st.integers(1, 4),
    )
    def test_chunk_cat_matches_aten(self, rows, cols, num_chunks):
        """Tests that the package's chunk_cat, which replaces torch_xla's
        (zeros for a tensor whose dim 0 needs padding), equals ATen's
        ``torch._chunk_cat`` bit for bit, padding included."""
        g = torch.Generator().manual_seed(len(rows) * 100 + cols * 10 + num_chunks)
        tensors = [
            torch.randn(r, cols, generator=g) if i % 2 else torch.randn(r * cols, generator=g)
            for i, r in enumerate(rows)
        ]
        expected = torch._chunk_cat(tensors, 0, num_chunks)
        out = torch.full_like(expected, float("nan"))
        xla._chunk_cat(tensors, 0, num_chunks, out=out)
        self.assertEqual(out, expected, atol=0, rtol=0)

    def test_split_with_sizes_copy_fills_every_output(self):
        """Tests that the functionalizable split_with_sizes_copy writes each
        slice of the all-gather output into its output tensor."""
        src = torch.arange(10.0)
        outs = [torch.empty(3), torch.empty(0), torch.empty(7)]
        xla._split_with_sizes_copy(src, [3, 0, 7], out=outs)
        self.assertEqual(torch.cat(outs), src, atol=0, rtol=0)


class TestFullyShardXLARegistration(TestCase):
    def test_register_without_torch_xla_names_the_fix(self):
        """Tests that register() without torch_xla raises one ImportError that
        names the pip command, and registers nothing."""
        with mock.patch.dict(sys.modules, {"torch_xla": None}):
            with self.assertRaisesRegex(ImportError, "Fix: pip install torch-xla=="):
                xla.register()
        self.assertIsNone(get_fsdp_backend("xla"))

    def test_entry_point_waits_for_torch_xla(self):
        """Tests that the entry point FSDP calls at its first backend lookup
        registers nothing in a process that has not imported torch_xla (it
        would otherwise start torch_xla's runtime in every FSDP job)."""
        with mock.patch.dict(sys.modules, {"torch_xla": None}):
            sys.modules.pop("torch_xla")
            xla._register_if_loaded()
        self.assertIsNone(get_fsdp_backend("xla"))

    def test_backend_reduces_without_avg(self):
        """Tests the capabilities the 'xla' backend declares: per-parameter
        by default, no AVG (FSDP sums and divides), no PREMUL_SUM, no
        coalescing."""
        self.assertIs(xla.XLA_BACKEND.group_collectives, False)
        self.assertIs(xla.XLA_BACKEND.supports_avg, False)
        self.assertIs(xla.XLA_BACKEND.supports_premul_sum, False)
        self.assertIs(xla.XLA_BACKEND.supports_coalescing, False)


if __name__ == "__main__":
    run_tests()
