#!/usr/bin/env bash
# Session 8, branch hbwdperf (issue 17): the Hopper backward's performance options, one H100.
# cubridge.runtime.fa3_bwd_sm90.OPTIONS: base (the session-7 kernel: per-thread dQ atomics), bulk
# (dQ through shared memory + one bulk reduce-add per consumer and step), bulk_overlap (bulk + the
# overlapped step order). In this order, correctness first, each step under its own timeout and the
# whole call under BUDGET_S (every cap is the smaller of its own and what is left):
#   1. build every option x (D 64 / 128, causal / full, fp16 / bf16): 24 cubins (ptxas spills are
#      checked on the CPU: tests/cpu/test_fa3_bwd_sm90_build.py)
#   2. tests/gpu/test_bwd_sm90.py once per option (CUBRIDGE_BWD_OPTIONS=<option>, pytest -x):
#      the verification rule on dQ / dK / dV, poisoned outputs, unchanged inputs, ragged causal
#      Nq != Nk both ways, MHA / GQA / MQA, fp16 / bf16, D 64 / 128
#   3. bench_bwd_options.py: every option beside fa2_bwd_sm80, SDPA cuDNN and FA4 (when its pack is
#      carried: .fa4whl/env.sh), round-robin in one process, causal / full at 8k, 16k, 1k
#      (D = 128 bf16, 32 heads, 16k tokens); rows written after every shape
#   4. compute-sanitizer racecheck, then memcheck, over sanitize_bwd.py --only fa3_bwd_sm90 for the
#      two new options (last: the bench matters more if the budget runs short)
# Writes exactly two files under $OUT: hbwdperf_log.txt and hbwdperf_bench.json.
# Usage (device, repo root):  OUT=/tmp/o bash experiments/device_s8_hbwdperf.sh [all|tests|bench]
# What to expect: per option "rc=0 ... passed"; per sanitizer run "rc=0", "ERROR SUMMARY: 0 errors"
# and "all cases pass the rule"; the table last: one column per option (ours[...]) beside
# fa2_bwd_sm80, sdpa_cudnn, fa4, and "best ours / fa4" (issue 17's bar: >= 1.0 at 8k causal / full).
# A row marked WRONG disagrees with cuDNN's gradients by > 5% (its timing means nothing).
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/hbwdperf}
mkdir -p "$OUT"
LOG="$OUT/hbwdperf_log.txt"
JSON="$OUT/hbwdperf_bench.json"
MODE=${1:-all}
BUDGET_S=${BUDGET_S:-570}
OPTS="base bulk bulk_overlap"
START=$(date +%s)
SCRATCH=$(mktemp -d)          # step outputs for the summary: not under $OUT
SUMMARY=()
step() { echo; echo "=== $* ($(date +%T), $(( $(date +%s) - START )) s in) ==="; }
left() { local l=$(( BUDGET_S - ($(date +%s) - START) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }

build_all() {
  local t; t=$(left 150)
  step "build (timeout ${t}s)"
  timeout "$t" python3 - <<'EOF' 2>&1 | tail -30
from concurrent.futures import ThreadPoolExecutor
import torch
from cubridge.runtime import fa3_bwd_sm90 as m
from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
from cubridge.runtime.launch import device_arch
arch = device_arch(torch.device("cuda"))
specs = [(o, d, c, b) for o in m.OPTIONS for d in (64, 128) for c in (False, True) for b in (False, True)]
helper = Fa2BwdSm80()   # its preprocess / dQ convert kernels run around ours
def build(s):
    o, d, c, b = s
    return m.build_cubin(d, c, b, option=o)
with ThreadPoolExecutor(8) as pool:
    hs = [pool.submit(helper.build, d, t, False, False, arch) for d in (64, 128) for t in (torch.float16, torch.bfloat16)]
    rs = list(pool.map(build, specs))
    [h.result() for h in hs]
for s, r in zip(specs, rs):
    print(f"{s[0]:13s} D={s[1]} causal={int(s[2])} bf16={int(s[3])}: {len(r.cubin)} bytes"
          + (" (cached)" if r.cached else ""))
EOF
  SUMMARY+=("build: rc=${PIPESTATUS[0]}")
}

run_tests() {   # $1 option, $2 cap (s)
  local t; t=$(left "$2")
  step "pytest test_bwd_sm90.py option $1 (timeout ${t}s)"
  if [ "$t" -le 10 ]; then SUMMARY+=("tests $1: not run (budget spent)"); return; fi
  CUBRIDGE_BWD_OPTIONS=$1 timeout "$t" python3 -m pytest -q -x -p no:cacheprovider --tb=short -rfs \
    tests/gpu/test_bwd_sm90.py > "$SCRATCH/pytest.txt" 2>&1
  local rc=$?
  grep -vE "^\.+ *\[|PASSED" "$SCRATCH/pytest.txt" | tail -30
  echo "tests $1 rc=$rc"
  local last; last=$(grep -E "passed|failed|error|skipped" "$SCRATCH/pytest.txt" | tail -1)
  [ "$rc" = 124 ] && last="TIMED OUT after ${t}s; $last"
  SUMMARY+=("tests $1: rc=$rc ${last}")
}

run_bench() {   # $@ lengths
  local t; t=$(left 240)
  step "bench_bwd_options --n $* (timeout ${t}s)"
  if [ "$t" -le 30 ]; then SUMMARY+=("bench: not run (budget spent)"); return; fi
  timeout "$t" python3 experiments/bench_bwd_options.py --out "$JSON" --n "$@" --reps 10 2>&1 \
    | grep -vE "^\| |UserWarning|generate_mlir_function_types" | tail -60
  SUMMARY+=("bench --n $*: rc=${PIPESTATUS[0]}")
}

run_sanitizer() {   # $1 tool, $2 option, $3 cap (s)
  local t; t=$(left "$3")
  step "compute-sanitizer --tool $1, option $2 (timeout ${t}s)"
  if [ "$t" -le 15 ]; then SUMMARY+=("sanitizer $1 $2: not run (budget spent)"); return; fi
  timeout "$t" compute-sanitizer --tool "$1" --print-limit 20 --error-exitcode 9 \
    python3 experiments/sanitize_bwd.py --only fa3_bwd_sm90 --fa3-option "$2" > "$SCRATCH/san.txt" 2>&1
  local rc=$?
  grep -E "FAIL|ERROR|Error|error|sanitize_bwd:|Traceback" "$SCRATCH/san.txt" | tail -20
  echo "$1 $2 rc=$rc"
  SUMMARY+=("sanitizer $1 $2: rc=$rc $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$SCRATCH/san.txt" | tail -1) \
$(grep -E "^sanitize_bwd:" "$SCRATCH/san.txt" | tail -1)")
}

{
  step "gpu, mode $MODE"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  git log --oneline -1
  if [ -f .fa4whl/env.sh ]; then source .fa4whl/env.sh || echo "FA4 pack not usable (rc=$?)"; fi
  python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash_attn.cute importable" \
    || echo "flash_attn.cute not importable: the fa4 column will be missing"
  build_all
  if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    for o in $OPTS; do run_tests "$o" 110; done
  fi
  if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
    run_bench 8192 16384 1024
  fi
  if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    for run in "racecheck bulk_overlap" "racecheck bulk" "memcheck bulk_overlap" "memcheck bulk"; do
      run_sanitizer $run 45
    done
  fi
  step summary
  printf '%s\n' "${SUMMARY[@]}"
  if [ -f "$JSON" ]; then echo; python3 experiments/bench_bwd_options.py --table "$JSON"; fi
} 2>&1 | tee "$LOG"
rm -rf "$SCRATCH"
