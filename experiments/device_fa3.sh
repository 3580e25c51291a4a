#!/usr/bin/env bash
# One device call for the Hopper reference kernel: build, smoke, GPU tests, compute-sanitizer
# (memcheck + racecheck) on a small causal GQA ragged case, then the benchmark against SDPA.
# Usage on the device machine, from the repo root:  bash experiments/device_fa3.sh [quick]
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/fa3}
mkdir -p "$OUT"
MODE=${1:-full}
step() { echo; echo "=== $* ==="; }

step gpu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
step build
timeout 300 python3 -c "
from cubridge.runtime.fa3_sm90 import Fa3Config, build_cubin
for d in (64, 128):
    for c in (False, True):
        for bf in (False, True):
            build_cubin(Fa3Config(head_dim=d, causal=c, bf16=bf))
print('built 8 configs')" 2>&1 | tail -5
step smoke
timeout 90 python3 experiments/bench_fa3.py --smoke 2>&1 | tee "$OUT/smoke.log" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || { echo "SMOKE FAILED: stopping"; exit 1; }
step tests
timeout 400 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_fa3_sm90.py 2>&1 \
  | tee "$OUT/tests.log" | grep -v "^tests/.*PASSED" | tail -40
if [ "$MODE" != quick ]; then
  step sweep
  timeout 300 python3 experiments/bench_fa3.py --sweep --out "$OUT/fa3_sweep.json" 2>&1 | tee "$OUT/sweep.log" | tail -12
  step sanitizer
  SAN="compute-sanitizer --print-limit 20 --error-exitcode 9"
  { timeout 240 $SAN --tool memcheck python3 experiments/bench_fa3.py --sanitize-case; echo "memcheck rc=$?";
    timeout 240 $SAN --tool racecheck python3 experiments/bench_fa3.py --sanitize-case; echo "racecheck rc=$?"; } \
    > "$OUT/sanitizer.log" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|rc=|sanitize case" "$OUT/sanitizer.log"
  step bench
  timeout 500 python3 experiments/bench_fa3.py --out "$OUT/fa3_bench.json" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
