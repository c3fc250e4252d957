#!/usr/bin/env bash
# The prepared GPU check, for a machine with one CUDA GPU (no multi-rank NCCL):
# environment, the tests that fit one GPU, the benchmark (MoE included) on the
# fake process group on cuda:0, and a CUDA-stream race check of FSDP's own
# copies under the CUDA sanitizer. Prints a short summary; full logs go to
# LOG_DIR. About 8 min.
#
# On a machine whose torch is no supported base (the lent H200's torch 2.11),
# set TORCH_FSDP_EXT_CARRIED=1 and carry torch_fsdp_ext/_fully_shard/ as
# generated here for the primary base, plus .whl/ with the wheels that machine
# lacks (expecttest): tools/carried/ then goes first on PYTHONPATH and runs that
# copy on the installed torch (see CONTRIBUTING.md, the GPU lane).
set -uo pipefail
usage="usage: bash tools/gpu_check.sh LOG_DIR [PYTHON]

LOG_DIR  where the logs, the bench JSON/markdown/plots and summary.txt go
PYTHON   interpreter with torch (CUDA) (default: .venv/bin/python); this checkout's
         torch_fsdp_ext is put first on its path"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,12s/^# \{0,1\}//p' "$0"
  echo "$usage"
  [[ $# -ge 1 ]] && exit 0 || exit 2
fi
cd "$(dirname "$0")/.."
logdir=$1
py=${2:-.venv/bin/python}
mkdir -p "$logdir"
summary="$logdir/summary.txt"
: > "$summary"
failed=0
if [[ -d .whl ]]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${TORCH_FSDP_EXT_CARRIED:-}" == 1 ]]; then
  export PYTHONPATH="$PWD/tools/carried:$PYTHONPATH"
fi

# step NAME LIMIT_S CMD...: run CMD with its output in LOG_DIR/NAME.log
step() {
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name (limit ${limit} s)"
  start=$(date +%s)
  timeout "$limit" "$@" > "$logdir/$name.log" 2>&1
  rc=$?
  local line="$name: $([[ $rc == 0 ]] && echo pass || echo "FAIL (exit $rc)") in $(( $(date +%s) - start )) s"
  echo "$line" | tee -a "$summary"
  tail -n 3 "$logdir/$name.log" | sed 's/^/    /'
  [[ $rc == 0 ]] || failed=1
}

step env 120 "$py" -c "
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda)
assert torch.cuda.is_available(), 'no CUDA GPU'
print('gpu', torch.cuda.get_device_name(0), 'count', torch.cuda.device_count())
import sys, torch_fsdp_ext
print('torch_fsdp_ext ok, carried lane:', 'stand_ins' in sys.modules)
"
if [[ $failed != 0 ]]; then
  echo "no usable CUDA torch with torch_fsdp_ext; see $logdir/env.log" | tee -a "$summary"
  exit 1
fi
# CUDA-stream races: FSDP's copies and frees on its streams vs the compute
# stream, per-parameter and grouped, under CSAN (fake process group on cuda:0)
step race 120 env TORCH_CUDA_SANITIZER=1 "$py" -m pytest -q -p no:cacheprovider \
  test/package/test_cuda_streams.py
# The tests that fit one GPU: multi-process tests needing 2+ GPUs skip cleanly
step tests 240 "$py" -m pytest -q -p no:cacheprovider -m "not slow" \
  test/upstream test/package/test_per_param_parity.py test/package/test_per_param_memory.py
# FSDP's own copies, allocations and launch time on one GPU
step bench 180 "$py" tools/bench --device cuda --pg fake --world-size 8 \
  --models llama-S llama-M few-large moe --sweep 4 64 --steps 10 --out "$logdir/bench"
echo "== summary ($summary)"
cat "$summary"
exit $failed
