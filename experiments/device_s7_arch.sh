#!/usr/bin/env bash
# Session 7, branch arch (issue 16): the GPU side of the refactor, on one H100.
#   1. tests/gpu files that cover what moved: the ReferenceKernel launcher contract for fa3_sm90,
#      fa2_sm80 and a toy third kernel (test_reference_kernels), the typed race job with its
#      binding data (test_race), the driver move and tile counter (test_fa3_sm90), the op's fast
#      path on runtime.driver (test_op);
#   2. a short cubridge-tune run end to end (KernelJob, binding data, ReferenceKernel launchers,
#      the one compile cache, named Optuna objectives): status, dispatch, ours vs the baselines.
# Writes two files under $OUT: arch_results.json and arch.log; prints a short table last.
#   usage (repo root, GPU):  OUT=/tmp/arch bash experiments/device_s7_arch.sh
set -uo pipefail
OUT=${OUT:-/tmp/s7_arch}; mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUBRIDGE_CACHE_DIR="$WORK/cache"
LOG="$OUT/arch.log"
PAR=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6")     # parallel workers where pytest-xdist is
: > "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$LOG" 2>&1

# ---- 1. GPU tests (compile-bound: parallel workers), each file's summary line kept
for f in tests/gpu/test_reference_kernels.py tests/gpu/test_race.py tests/gpu/test_fa3_sm90.py tests/gpu/test_op.py; do
  echo "=== $f ($(date -u +%H:%M:%S))" >> "$LOG"
  timeout 300 python3 -m pytest "$f" -q $PAR -p no:cacheprovider > "$WORK/pytest.txt" 2>&1
  echo "rc=$?" >> "$WORK/pytest.txt"
  tail -30 "$WORK/pytest.txt" >> "$LOG"
  grep -E "passed|failed|skipped|error|no tests ran|^rc=" "$WORK/pytest.txt" | tail -2 | tr '\n' ' ' \
    | sed "s|^|$f\t|" >> "$WORK/tests.tsv"
  echo >> "$WORK/tests.tsv"
done

# ---- 2. a short tune run (one shape pair, a few trials)
cat > "$WORK/arch_tune.yaml" <<EOF
name: arch_prefixlm
spec: prefixlm
reference: fa3_sm90
arch: sm_90a
shapes: {heads_q: 16, heads_kv: 16, head_dim: 128, lengths: [1024, 8192], tokens: 16384}
budget: {trials: 5, minutes: 4}
output: $WORK/tune
EOF
echo "=== tune ($(date -u +%H:%M:%S))" >> "$LOG"
timeout 240 python3 -m cubridge.cli tune "$WORK/arch_tune.yaml" -v >> "$LOG" 2>&1
echo "tune rc=$?" >> "$LOG"

# ---- results
python3 - "$WORK" "$OUT/arch_results.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
work, dest = Path(sys.argv[1]), Path(sys.argv[2])
tests = [line.split("\t", 1) for line in (work / "tests.tsv").read_text().splitlines() if "\t" in line]
res = {"tests": {f: s.strip() for f, s in tests}}
man = work / "tune" / "manifest.json"
if man.is_file():
    m = json.loads(man.read_text())
    res["tune"] = {"status": m["status"], "message": m["message"], "trials": m["trials"], "rows": m["timings"]["rows"],
                   "device": (m.get("device") or {}).get("name")}
    try:
        import optuna
        st = optuna.load_study(study_name=f"{m['name']}-{m['search_key']}", storage=f"sqlite:///{work / 'tune' / 'study.db'}")
        res["tune"]["metric_names"] = st.metric_names
        res["tune"]["study_attrs"] = sorted(st.user_attrs)
    except Exception as e:   # noqa: BLE001 - reported, not fatal
        res["tune"]["study_error"] = f"{type(e).__name__}: {e}"
else:
    res["tune"] = {"status": "no manifest (see arch.log)"}
dest.write_text(json.dumps(res, indent=1, default=str))
print("\n== arch (issue 16) on the GPU")
for f, s in res["tests"].items():
    print(f"{f:<40} {s}")
t = res["tune"]
print(f"tune: {t.get('status')}: {t.get('message', '')}")
for r in t.get("rows") or []:
    ours = r.get("ours_tflops")
    base = {k: v.get("tflops") for k, v in (r.get("baselines") or {}).items()}
    print(f"  {r.get('shape')}: ours {ours if ours is None else round(ours, 1)} TFLOPS "
          f"({r.get('label')}); " + ", ".join(f"{k} {v:.1f}" for k, v in base.items() if v))
print(f"  objectives: {t.get('metric_names')}")
PY
rm -rf "$WORK"
