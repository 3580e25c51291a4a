#!/usr/bin/env bash
# One device call for ref_kernels/fa2_sm80: GPU tests, compute-sanitizer (memcheck + racecheck) on
# a small causal GQA ragged case, then the dense benchmark with the given flags.
# Usage (device, repo root):  bash experiments/device_fa2.sh [tests|notests] [bench flags... | nobench]
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/fa2}
mkdir -p "$OUT"
TESTS=${1:-tests}; shift || true
step() { echo; echo "=== $* ($(date +%T)) ==="; }

step gpu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [ "$TESTS" = tests ]; then
  step tests
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --tb=short -rfs tests/gpu/test_fa2_sm80.py 2>&1 \
    | tee "$OUT/tests.log" | grep -vE "^\.+ *\[|PASSED" | tail -45
  step sanitizer
  SAN="compute-sanitizer --print-limit 20 --error-exitcode 9"
  { timeout 80 $SAN --tool memcheck python3 experiments/sanitize_fa2.py; echo "memcheck rc=$?";
    timeout 80 $SAN --tool racecheck python3 experiments/sanitize_fa2.py; echo "racecheck rc=$?"; } \
    > "$OUT/sanitizer.log" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|rc=|sanitize case|Error|error" "$OUT/sanitizer.log" | head -30
fi
if [ "${1:-}" != nobench ]; then
  step bench "$@"
  timeout ${BENCH_TIMEOUT:-400} python3 experiments/bench_dense.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -E "failed|skipped|WRONG" "$OUT/bench.log" | head -20
  for f in "$OUT"/dense_*.json; do python3 experiments/bench_dense.py --table "$f"; done
fi
step done
