#!/usr/bin/env bash
# One device call (H100) for branch rtin: runtime inputs, the GPU block table, Nq < Nk.
#  1. tests/gpu/test_runtime_inputs.py: GPU table == host table (layouts, shapes, Nq < Nk, a mask
#     reading h, a captured table, a CUDA graph replayed on new ids); the document kernel under the
#     verification rule with two layouts in a row; causal / prefixlm / document / share_question /
#     relative_pos at Nq < Nk on fa3_sm90 and fa2_sm80; the reference kernels' own causal, end-aligned;
#  2. the GPU suites of the reference kernels, whose skeleton changed (queries end-aligned in
#     kernel.cu): test_fa3_sm90, test_fa2_sm80, test_lift (test_variants: the other scripts);
#  3. experiments/bench_document.py at 8k and 1k: ours (bind + GPU table + kernel per call) vs
#     FlexAttention (create_block_mask per batch + kernel).
# Writes two files under $OUT: rtin.json (the benchmark rows) and rtin.log (everything); prints
# the pass/fail lines and the benchmark table last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/rtin.log"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  echo "== tests/gpu/test_runtime_inputs.py"
  timeout 230 python3 -m pytest tests/gpu/test_runtime_inputs.py -q -p no:cacheprovider -rf 2>&1 | tail -30
  echo "== reference kernel suites (end-aligned skeleton)"
  timeout 200 python3 -m pytest tests/gpu/test_fa3_sm90.py tests/gpu/test_fa2_sm80.py tests/gpu/test_lift.py -q \
    -p no:cacheprovider -rf 2>&1 | tail -12
  echo "== experiments/bench_document.py"
  timeout 100 python3 experiments/bench_document.py --out "$OUT/rtin.json" 2>&1 | tail -20
} > "$LOG" 2>&1
grep -E "^== |passed|failed|error|FAILED|ERROR" "$LOG" | tail -30
echo "---- benchmark"
tail -4 "$LOG"
