#!/usr/bin/env bash
# Session 7, branch tracer (issue 19): the corpus of real mods (tests/corpus/) on one H100.
# Each spec at its published parameters: transferred, lowered onto fa3_sm90, verified on the GPU
# (verification rule at B=1 Hq=4 Hkv=2 N=2048 D=128), then timed at 8k (B=2, 32 q / 8 kv heads,
# D=128, bf16) round-robin beside FlexAttention (Triton) and FlexAttention's FLASH backend where
# it runs. Writes exactly two files under $OUT: corpus.json (rewritten after every spec, so a run
# cut by the timeout still reports) and corpus.log. The last lines are the table and a summary.
#
#   bash experiments/device_s7_tracer.sh           # 12 specs covering every source and mechanism
#                                                  # (about 40 s each: two compiles, verify, time)
#   PART=1 bash experiments/device_s7_tracer.sh    # the other 19 specs, first half
#   PART=2 bash experiments/device_s7_tracer.sh    # the other 19 specs, second half
#   bash experiments/device_s7_tracer.sh --specs gemma2_local t5_encoder_bias   # chosen specs
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
FIRST=(gemma2_local mistral_sliding_window ag_document_causal t5_encoder_bias bloom_alibi ag_prefix_lm
       ag_natten padded_causal streaming_sinks fa_local_softcap ag_dilated_sliding_window longformer_global)
mapfile -t REST < <(ls tests/corpus/[a-z]*.py | xargs -n1 basename | sed 's/\.py$//' | sort \
                    | grep -vxF -f <(printf '%s\n' "${FIRST[@]}"))
HALF=$(( (${#REST[@]} + 1) / 2 ))
case "${PART:-0}" in
  1) SPECS=("${REST[@]:0:$HALF}") ;;
  2) SPECS=("${REST[@]:$HALF}") ;;
  *) SPECS=("${FIRST[@]}") ;;
esac
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--specs "${SPECS[@]}")
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  echo "specs: ${ARGS[*]}"
  timeout ${BENCH_TIMEOUT:-540} python3 experiments/bench_corpus.py --out "$OUT/corpus.json" "${ARGS[@]}" 2>&1
  echo "exit: $?"
} > "$OUT/corpus.log" 2>&1
grep -v '^  File\|^    \|^Traceback' "$OUT/corpus.log" | tail -40
