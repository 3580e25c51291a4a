#!/usr/bin/env bash
# Session 7, branch bwd2: variant backwards and autograd through the tuned op, on one H100.
#   1. tests/gpu/test_bwd.py -k "double_backward or autograd"  (the fixed double-backward test)
#   2. tests/gpu/test_bwd_variants.py  (8 variants + composite softcap 2, x 3 shapes: the rule on
#      dQ, dK, dV, poisoned outputs, unchanged inputs, deterministic bitwise)
#   3. tests/gpu/test_bwd_op.py  (loss.backward() through cubridge.load's op: eager, torch.compile
#      forward + backward, bnhd layout; prefixlm, share_question, sigmoid, composite)
#   4. experiments/bench_bwd_variants.py at 8k: variant backward vs eager autograd, table printed last
# Writes exactly two files under $OUT: bwd2_bench.json and bwd2_log.txt.
# Usage (device, repo root), as TWO calls (each under the 10-minute limit):
#   bash experiments/device_s7_bwd2.sh tests    # <= 90 + 180 + 240 s
#   bash experiments/device_s7_bwd2.sh bench    # <= 240 s
#   (`all` runs both: up to 12.5 min worst case, over the per-call limit.)
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/bwd2}
mkdir -p "$OUT"
LOG="$OUT/bwd2_log.txt"
JSON="$OUT/bwd2_bench.json"
MODE=${1:-all}
step() { echo; echo "=== $* ($(date +%T)) ==="; }
PYTEST="python3 -m pytest -q -p no:cacheprovider --tb=short -rfs"
{
  step gpu
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv
  if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    step "test_bwd autograd"
    timeout 90 $PYTEST tests/gpu/test_bwd.py -k "double_backward or autograd" 2>&1 | grep -vE "^\.+ *\[" | tail -30
    echo "test_bwd rc=$?"
    step test_bwd_variants
    timeout 180 $PYTEST tests/gpu/test_bwd_variants.py 2>&1 | grep -vE "^\.+ *\[" | tail -40
    echo "test_bwd_variants rc=$?"
    step test_bwd_op
    timeout 240 $PYTEST tests/gpu/test_bwd_op.py 2>&1 | grep -vE "^\.+ *\[" | tail -40
    echo "test_bwd_op rc=$?"
  fi
  if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
    step bench
    timeout 240 python3 experiments/bench_bwd_variants.py --out "$JSON" --n 8192 --reps 5 2>&1 | tail -30
    echo "bench rc=$?"
    [ -f "$JSON" ] && python3 experiments/bench_bwd_variants.py --table "$JSON"
  fi
} 2>&1 | tee "$LOG"
