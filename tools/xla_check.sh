#!/usr/bin/env bash
# FSDP2 grouped vs per-parameter on torch_xla's PJRT CPU device: set up the
# torch 2.9.0 venv with torch-xla 2.9.0 if needed, then run tools/xla_check.py,
# which writes the JSON report and fails unless, in every configuration, the
# modes agree bit for bit and every parameter moved under torch.optim.AdamW,
# and per-param needs no more collectives, host round trips or graphs per step;
# then --memory --check (fp32 at W=2, bf16 at W=4): device bytes after a step
# and the in-step peak (docs/xla.md, "Memory").
set -euo pipefail
usage="usage: bash tools/xla_check.sh OUT.json [tools/xla_check.py options]"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,8s/^# //p' "$0"
  echo "$usage"
  exit 0
fi
out=${1:?$usage}
shift
cd "$(dirname "$0")/.."
# torch-xla 2.9.0, the newest release, runs on torch 2.9.0 only
base=2.9.0
bash tools/setup_and_test.sh --base "$base" --setup-only
py=.venv-$base/bin/python
echo "== installing torch-xla==$base into .venv-$base"
PIP_CONSTRAINT=/dev/null $py -m pip install -q "torch==$base" "torch-xla==$base"
echo "== tools/xla_check.py (PJRT CPU, W=2 and 4: grouped, per-param tuple, per-param one by one)"
$py tools/xla_check.py --check --out "$out" "$@"
echo "== tools/xla_check.py --memory (device bytes after a step, in-step peak; floor, grouped, per-param, torch_xla's FSDP)"
for run in "2 fp32" "4 bf16"; do
  set -- $run
  XLA_FLAGS=--xla_backend_optimization_level=0 $py tools/xla_check.py --memory --check \
    --world-size "$1" --precision "$2" --out "${out%.json}.memory-w$1-$2.json"
done
