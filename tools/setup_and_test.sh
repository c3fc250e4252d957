#!/usr/bin/env bash
# Set up a venv for one torch base from scratch if needed, install
# torch_fsdp_ext, check the patch series, lint, run the whole test suite, then
# the reference tests again on ATen's portable CPU kernels. Each patch's tests
# at its position (tools/patches.py stack) are CI's and the patch loop's.
set -euo pipefail
usage="usage: bash tools/setup_and_test.sh [--base VERSION] [--setup-only | --quick] [pytest args...]

--base        torch release to set up (one of patches/*/; default: the primary
              base in patches/bases.toml). The primary base gets .venv, others
              .venv-VERSION.
--setup-only  set up the venv and the generated copy, run nothing else
--quick       check and lint as always, then only the tests not marked slow
              (CI does this for the bases other than the primary)
Extra arguments go to pytest."
cd "$(dirname "$0")/.."
primary=$(python3 -c 'import tomllib; print(tomllib.load(open("patches/bases.toml", "rb"))["primary"])')
base=$primary
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,4s/^# //p' "$0"
  echo "$usage"
  exit 0
fi
if [[ "${1:-}" == "--base" ]]; then
  base=${2:?"$usage"}
  shift 2
fi
setup_only=0
if [[ "${1:-}" == "--setup-only" ]]; then
  setup_only=1
  shift
fi
quick=0
if [[ "${1:-}" == "--quick" ]]; then
  quick=1
  shift
fi
if [[ ! -f patches/$base/base.toml ]]; then
  echo "error: no series for torch $base; supported: $(ls -d patches/*/ | xargs -n1 basename | tr '\n' ' ')" >&2
  exit 2
fi
venv=.venv
[[ $base == "$primary" ]] || venv=.venv-$base
py=$venv/bin/python
if [[ ! -x $py ]]; then
  echo "== creating $venv (torch $base)"
  python3 -m venv "$venv"
fi
echo "== installing torch==$base, requirements.txt and torch_fsdp_ext (editable) into $venv"
# requirements.txt less the packages that patches/$base/base.toml excludes
# ([requirements.exclude]: name = why, e.g. a release that needs a newer torch;
# the tests that need them skip, saying so)
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
python3 - "$base" >"$requirements" <<'PY'
import re, sys, tomllib
base = sys.argv[1]
with open(f"patches/{base}/base.toml", "rb") as f:
    exclude = tomllib.load(f).get("requirements", {}).get("exclude", {})
for name, why in exclude.items():
    print(f"== not installing {name} for torch {base}: {why}", file=sys.stderr)
for line in open("requirements.txt"):
    name = re.match(r"\s*([A-Za-z0-9_.-]*)", line).group(1)
    if name.lower() not in {n.lower() for n in exclude}:
        sys.stdout.write(line)
PY
# Some machines cap torch with a pip constraints file (e.g. at 2.14.1) that
# would refuse a newer base; the base is pinned exactly here (also against a
# requirement that would upgrade it), so lift it
PIP_CONSTRAINT=/dev/null $py -m pip install -q "torch==$base" -r "$requirements"
$py -m pip install -q --no-build-isolation --no-deps -e .
if ((setup_only)); then
  echo "== generating torch_fsdp_ext/_fully_shard (torch $base)"
  $py tools/patches.py vendor
  exit 0
fi
echo "== tools/patches.py check (torch $base)"
$py tools/patches.py check
echo "== ruff"
$py -m ruff check .
$py -m ruff format --check .
tests=() reference=reference
if ((quick)); then
  tests=(-m "not slow") reference="reference and not slow"
fi
echo "== tests ${tests[*]} (torch $base)"
$py -m pytest test -q -p no:cacheprovider "${tests[@]}" "$@"
# Users' CPUs differ from this one: the tolerance-based comparisons with an
# unsharded reference must hold with ATen's portable kernels too
echo "== $reference tests with ATEN_CPU_CAPABILITY=default (torch $base)"
ATEN_CPU_CAPABILITY=default $py -m pytest test -q -p no:cacheprovider -m "$reference" "$@"
