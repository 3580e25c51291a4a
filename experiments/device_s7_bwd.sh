#!/usr/bin/env bash
# Session 7, branch bwd: one device call for ref_kernels/fa2_bwd_sm80 (the portable backward).
#   1. tests/gpu/test_bwd.py (the verification rule on dQ, dK, dV; poisoned outputs, unchanged
#      inputs, bitwise deterministic mode; ragged, GQA / MQA, D 64 / 128, both dtypes; autograd)
#   2. compute-sanitizer memcheck + racecheck on the small launches of bench_bwd.py --sanitize-case
#   3. the backward benchmark (bench_bwd.py: 8k then 1k, causal and full; JSON written after every
#      shape), and its table printed last
# Writes exactly two files under $OUT: bwd_bench.json and bwd_log.txt.
# Usage (device, repo root):  bash experiments/device_s7_bwd.sh [all|tests|bench]
#   all: <= 170 s tests + 2 x 50 s sanitizer + 280 s bench (each capped) ~ 9.5 min worst case;
#   if the 10-minute call limit is a worry, run `tests` and `bench` as two calls.
#   FA4 / Flex FLASH rows need the FA4 packs (../shared/tools/pack-fa4.sh) unpacked in the call
#   before; without them those systems are reported as skipped.
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/bwd}
mkdir -p "$OUT"
LOG="$OUT/bwd_log.txt"
JSON="$OUT/bwd_bench.json"
MODE=${1:-all}
step() { echo; echo "=== $* ($(date +%T)) ==="; }
{
  step gpu
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  if [ -f .fa4whl/env.sh ]; then source .fa4whl/env.sh || echo "FA4 not available (rc=$?)"; fi
  if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    step tests
    timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider --tb=short -rfs tests/gpu/test_bwd.py 2>&1 \
      | grep -vE "^\.+ *\[|PASSED" | tail -60
    echo "tests rc=$?"
    step sanitizer
    SAN="compute-sanitizer --print-limit 20 --error-exitcode 9"
    timeout 50 $SAN --tool memcheck python3 experiments/bench_bwd.py --sanitize-case 2>&1 | tail -8
    echo "memcheck rc=$?"
    timeout 50 $SAN --tool racecheck python3 experiments/bench_bwd.py --sanitize-case 2>&1 | tail -8
    echo "racecheck rc=$?"
  fi
  if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
    step bench
    timeout ${BENCH_TIMEOUT:-280} python3 experiments/bench_bwd.py --out "$JSON" --reps 15 \
      --configs 64x64w4-dq64x64w4 2>&1 | grep -vE "^\| " | tail -40
    echo "bench rc=$?"
    [ -f "$JSON" ] && python3 experiments/bench_bwd.py --table "$JSON"
  fi
} 2>&1 | tee "$LOG"
