#!/usr/bin/env bash
# The GPU suite: environment, GPU tests, benchmarks; everything written under OUT.
#
# usage: bash scripts/gpu_suite.sh OUT [--slow] [--no-tests] [--no-bench] [--quick] [--tests PATHS] [--bench NAMES]
#   --slow      also the tests marked slow (pytest -m "gpu or slow"; default -m "gpu and not slow")
#   --no-tests  / --no-bench   skip that part
#   --quick     benchmarks with do_bench warm-up 10 ms / repetition 50 ms (default 25 / 100)
#   --tests     comma-separated test files or folders (default: tests): the whole GPU suite compiles for longer
#               than one 10-minute device call, so a call can take a part of it
#   --bench     comma-separated benchmark names of the list below (default: all)
#
# Run from the repository root. Peer wheels (fla-core, mlstm_kernels, flash-qla and what they need) placed in
# .peers/ are installed into .peers/site first, without network or dependency resolution.
# OUT gets env.txt, pytest.log, bench-<name>.log / .json, bench.csv (tfla bench --csv rows) and summary.txt.
set -uo pipefail
OUT=${1:?usage: bash scripts/gpu_suite.sh OUT [--slow] [--no-tests] [--no-bench] [--quick]}
shift
MARK="gpu and not slow"; TESTS=1; BENCH=1; TIMING=(); TEST_PATHS="tests"; BENCHES=""
while [ $# -gt 0 ]; do
  case "$1" in
    --slow) MARK="gpu or slow" ;;
    --no-tests) TESTS=0 ;;
    --no-bench) BENCH=0 ;;
    --quick) TIMING=(--warmup 10 --rep 50) ;;
    --tests) TEST_PATHS=${2:?--tests needs a value}; shift ;;
    --bench) BENCHES=${2:?--bench needs a value}; shift ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .peers/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target .peers/site .peers/*.whl 2>&1 \
    | grep -v "already exists" | tail -3
  export PYTHONPATH="$PWD/.peers/site:$PYTHONPATH"
fi
STATUS=()
step() {  # step NAME LOG CMD...: run, log, record the exit status
  local name=$1 log=$2; shift 2
  echo "== $name: $*"
  "$@" > "$log" 2>&1
  local rc=$?
  tail -n 25 "$log"
  STATUS+=("$name rc=$rc")
}

# environment: GPU, driver, versions of torch / triton / tfla (git commit, source hash) and the peers
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  python - <<'EOF'
import importlib.metadata as md
import torch
from tfla.bench.common import env_info
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch")
info = env_info()
info["cuda"] = torch.version.cuda
for dist in ("mlstm_kernels", "tilelang"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        info[dist] = "-"
print("\n".join(f"{k}: {v}" for k, v in info.items()))
EOF
} 2>&1 | tee "$OUT/env.txt"
if [ "${PIPESTATUS[0]}" != 0 ]; then echo "environment check failed" >&2; exit 1; fi

if [ "$TESTS" = 1 ]; then
  # shellcheck disable=SC2086
  step tests "$OUT/pytest.log" python -m pytest -q -rf -p no:cacheprovider -m "$MARK" ${TEST_PATHS//,/ }
fi
if [ "$BENCH" = 1 ]; then
  for spec in "gdn-fwd:gdn --mode fwd" "gdn-fwdbwd:gdn --mode fwdbwd" \
              "linear-attn-fwdbwd:linear-attn --mode fwdbwd" "mlstm-fwdbwd:mlstm --mode fwdbwd" "decode:decode"; do
    name=${spec%%:*}
    if [ -n "$BENCHES" ] && [[ ",$BENCHES," != *",$name,"* ]]; then continue; fi
    # shellcheck disable=SC2086
    step "bench $name" "$OUT/bench-$name.log" python -m tfla bench ${spec#*:} --no-progress "${TIMING[@]}" \
      --csv "$OUT/bench.csv" --json "$OUT/bench-$name.json"
  done
fi
printf '%s\n' "${STATUS[@]}" | tee "$OUT/summary.txt"
! grep -qv "rc=0$" "$OUT/summary.txt"
