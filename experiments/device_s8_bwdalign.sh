#!/usr/bin/env bash
# Session 8, branch bwdalign (issue 17): the backward kernels with queries end-aligned (row i at
# key position Nk - Nq + i, as the forwards), the variant backward at Nq < Nk, compute-sanitizer
# over both backward kernels, and the per-variant backward benchmark. One H100.
#
# Modes (each one device call, capped at BUDGET_S = 570 s in all: every step's timeout is the
# smaller of its own cap and what is left, so a slow step cannot push the call past 10 minutes):
#   quick   (default; the 01:00 run) in this order, correctness first:
#             tests/gpu/test_bwd.py          fa2_bwd_sm80 under the rule; its causal Nq != Nk
#                                            cases (q77-k300, q300-k77, ...) are issue 17's
#                                            acceptance test (25 failed before this branch)
#             tests/gpu/test_bwd_sm90.py     fa3_bwd_sm90 likewise (20 failed before)
#             compute-sanitizer memcheck, racecheck, synccheck over experiments/sanitize_bwd.py
#                                            (both backward kernels, both dQ modes, causal Nq < Nk
#                                            and Nq > Nk, two variant backwards; each case also
#                                            under the rule)
#             bench_bwd_variants.py at 8k    every variant vs Flex Triton / Flex FLASH, and relu /
#                                            sigmoid / composite vs eager autograd (issue 17's bars)
#           (8k only, not 1k + 8k: a FlexAttention compile per variant, backend and length does
#           not fit beside the tests in one call; 1k comes with `bench`)
#   tests   tests/gpu/test_bwd_variants.py (10 variants x 5 shapes, two with Nq < Nk) and
#           tests/gpu/test_bwd_op.py (loss.backward() through the tuned op), pytest -x per file
#   bench   the benchmark at 1k, 4k and 16k (the rest of issue 17's lengths; rows are written as
#           they come, so a cut run keeps what it measured)
# pytest runs with -x per file under its own timeout. Writes exactly two files under $OUT:
# bwdalign_log.txt and bwdalign_bench.json (quick / bench).
# Usage (device, repo root):  bash experiments/device_s8_bwdalign.sh [quick|tests|bench]
# What to expect: an "rc=0" line per pytest file; per sanitizer tool "rc=0", "ERROR SUMMARY: 0
# errors" and "all cases pass the rule"; then the summary and the bench table last (cubridge's
# bwd speedup over flex >= 1.3x and over flex_flash >= 1.1x are issue 17's bars; relu / sigmoid /
# composite >= 10x over eager_autograd).
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/bwdalign}
mkdir -p "$OUT"
LOG="$OUT/bwdalign_log.txt"
JSON="$OUT/bwdalign_bench.json"
MODE=${1:-quick}
BUDGET_S=${BUDGET_S:-570}
START=$(date +%s)
SCRATCH=$(mktemp -d)          # step outputs for the summary: not under $OUT
SUMMARY=()
step() { echo; echo "=== $* ($(date +%T), $(( $(date +%s) - START )) s in) ==="; }
left() { local l=$(( BUDGET_S - ($(date +%s) - START) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
PYTEST="python3 -m pytest -q -x -p no:cacheprovider --tb=short -rfs"

run_tests() {   # $1 file, $2 cap (s)
  local t; t=$(left "$2")
  step "pytest $1 (timeout ${t}s)"
  if [ "$t" -le 10 ]; then SUMMARY+=("$1: not run (budget spent)"); return; fi
  timeout "$t" $PYTEST "$1" > "$SCRATCH/pytest.txt" 2>&1
  local rc=$?
  grep -vE "^\.+ *\[|PASSED" "$SCRATCH/pytest.txt" | tail -45
  echo "$1 rc=$rc"
  local last; last=$(grep -E "passed|failed|error|skipped" "$SCRATCH/pytest.txt" | tail -1)
  [ "$rc" = 124 ] && last="TIMED OUT after ${t}s; $last"
  SUMMARY+=("$1: rc=$rc ${last}")
}

run_sanitizer() {   # $1 tool, $2 cap (s)
  local t; t=$(left "$2")
  step "compute-sanitizer --tool $1 (timeout ${t}s)"
  if [ "$t" -le 10 ]; then SUMMARY+=("sanitizer $1: not run (budget spent)"); return; fi
  timeout "$t" compute-sanitizer --tool "$1" --print-limit 20 --error-exitcode 9 \
    python3 experiments/sanitize_bwd.py > "$SCRATCH/san.txt" 2>&1
  local rc=$?
  grep -E "FAIL|ERROR|Error|error|sanitize_bwd:|Traceback" "$SCRATCH/san.txt" | tail -25
  tail -3 "$SCRATCH/san.txt"
  echo "$1 rc=$rc"
  SUMMARY+=("sanitizer $1: rc=$rc $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$SCRATCH/san.txt" | tail -1) \
$(grep -E "^sanitize_bwd:" "$SCRATCH/san.txt" | tail -1)")
}

run_bench() {   # $@ lengths
  local t; t=$(left 560)
  step "bench_bwd_variants --n $* (timeout ${t}s)"
  if [ "$t" -le 30 ]; then SUMMARY+=("bench --n $*: not run (budget spent)"); return; fi
  timeout "$t" python3 experiments/bench_bwd_variants.py --out "$JSON" --n "$@" --reps 10 2>&1 | tail -80
  SUMMARY+=("bench --n $*: rc=${PIPESTATUS[0]}")
}

{
  step "gpu, mode $MODE"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  git log --oneline -1
  if [ -f .fa4whl/env.sh ]; then source .fa4whl/env.sh || echo "FA4 pack not usable (rc=$?)"; fi
  python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash_attn.cute importable" \
    || echo "flash_attn.cute not importable: flex_flash will record its refusal"
  case "$MODE" in
    quick)
      run_tests tests/gpu/test_bwd.py 170
      run_tests tests/gpu/test_bwd_sm90.py 120
      for tool in memcheck racecheck synccheck; do run_sanitizer "$tool" 60; done
      run_bench 8192
      ;;
    tests)
      run_tests tests/gpu/test_bwd_variants.py 300
      run_tests tests/gpu/test_bwd_op.py 260
      ;;
    bench)
      run_bench 1024 4096 16384
      ;;
    *) echo "unknown mode $MODE (quick | tests | bench)"; exit 2 ;;
  esac
  step summary
  printf '%s\n' "${SUMMARY[@]}"
  if [ -f "$JSON" ]; then echo; python3 experiments/bench_bwd_variants.py --table "$JSON"; fi
} 2>&1 | tee "$LOG"
rm -rf "$SCRATCH"
