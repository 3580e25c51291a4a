#!/usr/bin/env bash
# Session 8, branch reliab2 (issues 20 and 19) on one H100. Writes exactly two files under $OUT:
# reliab2.json (one row per step, with the gpu_check_cases and corpus results inside; rewritten
# after every step, so a run cut short still reports) and reliab2.log; prints a table last.
#   usage (repo root, GPU):  OUT=/tmp/out DEADLINE_S=420 bash experiments/device_s8_reliab2.sh
#   QUICK=0 runs the corpus bench on 12 specs (give it DEADLINE_S=590; experiments/
#   device_s7_tracer.sh runs the whole corpus in three parts)
# Steps, most important first, each limited to min(its own limit, what is left of DEADLINE_S):
# (1) experiments/gpu_check_cases.py: the tuner's GPU check (O and LSE, Nq < Nk, GQA / MQA, the
#     KV ring, the structure length, the block-table path) passes on 6 lowered variants of both
#     kernels (6 nvcc builds in parallel), and rejects three negative controls (LSE + 5, keys cut
#     to Nq, a 4096 window ignored);
# (2) tests/gpu/test_adversarial.py: output cheats rejected, the unpatched kernel passes; and
#     tests/gpu/test_gpu_check_depth.py (the causal builds of (1) come from the compile cache);
# (3) experiments/bench_corpus.py (never run before; session 7's device_s7_tracer.sh): corpus
#     specs verified on the GPU and timed beside FlexAttention; QUICK (default) runs 3 specs.
set -uo pipefail
OUT=${OUT:-/tmp/s8_reliab2}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
DEADLINE_S=${DEADLINE_S:-420}
START=$SECONDS
LOG="$OUT/reliab2.log"; : > "$LOG"
TMP=$(mktemp -d)                     # step results, merged into reliab2.json after every step
ROWS=()
summarize() {
  python3 - "$OUT/reliab2.json" "$TMP" "${ROWS[@]}" <<'PY'
import json, sys
from pathlib import Path
out, tmp = sys.argv[1], Path(sys.argv[2])
rows = [dict(zip(("step", "rc", "seconds", "last_line"), r.split("|", 3))) for r in sys.argv[3:]]
result = {"rows": rows, "ok": all(r["rc"] == "0" for r in rows)}
for name in ("gpu_check_cases", "corpus"):
    p = tmp / f"{name}.json"
    try:
        result[name] = json.loads(p.read_text()) if p.is_file() else None
    except ValueError:
        result[name] = None
Path(out).write_text(json.dumps(result, indent=1))
PY
}
step() {   # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((DEADLINE_S - (SECONDS - START) - 15))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then ROWS+=("$name|124|0|skipped: ${left}s left of DEADLINE_S"); summarize; return; fi
  echo "=== $name: $* ($(date -u +%H:%M:%S), limit ${limit}s)" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc" >> "$LOG"
  ROWS+=("$name|$rc|$((SECONDS - t0))|$(grep -vE '^(===|  File|    |Traceback)' "$LOG" | tail -1 | tr -d '|"\\')")
  summarize
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader >> "$LOG" 2>&1
step gpu_check_cases 240 python3 experiments/gpu_check_cases.py --out "$TMP/gpu_check_cases.json"
step adversarial_gpu 150 python3 -m pytest tests/gpu/test_adversarial.py tests/gpu/test_gpu_check_depth.py -q -p no:cacheprovider
if [ "${QUICK:-1}" = 1 ]; then
  SPECS=(gemma2_local ag_document_causal mistral_sliding_window)
else
  SPECS=(gemma2_local mistral_sliding_window ag_document_causal t5_encoder_bias bloom_alibi ag_prefix_lm
         ag_natten padded_causal streaming_sinks fa_local_softcap ag_dilated_sliding_window longformer_global)
fi
step corpus_bench 400 python3 experiments/bench_corpus.py --out "$TMP/corpus.json" --reps 10 --specs "${SPECS[@]}"
python3 - "$OUT/reliab2.json" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
print(f"{'step':<18} {'rc':>3} {'s':>5}  last line")
for r in result["rows"]:
    print(f"{r['step']:<18} {r['rc']:>3} {r['seconds']:>5}  {r['last_line'][:90]}")
g = result["gpu_check_cases"] or {}
for r in g.get("rows", []):
    print(f"  check {r['kernel']:<9} {r['spec']:<24} {r['point']:<12} table={r['block_table']!s:<5} "
          f"S={r.get('structure_length')} {r.get('error') or r.get('failed') or 'pass'}"[:150])
for c in g.get("controls", []):
    print(f"  control {c['control']:<16} rejected={c['rejected']}  {(c.get('failed') or c.get('error') or '')[:90]}")
for r in (result["corpus"] or {}).get("rows", []):
    print(f"  corpus {r['spec']:<24} verify={r['verify']['passed']} ours={r.get('cubridge_ms')} "
          f"x_triton={r.get('speedup_vs_flex_triton')} x_flash={r.get('speedup_vs_flex_flash')} count_s={r.get('count_s')}")
PY
rm -rf "$TMP"
