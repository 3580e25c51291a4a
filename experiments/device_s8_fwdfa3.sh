#!/usr/bin/env bash
# Session 8, branch fwdfa3 (issues 15, 16, 19): the Hopper forward kernel's 4-D TMA maps (q, k, v
# and O read / written in place in [B, H, N, D] and [B, N, H, D] memory), the D 256 fix (a tile
# with no KV tile takes the Q slot its zero O is staged in), the experiment knobs moved out.
# One device call on an H100 (BUDGET seconds, default 570). Writes two files under $OUT:
# fwdfa3${TAG}.json (test summaries, the Llama rows) and fwdfa3${TAG}.log (everything printed),
# TAG empty unless set (e.g. TAG=_llama when the stages run as separate jobs of device_s8.sh).
# Table last.
#
#   usage (repo root):  bash experiments/device_s8_fwdfa3.sh [build] [focus] [llama] [full]
#   as device_s8.sh jobs (the stages are independent; focus and full need build's cache or compile):
#     fwdfa3_focus<TAB>300<TAB>TAG=_focus BUDGET=290 bash experiments/device_s8_fwdfa3.sh build focus
#     fwdfa3_llama<TAB>220<TAB>TAG=_llama BUDGET=210 bash experiments/device_s8_fwdfa3.sh llama
#   build: every kernel config the tests use, compiled in parallel (later builds hit the cache)
#   focus: what this branch changed, first and -x per file: test_d256_ragged (the bug), the strided
#          memory / refusal / Q-slot tests of test_fa3_sm90.py, test_op.py's layout tests
#   llama: experiments/llama_client.py (issue 15): causal 2k / 8k vs SDPA, prefixlm 8k vs SDPA +
#          bool mask and FlexAttention (FLASH where it runs); logits under the verification rule.
#          Session 7 before this branch (op NOTES): causal 0.98x / 0.97x SDPA, prefixlm 1.40x SDPA
#          + mask, 0.94x Flex FLASH (the input copies this branch removes were ~2% of the forward)
#   full:  the four touched files whole, pytest -x per file, with what time is left
#          (test_fa3_sm90.py, test_fa3_sm90_d256.py, test_op.py, test_runtime_inputs.py)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fwdfa3_out}
mkdir -p "$OUT"
LOG="$OUT/fwdfa3${TAG:-}.log"
WORK=$(mktemp -d /tmp/fwdfa3.XXXX)
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
BUDGET=${BUDGET:-570}
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), $(( $(date +%s) - START )) s in)"; }
left() { local want=$1 rest=$((BUDGET - 25 - ($(date +%s) - START))); echo $((want < rest ? want : rest)); }
run_for() {   # run_for SECONDS NAME CMD...: the command's exit status into $WORK/NAME.rc, output tail kept
  local t name=$2; t=$(left "$1"); shift 2
  if [ "$t" -lt 45 ]; then echo "skipped (only ${t}s of the call left): $*"; echo skipped > "$WORK/$name.rc"; return; fi
  timeout "$t" "$@" > "$WORK/$name.out" 2>&1
  echo $? > "$WORK/$name.rc"
  tail -30 "$WORK/$name.out"
}
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(build focus llama full)
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PYTEST=(python3 -m pytest -q -x -p no:cacheprovider -rfE)
export CUBRIDGE_OP_RUNS="$WORK/op_runs"

step "environment"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cubridge; print('torch', torch.__version__, 'cubridge from', cubridge.__file__)"
python3 -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
git log --oneline -1 2>/dev/null || true

for stage in "${STAGES[@]}"; do
  case $stage in
    build)
      step "build: the test configs, in parallel"
      run_for 150 build env PYTHONPATH="tests/gpu:$PYTHONPATH" python3 - <<'PY'
import time
from concurrent.futures import ThreadPoolExecutor
from cubridge.runtime.fa3_sm90 import Fa3Config, build_cubin, default_config
import test_fa3_sm90 as t
cfgs = {default_config(d, c, bf, n) for d in (64, 128, 256) for c in (False, True) for bf in (True, False)
        for n in (17, 1000, 8192)}
cfgs |= {Fa3Config(head_dim=x["d"], causal=c, **{k: v for k, v in x.items() if k != "d"})
         for x in t.TILE_CONFIGS for c in (False, True)}
cfgs |= {Fa3Config(256, 128, bn, 2, c) for bn in (64, 80) for c in (False, True)}
t0 = time.time()
with ThreadPoolExecutor(16) as pool:
    list(pool.map(build_cubin, cfgs))
print(f"built {len(cfgs)} configs in {time.time() - t0:.0f} s")
PY
      ;;
    focus)
      step "focus 1: tests/gpu/test_fa3_sm90_d256.py::test_d256_ragged (was: second run differs)"
      run_for 120 focus_d256 "${PYTEST[@]}" tests/gpu/test_fa3_sm90_d256.py -k ragged
      step "focus 2: test_fa3_sm90.py: strided memory in place, refusals, Q slot, separate lengths"
      run_for 200 focus_fa3 "${PYTEST[@]}" tests/gpu/test_fa3_sm90.py \
        -k "strided or refused or q_slot or separate_lengths or tile_configs or llama"
      step "focus 3: test_op.py: bnhd memory in place, layouts, compile, graphs"
      run_for 200 focus_op "${PYTEST[@]}" tests/gpu/test_op.py -k "bnhd or layouts or compile or eager"
      ;;
    llama)
      step "llama: transformers Llama 4 layers 16/4 heads D 128 B 2, cubridge vs SDPA / Flex"
      run_for 200 llama python3 experiments/llama_client.py --out "$WORK/llama.json"
      ;;
    full)
      for f in test_fa3_sm90_d256 test_fa3_sm90 test_op test_runtime_inputs; do
        step "full: tests/gpu/$f.py"
        run_for 240 "full_$f" "${PYTEST[@]}" "tests/gpu/$f.py"
      done
      ;;
    *) echo "error: device_s8_fwdfa3.sh: unknown stage '$stage' (build, focus, llama, full)"; exit 2 ;;
  esac
done

step "summary"
python3 - "$WORK" "$OUT/fwdfa3${TAG:-}.json" <<'PY'
import json, re, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
res = {"system": "cubridge fa3_sm90 (branch fwdfa3)", "parts": {}, "llama": None}
for rc in sorted(work.glob("*.rc")):
    text = (work / f"{rc.stem}.out").read_text() if (work / f"{rc.stem}.out").is_file() else ""
    summary = (re.findall(r"^.*\b\d+ (?:passed|failed|errors?|skipped)\b.*$", text, re.M) or [text.strip()[-200:]])[-1]
    res["parts"][rc.stem] = {"rc": rc.read_text().strip(), "summary": summary}
if (work / "llama.json").is_file():
    res["llama"] = json.loads((work / "llama.json").read_text())
out.write_text(json.dumps(res, indent=1, default=str))
print(f"{'part':<28} {'rc':>7}  summary")
for name, p in res["parts"].items():
    print(f"{name:<28} {p['rc']:>7}  {p['summary'][:90]}")
rows = (res["llama"] or {}).get("rows", [])
if rows:
    print(f"\n{'variant':<9} {'N':>5} {'cubridge ms':>11} {'baseline':<16} {'base ms':>9} {'ours vs base':>12} logits rule")
for r in rows:
    for base in [k[:-3] for k in r if k.endswith("_ms") and not k.startswith("cubridge")]:
        print(f"{r['variant']:<9} {r['N']:>5} {r['cubridge_ms']:11.3f} {base:<16} {r[base + '_ms']:9.3f} "
              f"{r[base + '_ms'] / r['cubridge_ms']:11.3f}x {(r.get('logits_rule') or {}).get('passed')}")
PY
