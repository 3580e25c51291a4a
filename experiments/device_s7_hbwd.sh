#!/usr/bin/env bash
# Session 7, branch hbwd (issue 17): one device call for the Hopper backward ref_kernels/fa3_bwd_sm90.
#   1. tests/gpu/test_bwd_sm90.py: the verification rule on dQ, dK, dV (float64 autograd golden,
#      kernel-dtype ref), poisoned outputs, unchanged inputs, ragged 77 / 300 / 1000, MHA / GQA /
#      MQA, fp16 / bf16, D 64 / 128, causal and full, the autograd hook (CUBRIDGE_HOPPER_BWD=1)
#   2. compute-sanitizer memcheck, racecheck and synccheck on bench_bwd_sm90.py --sanitize-case
#   3. bench_bwd_sm90.py: fa3_bwd_sm90 vs fa2_bwd_sm80, SDPA cuDNN, FA4 (if its pack is unpacked),
#      causal / full at 8k and 1k, D = 128 bf16, 32 heads, 16k tokens; its table printed last
# Writes exactly two files under $OUT: hbwd_bench.json and hbwd_log.txt.
# Usage (device, repo root):  OUT=/tmp/hbwd bash experiments/device_s7_hbwd.sh [all|tests|bench]
#   all: <= 90 s build + 220 s tests + 3 x 35 s sanitizer + 180 s bench (each capped): < 10 minutes.
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/hbwd}
mkdir -p "$OUT"
LOG="$OUT/hbwd_log.txt"
JSON="$OUT/hbwd_bench.json"
MODE=${1:-all}
step() { echo; echo "=== $* ($(date +%T)) ==="; }
{
  step gpu
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  if [ -f .fa4whl/env.sh ]; then source .fa4whl/env.sh || echo "FA4 not available (rc=$?)"; fi
  step build
  timeout 90 python3 -c "
from concurrent.futures import ThreadPoolExecutor
import torch
from cubridge.runtime import fa3_bwd_sm90 as m
from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
from cubridge.runtime.launch import device_arch
arch = device_arch(torch.device('cuda'))
specs = [(d, c, b) for d in (64, 128) for c in (False, True) for b in (False, True)]
helper = Fa2BwdSm80()   # its preprocess / dQ convert kernels run around ours
with ThreadPoolExecutor(8) as pool:
    hs = [pool.submit(helper.build, d, t, False, False, arch) for d in (64, 128) for t in (torch.float16, torch.bfloat16)]
    rs = list(pool.map(lambda s: m.build_cubin(*s), specs))
    [h.result() for h in hs]
for s, r in zip(specs, rs):
    print(f'D={s[0]} causal={s[1]} bf16={s[2]}: {len(r.cubin)} bytes' + (' (cached)' if r.cached else ''))
" 2>&1 | tail -12
  if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    step tests
    # -x: a kernel that hangs or faults once would only repeat it; the first failure is the news
    timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -x -p no:cacheprovider --tb=short -rfs \
      tests/gpu/test_bwd_sm90.py 2>&1 | grep -vE "^\.+ *\[|PASSED" | tail -60
    echo "tests rc=${PIPESTATUS[0]}"
    step sanitizer
    SAN="compute-sanitizer --print-limit 20 --error-exitcode 9"
    for tool in memcheck racecheck synccheck; do
      timeout 35 $SAN --tool $tool python3 experiments/bench_bwd_sm90.py --sanitize-case 2>&1 | tail -6
      echo "$tool rc=${PIPESTATUS[0]}"
    done
  fi
  if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
    step bench
    timeout ${BENCH_TIMEOUT:-180} python3 experiments/bench_bwd_sm90.py --out "$JSON" --reps 15 2>&1 \
      | grep -vE "^\| " | tail -30
    echo "bench rc=${PIPESTATUS[0]}"
    [ -f "$JSON" ] && python3 experiments/bench_bwd_sm90.py --table "$JSON"
  fi
} 2>&1 | tee "$LOG"
