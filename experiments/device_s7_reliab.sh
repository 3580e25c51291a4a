#!/usr/bin/env bash
# Session 7, branch reliab (issue 20) on one H100: the GPU half of the adversarial corpus and of
# race detection. Writes $OUT/reliab.json (one row per step) and $OUT/reliab.log; prints a table last.
#   usage (repo root, GPU):  OUT=/tmp/out bash experiments/device_s7_reliab.sh
# Steps: (1) tests/gpu/test_adversarial.py - output cheats rejected, unpatched kernel passes;
# (2) the sanitize cases without a tool (build every kernel once, rule-checked); (3) the same cases
# under compute-sanitizer racecheck, synccheck and memcheck (exit 9 on a finding).
set -uo pipefail
OUT=${OUT:-/tmp/s7_reliab}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
LOG="$OUT/reliab.log"; : > "$LOG"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
ROWS=()
step() {   # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $* ($(date -u +%H:%M:%S))" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc" >> "$LOG"
  ROWS+=("$name|$rc|$((SECONDS - t0))|$(grep -E 'passed|failed|skipped|error|sanitize cases|ERROR SUMMARY' "$LOG" | tail -1 | tr -d '|"\\')")
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$LOG" 2>&1
step adversarial_gpu 300 python3 -m pytest tests/gpu/test_adversarial.py -q -p no:cacheprovider
step sanitize_cases 240 python3 experiments/sanitize_variants.py
if [ -n "$CS" ]; then
  for tool in racecheck synccheck memcheck; do
    step "$tool" 300 "$CS" --tool "$tool" --error-exitcode 9 python3 experiments/sanitize_variants.py
  done
else
  ROWS+=("compute-sanitizer|127|0|not found on this machine")
fi
python3 - "$OUT/reliab.json" "${ROWS[@]}" <<'PY'
import json, sys
rows = [dict(zip(("step", "rc", "seconds", "last_line"), r.split("|", 3))) for r in sys.argv[2:]]
json.dump({"rows": rows, "ok": all(r["rc"] == "0" for r in rows)}, open(sys.argv[1], "w"), indent=1)
print(f"{'step':<18} {'rc':>3} {'s':>5}  last line")
for r in rows:
    print(f"{r['step']:<18} {r['rc']:>3} {r['seconds']:>5}  {r['last_line'][:90]}")
PY
