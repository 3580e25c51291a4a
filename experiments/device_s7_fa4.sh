#!/usr/bin/env bash
# Session 7, branch fa4 (issue 18): ours vs FlashAttention-4 and the other peers, ncu of ours vs
# FA4, and the A/B of the FA4-inspired kernel patches. Writes two files under $OUT: fa4_s7.json
# (one key per stage run) and fa4_s7.log. Prints a short table last.
#
#   usage (repo root, H100):  bash experiments/device_s7_fa4.sh STAGE...
#   stages: bench1k  bench8k  (bench_peers --quick at one length each: ~4-6 min, FA4 / Flex JIT)
#           ncu      (ncu_compare: ours and FA4, causal D128 8k and 1k: ~3-4 min)
#           ab       (ab_peer_patches --quick: 5 patches + FA4's tile / grid, 3 shapes: ~4-6 min,
#                    most of it nvcc)
#           abfull   (ab_peer_patches, all 6 shapes: ~6-8 min)
#           abvar    (softmax_overlap, the header-only patch, on lowered prefixlm, sigmoid and
#                     relative_pos at 8k: ~3 min)
# One device call is 10 minutes at most: run `ab abvar` (the patches first: they decide what the
# next change is), then `bench8k`, `bench1k`, `ncu` as separate calls,
# each right after the FA4 libraries were unpacked (pack-fa4.sh's call 1, carry [".fa4libs"]:
# bash .fa4libs/unpack.sh); carry [".fa4whl"] on these calls. If the libraries are gone and
# .fa4libs was carried too, this script unpacks them itself.
set -uo pipefail
OUT=${OUT:-/tmp/fa4_s7_out}
mkdir -p "$OUT"
LOG="$OUT/fa4_s7.log"
TMP=$(mktemp -d)
exec > >(tee -a "$LOG") 2>&1
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
# The device call ends at 600 s: every stage gets at most what is left of BUDGET (minus the
# collect step's margin), so the two files are always written.
START=$(date +%s)
BUDGET=${BUDGET:-570}
left() { local want=$1 rest=$((BUDGET - 25 - ($(date +%s) - START))); echo $((want < rest ? want : rest)); }
run_for() {   # run_for SECONDS CMD...: skip with a note when under a minute is left
  local t; t=$(left "$1"); shift
  if [ "$t" -lt 60 ]; then echo "skipped (only ${t}s of the call left): $*"; return; fi
  timeout "$t" "$@"
}
[ $# -gt 0 ] || { echo "error: device_s7_fa4.sh: name at least one stage (bench1k bench8k ncu ab abfull abvar)"; exit 2; }

step "environment"
if ! source .fa4whl/env.sh; then
  if [ -x .fa4libs/unpack.sh ] || [ -f .fa4libs/unpack.sh ]; then
    bash .fa4libs/unpack.sh && source .fa4whl/env.sh || echo "FA4 unavailable: peers that need it are recorded as skipped"
  else
    echo "FA4 unavailable (NO_FA4_LIBS): run 'bash .fa4libs/unpack.sh' (carry .fa4libs) in the call before"
  fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, cubridge; print('torch', torch.__version__, 'cubridge from', cubridge.__file__)"

for stage in "$@"; do
  case $stage in
    bench1k|bench8k)
      n=$([ "$stage" = bench1k ] && echo 1024 || echo 8192)
      step "bench_peers --quick N=$n"
      run_for 540 python3 experiments/bench_peers.py --quick --n "$n" --out "$TMP/$stage.json" 2>&1 | grep -v "^\s*$" | tail -40 ;;
    ncu)
      step "ncu: ours vs FA4, causal D128"
      run_for 400 python3 experiments/ncu_compare.py --timeout 180 --out "$TMP/ncu.json" 2>&1 | tail -12 ;;
    ab|abfull)
      step "A/B of the FA4-inspired patches ($stage)"
      quick=$([ "$stage" = ab ] && echo --quick || true)
      run_for 480 python3 experiments/ab_peer_patches.py $quick --reps 25 --out "$TMP/$stage.json" 2>&1 | tail -45 ;;
    abvar)
      step "A/B of softmax_overlap on lowered variants"
      run_for 300 python3 experiments/ab_peer_patches.py --no-dense --patches softmax_overlap \
        --variants prefixlm sigmoid relative_pos --reps 25 --out "$TMP/$stage.json" 2>&1 | tail -12 ;;
    *) echo "unknown stage $stage (bench1k bench8k ncu ab abfull abvar)" ;;
  esac
done

step "collect"
python3 - "$TMP" "$OUT/fa4_s7.json" "$@" <<'PY'
import json, sys
from pathlib import Path
tmp, out, stages = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
res = {}
for s in stages:
    f = tmp / f"{s}.json"
    res[s] = json.loads(f.read_text()) if f.exists() else {"error": f"stage {s} wrote no JSON (see fa4_s7.log)"}
out.write_text(json.dumps(res, indent=1))
print("wrote", out, "stages:", ", ".join(f"{s}={'ok' if 'error' not in v else 'missing'}" for s, v in res.items()))
for s, v in res.items():                      # the short table: ours / best peer, A/B speedups
    for ln in v.get("summary", []):
        print(f"{s:8s} {ln['variant']:<22} D{ln['D']} N={ln['N']:<6} ours {ln['ours']} best {ln['best_peer']} "
              f"ratio {ln['ratio']}")
    for r in v.get("rows", []) if s.startswith("ab") else []:
        print(f"{s:8s} {r['variant']:<7} D{r['D']} {r['Hq']}/{r['Hkv']} N={r['N']:<6} {r['system']:<16} "
              f"{r['tflops']:7.1f} x{r['speedup_vs_unpatched']:.3f} {r['check'][:40]}")
PY
rm -rf "$TMP"
