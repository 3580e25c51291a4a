#!/usr/bin/env bash
# Session 7, branch d256 (issue 19 item 3): head dim 256 on fa3_sm90 on an H100. Writes two files
# under $OUT: d256_s7.json (the benchmark) and d256_s7.log (everything printed). Prints a table last.
#
#   usage (repo root, H100):  bash experiments/device_s7_d256.sh [tests] [bench]   (default: both)
#   tests: tests/gpu/test_fa3_sm90_d256.py (dense causal / full at 128x80 and 128x64, ragged,
#          MHA / GQA 16/8 / MQA, few CTAs; Gemma-2 softcap 50 + window, 16/8 heads, N past the
#          window): ~2-4 min, most of it nvcc (8 configs) and float64 goldens
#   bench: experiments/bench_d256.py: dense causal D256 and Gemma-2 local at B=2, N=8192, bf16,
#          ours (128x80, 128x64) beside FA4 / SDPA cuDNN / SDPA flash / Flex FLASH / Flex: ~3-5 min
#          (FA4 and Flex compile on first call)
# FA4: sourced from .fa4whl/env.sh where carried (or unpacked from .fa4libs as device_s7_fa4.sh
# does); without it FA4 is recorded as skipped with the import error.
set -uo pipefail
OUT=${OUT:-/tmp/d256_s7_out}
mkdir -p "$OUT"
LOG="$OUT/d256_s7.log"
JSON="$OUT/d256_s7.json"
exec > >(tee -a "$LOG") 2>&1
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
START=$(date +%s)
BUDGET=${BUDGET:-570}
left() { local want=$1 rest=$((BUDGET - 20 - ($(date +%s) - START))); echo $((want < rest ? want : rest)); }
run_for() {   # run_for SECONDS CMD...: skip with a note when under a minute is left
  local t; t=$(left "$1"); shift
  if [ "$t" -lt 60 ]; then echo "skipped (only ${t}s of the call left): $*"; return; fi
  timeout "$t" "$@"
}
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(tests bench)

step "environment"
if [ -f .fa4whl/env.sh ]; then
  source .fa4whl/env.sh || echo "FA4: .fa4whl/env.sh failed"
elif [ -f .fa4libs/unpack.sh ]; then
  bash .fa4libs/unpack.sh && source .fa4whl/env.sh || echo "FA4 unavailable: unpack failed"
else
  echo "FA4: no .fa4whl / .fa4libs carried; bench records it as skipped if flash_attn.cute does not import"
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cubridge; print('torch', torch.__version__, 'cubridge from', cubridge.__file__)"
python3 -c "import flash_attn.cute; print('flash_attn.cute imports')" 2>&1 | tail -1

TESTS_RC=not_run
for stage in "${STAGES[@]}"; do
  case $stage in
    tests)
      step "pytest tests/gpu/test_fa3_sm90_d256.py"
      run_for 330 python3 -m pytest tests/gpu/test_fa3_sm90_d256.py -q --maxfail=3 -p no:cacheprovider 2>&1 | tail -25
      TESTS_RC=${PIPESTATUS[0]} ;;
    bench)
      step "bench_d256: dense causal D256 and Gemma-2 local, B=2 N=8192 bf16"
      run_for 420 python3 experiments/bench_d256.py --out "$JSON" 2>&1 | tail -40 ;;
    *) echo "error: device_s7_d256.sh: unknown stage '$stage' (tests, bench)"; exit 2 ;;
  esac
done

step "summary"
echo "tests exit status: $TESTS_RC (0 = all passed)"
if [ -f "$JSON" ]; then
  JSON_ABS=$(realpath "$JSON")
  (cd experiments && python3 -c "
import json
from bench_d256 import table      # run from experiments/, its folder: no sys.path edit
print(table(json.load(open('$JSON_ABS'))))")
else
  echo "no benchmark JSON (bench not run or it failed before the first shape)"
fi
