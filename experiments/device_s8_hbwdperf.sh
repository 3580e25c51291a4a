#!/usr/bin/env bash
# Session 8, branch hbwdperf (issue 17): the Hopper backward's performance options, one H100.
# cubridge.runtime.fa3_bwd_sm90.OPTIONS: base (the session-7 kernel: per-thread dQ atomics), bulk
# (dQ through shared memory + one bulk reduce-add per consumer and step), bulk_overlap (bulk + the
# overlapped step order), bulk_overlap_lse (+ LSE / Dvec staged in shared memory by the producer),
# bulk_overlap_lse_lpt (+ the KV tile in blockIdx.z: causal's longest tiles dispatched first).
# In this order, correctness first, each step under its own timeout and the
# whole call under BUDGET_S (every cap is the smaller of its own and what is left):
#   1. build every option x (D 64 / 128, causal / full, fp16 / bf16): 40 cubins (ptxas spills are
#      checked on the CPU: tests/cpu/test_fa3_bwd_sm90_build.py)
#   2. tests/gpu/test_bwd_sm90.py once per option (CUBRIDGE_BWD_OPTIONS=<option>, pytest -x), the
#      options' processes side by side (correctness only):
#      the verification rule on dQ / dK / dV, poisoned outputs, unchanged inputs, ragged causal
#      Nq != Nk both ways, MHA / GQA / MQA, fp16 / bf16, D 64 / 128
#   3. bench_bwd_options.py: the options whose tests did not hang or fault (all in `bench` mode)
#      beside fa2_bwd_sm80, SDPA cuDNN and FA4 (when its pack is carried: .fa4whl/env.sh),
#      round-robin in one process, causal / full at 8k, 16k, 1k (D = 128 bf16, 32 heads, 16k
#      tokens); rows written after every shape
#   4. compute-sanitizer over sanitize_bwd.py --only fa3_bwd_sm90: racecheck bulk_overlap_lse,
#      racecheck bulk, memcheck bulk_overlap_lse (last: the bench matters more if the budget runs
#      short; each run is skipped when less than 15 s are left)
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
OPTS="base bulk bulk_overlap bulk_overlap_lse bulk_overlap_lse_lpt"
START=$(date +%s)
SCRATCH=$(mktemp -d)          # step outputs for the summary: not under $OUT
SUMMARY=()
BENCH_OPTS=()                 # options the bench times: all in `bench` mode, else those not faulting
step() { echo; echo "=== $* ($(date +%T), $(( $(date +%s) - START )) s in) ==="; }
left() { local l=$(( BUDGET_S - ($(date +%s) - START) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }

build_all() {
  local t; t=$(left 180)
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
# the forward (fa3_sm90) configs the tests and the bench will ask for (default_config keys on Nq):
# built once here rather than by five test processes at the same time
from cubridge.runtime import fa3_sm90
lengths = (1, 77, 128, 300, 333, 517, 700, 900, 1000, 2048, 8192, 16384)
fwd = {fa3_sm90.default_config(d, c, b, seqlen=n) for d in (64, 128) for c in (False, True)
       for b in (False, True) for n in lengths}
with ThreadPoolExecutor(12) as pool:   # 16 CPU cores on the device machine
    hs = [pool.submit(helper.build, d, t, False, False, arch) for d in (64, 128) for t in (torch.float16, torch.bfloat16)]
    fs = [pool.submit(fa3_sm90.build_cubin, cfg) for cfg in fwd]
    rs = list(pool.map(build, specs))
    [h.result() for h in hs + fs]
print(f"{len(fwd)} forward configs built")
for s, r in zip(specs, rs):
    print(f"{s[0]:13s} D={s[1]} causal={int(s[2])} bf16={int(s[3])}: {len(r.cubin)} bytes"
          + (" (cached)" if r.cached else ""))
EOF
  SUMMARY+=("build: rc=${PIPESTATUS[0]}")
}

run_tests() {   # $1 cap (s): one pytest process per option, all at once (correctness only, not
  # timing; separate processes, so a fault in one option's kernel cannot take the others along)
  local t; t=$(left "$1")
  step "pytest test_bwd_sm90.py, one process per option: $OPTS (timeout ${t}s each, concurrent)"
  if [ "$t" -le 10 ]; then SUMMARY+=("tests: not run (budget spent)"); return; fi
  local o pids=()
  for o in $OPTS; do
    CUBRIDGE_BWD_OPTIONS=$o timeout "$t" python3 -m pytest -q -x -p no:cacheprovider --tb=short -rfs \
      tests/gpu/test_bwd_sm90.py > "$SCRATCH/pytest_$o.txt" 2>&1 &
    pids+=($!)
  done
  local i=0 rc last
  for o in $OPTS; do
    wait "${pids[$i]}"; rc=$?; i=$((i + 1))
    echo; echo "--- option $o"
    grep -vE "^\.+ *\[|PASSED" "$SCRATCH/pytest_$o.txt" | tail -25
    echo "tests $o rc=$rc"
    last=$(grep -E "passed|failed|error|skipped" "$SCRATCH/pytest_$o.txt" | tail -1)
    [ "$rc" = 124 ] && last="TIMED OUT after ${t}s; $last"
    SUMMARY+=("tests $o: rc=$rc ${last}")
    # benched unless it hung or faulted (a fault kills the CUDA context of the one bench process);
    # an option that only failed the rule is still timed (its rows say WRONG if far off)
    if [ "$rc" = 0 ] || { [ "$rc" = 1 ] && ! grep -qiE "CUDA error|illegal|unspecified launch|misaligned" \
        "$SCRATCH/pytest_$o.txt"; }; then BENCH_OPTS+=("$o"); else echo "option $o left out of the bench"; fi
  done
}

run_bench() {   # $@ lengths
  local t; t=$(left 240)
  step "bench_bwd_options --n $* (timeout ${t}s)"
  if [ "$t" -le 30 ]; then SUMMARY+=("bench: not run (budget spent)"); return; fi
  echo "options benched: ${BENCH_OPTS[*]}"
  timeout "$t" python3 experiments/bench_bwd_options.py --out "$JSON" --n "$@" --reps 10 \
    --options "${BENCH_OPTS[@]}" 2>&1 \
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
    run_tests 200
  else
    read -r -a BENCH_OPTS <<< "$OPTS"
  fi
  [ ${#BENCH_OPTS[@]} -gt 0 ] || BENCH_OPTS=(base)
  if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
    run_bench 8192 16384 1024
  fi
  if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    for run in "racecheck bulk_overlap_lse" "racecheck bulk" "memcheck bulk_overlap_lse"; do
      run_sanitizer $run 45
    done
  fi
  step summary
  printf '%s\n' "${SUMMARY[@]}"
  if [ -f "$JSON" ]; then echo; python3 experiments/bench_bwd_options.py --table "$JSON"; fi
} 2>&1 | tee "$LOG"
rm -rf "$SCRATCH"
