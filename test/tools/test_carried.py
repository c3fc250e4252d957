"""The GPU lane's carried-base shim (``tools/carried/``) against the torch
internals it stands in for on an older torch: on the primary base, each
stand-in must give what torch's own gives, and the lane must change nothing.

The shim's purpose, the generated copy running on the GPU machine's torch 2.11,
is checked there by ``tools/gpu_check.sh`` and on CPU as CONTRIBUTING.md's GPU
lane describes; this file keeps the stand-ins honest where CI runs.
"""

import collections
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.fsdp._common_utils as fsdp_common_utils
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from fsdp_ext_testing import CARRIED_ENV
from torch_fsdp_ext._vendor import primary_version, release

# The lane's folder, which it puts first on PYTHONPATH; here its module is
# loaded by path (test/ and tools/ do not import each other)
LANE = Path(__file__).resolve().parents[2] / "tools" / "carried"
_spec = importlib.util.spec_from_file_location("stand_ins", LANE / "stand_ins.py")
stand_ins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stand_ins)

Pair = collections.namedtuple("Pair", "first second")


def _nested_outputs() -> dict[str, object]:
    """Module outputs FSDP's hooks walk: tensors with and without grad in the
    containers both traversals enter."""
    a, b, c = (torch.randn(2, requires_grad=True) for _ in range(3))
    plain = torch.randn(2)
    return {
        "tensor": a,
        "tuple": (a, plain, b),
        "list_in_dict": {"x": [a, 3, plain], "y": b},
        "namedtuple": Pair(a, (plain, c)),
        "none": None,
    }


class TestCarriedBaseStandIns(TestCase):
    @parametrize("case", list(_nested_outputs()))
    def test_grad_tensors_match_torch(self, case: str):
        """Tests that collecting and replacing the tensors that require grad
        visits them in torch's order and rebuilds the same structure."""
        if not hasattr(fsdp_common_utils, "collect_grad_tensors"):
            self.skipTest(f"torch {torch.__version__} has no collect_grad_tensors to compare with")
        output = _nested_outputs()[case]
        expected = fsdp_common_utils.collect_grad_tensors(output)
        actual = stand_ins._collect_grad_tensors(output)
        self.assertEqual([id(t) for t in actual], [id(t) for t in expected])
        replacements = [t.detach().clone() + 1 for t in expected]
        self.assertEqual(
            stand_ins._replace_grad_tensors(output, iter(replacements)),
            fsdp_common_utils.replace_grad_tensors(output, iter(replacements)),
        )

    def test_chunk_cat_mixed_dtype_matches_torch(self):
        """Tests that the Python copy-in writes the bits of torch's C++
        ``fsdp::chunk_cat_mixed_dtype`` for bf16 and fp32 gradients, evenly
        and unevenly chunked."""
        if not hasattr(torch.ops.fsdp, "chunk_cat_mixed_dtype"):
            self.skipTest(f"torch {torch.__version__} has no fsdp::chunk_cat_mixed_dtype (2.15+)")
        torch.manual_seed(0)
        grads = [
            torch.randn(8, 3, dtype=torch.bfloat16),
            torch.randn(6),
            torch.randn(4, 5, dtype=torch.bfloat16),
        ]
        for num_chunks in (2, 4):
            # Each gradient's dim-0 is padded to a multiple of num_chunks
            chunk_numel = sum(-(-g.size(0) // num_chunks) * g[0].numel() for g in grads)
            expected = torch.empty(num_chunks, chunk_numel)
            actual = torch.full_like(expected, float("nan"))
            torch.ops.fsdp.chunk_cat_mixed_dtype(grads, 0, num_chunks, out=expected)
            stand_ins._chunk_cat_mixed_dtype(grads, 0, num_chunks, out=actual)
            self.assertTrue(torch.equal(actual, expected), msg=f"{num_chunks=}")

    def test_premul_sum_stand_in(self):
        """Tests that the ``ReduceOp.PREMUL_SUM`` stand-in compares equal to the
        op type and, called, makes an op of that type with its factor. (The
        reflected ``op_type == stand_in`` holds where the stand-in is used:
        torch 2.11's enum defers to it; the upstream-path
        ``DeterministicReduceScatter`` tests check it there.)"""
        op_type = dist.ReduceOp.RedOpType.PREMUL_SUM
        premul = stand_ins._PremulSum(op_type)
        self.assertTrue(premul == op_type)
        self.assertNotEqual(premul, dist.ReduceOp.RedOpType.SUM)
        self.assertEqual(hash(premul), hash(op_type))
        op = premul(0.25)
        self.assertEqual(op.__getstate__(), (op_type, 0.25))

    def test_install_changes_nothing_on_the_primary_base(self):
        """Tests that on a torch that has every internal the copy uses, the
        lane (its folder first on ``PYTHONPATH``) imports the package and
        supplies nothing (no warning either), and that without the lane the
        package ignores ``TORCH_FSDP_EXT_CARRIED``."""
        if release(torch.__version__) != primary_version():
            self.skipTest(f"carried copies are generated for the primary base {primary_version()}")
        code = (
            "import sys, torch_fsdp_ext; "
            "print(torch_fsdp_ext._vendor.ensure_vendored.__module__, 'stand_ins' in sys.modules)"
        )
        repo = str(LANE.parents[1])
        path = os.pathsep.join([str(LANE), repo, os.environ.get("PYTHONPATH", "")])
        lane = subprocess.run(
            [sys.executable, "-c", code + "; import stand_ins; print(stand_ins.install())"],
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            check=True,
        )
        self.assertEqual(lane.stdout.split(), ["sitecustomize", "True", "[]"])
        self.assertNotIn("carried lane", lane.stderr)
        package = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, CARRIED_ENV: "1", "PYTHONPATH": repo},
            capture_output=True,
            text=True,
            check=True,
        )
        self.assertEqual(package.stdout.split(), ["torch_fsdp_ext._vendor", "False"])


instantiate_parametrized_tests(TestCarriedBaseStandIns)


if __name__ == "__main__":
    run_tests()
