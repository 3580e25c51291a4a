#!/usr/bin/env bash
# Session 7, branch bwd: one device call for ref_kernels/fa2_bwd_sm80 (the portable backward).
#   1. tests/gpu/test_bwd.py (the verification rule on dQ, dK, dV; poisoned outputs, unchanged
#      inputs, bitwise deterministic mode; ragged, GQA / MQA, D 64 / 128, both dtypes)
#   2. compute-sanitizer memcheck + racecheck on the small launches of bench_bwd.py --sanitize-case
#   3. the backward benchmark (bench_bwd.py), table printed last
# Writes exactly two files under $OUT: bwd_bench.json and bwd_log.txt.
# Usage (device, repo root):  bash experiments/device_s7_bwd.sh [all|tests|bench]
#   FA4 / Flex FLASH rows need the FA4 packs (../shared/tools/pack-fa4.sh) unpacked in the call
#   before; without them those systems are reported as skipped.
# Fits one 600 s call: tests <= 210 s, sanitizer <= 2 x 60 s, bench <= 240 s (each capped).
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/bwd}
mkdir -p "$OUT"
LOG="$OUT/bwd_log.txt"
MODE=${1:-all}
step() { echo; echo "=== $* ($(date +%T)) ==="; }
{
  step gpu
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  if [ -f .fa4whl/env.sh ]; then source .fa4whl/env.sh || echo "FA4 not available (rc=$?)"; fi
  if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    step tests
    timeout ${TEST_TIMEOUT:-210} python3 -m pytest -q -p no:cacheprovider --tb=short -rfs tests/gpu/test_bwd.py 2>&1 \
      | grep -vE "^\.+ *\[|PASSED" | tail -60
    step sanitizer
    SAN="compute-sanitizer --print-limit 20 --error-exitcode 9"
    timeout 60 $SAN --tool memcheck python3 experiments/bench_bwd.py --sanitize-case 2>&1 | tail -8; echo "memcheck rc=$?"
    timeout 60 $SAN --tool racecheck python3 experiments/bench_bwd.py --sanitize-case 2>&1 | tail -8; echo "racecheck rc=$?"
  fi
  if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
    step bench
    timeout ${BENCH_TIMEOUT:-240} python3 experiments/bench_bwd.py --out "$OUT/bwd_bench.json" --reps 15 --configs 64x64w4-dq64x64w4 2>&1 | tail -40
    echo "bench rc=$?"
  fi

} 2>&1 | tee "$LOG"
