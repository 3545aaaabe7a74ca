#!/usr/bin/env bash
# The CUDA suite and GPU benchmarks in one command (docs/gpu.md).
#
#   bash benchmarks/gpu/run.sh [env|tests|bench|all]      (default: all)
#
# env   : print python/torch/transformers/CUDA/GPU and check the imports the suite relies on
# tests : python3 -m pytest -q gpu_tests            (every test skips without CUDA: "no CUDA device")
# bench : benchmarks/gpu/bench_{varlen,planner,publish,mfu}.py (each exits 0 without CUDA)
# all   : env, tests, bench
# Env: GPU_BUDGET_S (whole-command seconds), GPU_TESTS_MAX_S, GPU_BENCHES (subset, in order), GPU_MFU_ARGS.
#
# Uses the machine's python3 (GPU image: torch + transformers + peft + safetensors + pytest preinstalled);
# our packages are pure Python and are put on PYTHONPATH, not installed. Wheels carried in .whl/ (see
# docs/gpu.md) are installed with --no-deps into /tmp/site first. Logs, JSON and a summary go to $OUT
# when set (the device tool's output folder), else benchmarks/out/gpu/. Exit status: the tests' status.
set -u -o pipefail
MODE="${1:-all}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WORK="$ROOT/benchmarks/out/gpu"
mkdir -p "$WORK"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONPATH="$(ls -d "$ROOT"/packages/*/src | tr '\n' :)${PYTHONPATH:-}"
export SHARDFORGE_GPU_OUT="$WORK" PYTHONPATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# GPU_BUDGET_S: seconds this whole command may take (a device lease). Each step gets a timeout from
# what is left, bench_mfu stops starting configurations in time, and the archive in $OUT is rewritten
# after every step, so a lease that ends early still returns what was measured.
DEADLINE=$((SECONDS + ${GPU_BUDGET_S:-100000}))
left() { local l=$((DEADLINE - SECONDS - ${1:-0})); [ "$l" -lt 1 ] && l=1; echo "$l"; }
cap() { local l; l=$(left 20); [ "$l" -gt "$1" ] && l=$1; echo "$l"; }
archive() {
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu_run.tgz" -C "$WORK" . && cp "$SUMMARY" "$OUT/summary.md" && cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
  fi
}
SUMMARY="$WORK/summary.md"
: >"$SUMMARY"
status=0

env_check() {
  "$PY" - <<'PYEOF' 2>&1 | tee "$WORK/env.log"
import platform, sys
import torch
print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}")
else:
    print("no CUDA device: tests and benchmarks will skip")
from importlib import metadata, util
for name in ("transformers", "safetensors", "peft", "pytest", "pyyaml", "tqdm", "tokenizers", "datasets", "torchtitan"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        optional = {"datasets": "optional (SFT JSONL falls back to json)", "torchtitan": "optional (MFU anchor)",
                    "peft": "needed by LoRA export tests"}
        print(f"{name} MISSING" + (f": {optional[name]}" if name in optional else ""))
if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
    print(f"note: the packages declare torch>=2.13; this is {torch.__version__} (run anyway: PYTHONPATH, no pip check)")
spec = util.find_spec("shardforge.algorithms")
assert spec is not None, "shardforge.algorithms is not importable: PYTHONPATH must list packages/*/src"
print("shardforge from", list(spec.submodule_search_locations or [])[0])
import shardforge.ulysses_cp.packed_attention as pa
print("varlen_attn parameters:", sorted(pa._varlen_api() or []) or "not available")
PYEOF
  local rc=$?
  echo "| env | rc $rc | $(grep -m1 '^GPU\|^no CUDA' "$WORK/env.log") |" >>"$SUMMARY"
  return $rc
}

run_tests() {
  local start=$SECONDS
  local per_test=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=180)
  timeout "$(cap "${GPU_TESTS_MAX_S:-100000}")" "$PY" -m pytest -q -ra -p no:cacheprovider "${per_test[@]}" \
    --junitxml="$WORK/gpu_tests.xml" gpu_tests 2>&1 | tee "$WORK/tests.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 5 ] && rc=0  # nothing collected
  echo "| tests | rc $rc, $((SECONDS - start)) s | $(tail -n1 "$WORK/tests.log") |" >>"$SUMMARY"
  status=$rc
  archive
}

run_bench() {
  for script in ${GPU_BENCHES:-bench_varlen bench_planner bench_publish bench_mfu}; do
    local start=$SECONDS
    local extra=() limit
    if [ "$script" = bench_mfu ]; then
      limit=$(left 20)
      extra=(--budget-s "$(( limit > 150 ? limit - 120 : 30 ))" ${GPU_MFU_ARGS:-})
    else
      limit=$(cap 240)
    fi
    timeout "$limit" "$PY" "benchmarks/gpu/$script.py" "${extra[@]}" 2>&1 | tee "$WORK/$script.log"
    local rc=${PIPESTATUS[0]}
    echo "| $script | rc $rc, $((SECONDS - start)) s | $(grep -m1 'no CUDA device' "$WORK/$script.log" || echo see $script.log) |" >>"$SUMMARY"
    archive
  done
}

case "$MODE" in
  env) env_check || status=$? ;;
  tests) env_check; run_tests ;;
  bench) env_check; run_bench ;;
  all) env_check; run_tests; run_bench ;;
  *) echo "usage: bash benchmarks/gpu/run.sh [env|tests|bench|all]" >&2; exit 2 ;;
esac

# The device tool returns at most 8 files: one archive with everything, plus the summary and RESULTS.md.
[ "$MODE" != env ] && archive
echo
echo "| step | result | detail |"
echo "|---|---|---|"
cat "$SUMMARY"
exit $status
