#!/usr/bin/env bash
# Set up .venv from scratch if needed, install torch_fsdp_ext, check the patch
# series, lint, run the whole test suite, then the reference tests again on
# ATen's portable CPU kernels. Extra arguments go to pytest.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,4s/^# //p' "$0"
  echo "usage: bash tools/setup_and_test.sh [pytest args...]"
  exit 0
fi
cd "$(dirname "$0")/.."
py=.venv/bin/python
if [[ ! -x $py ]]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
echo "== installing requirements.txt and torch_fsdp_ext (editable)"
$py -m pip install -q -r requirements.txt
$py -m pip install -q --no-build-isolation --no-deps -e .
echo "== tools/check_patches.py"
$py tools/check_patches.py
echo "== ruff"
$py -m ruff check .
$py -m ruff format --check .
echo "== tests"
$py -m pytest test -q -p no:cacheprovider "$@"
# Users' CPUs differ from this one: the tolerance-based comparisons with an
# unsharded reference must hold with ATen's portable kernels too
echo "== reference tests with ATEN_CPU_CAPABILITY=default"
ATEN_CPU_CAPABILITY=default $py -m pytest test -q -p no:cacheprovider -m reference "$@"
