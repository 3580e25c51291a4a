#!/usr/bin/env bash
# Session 7, branch op2 (issue 15: the op's speed bars): one device call on an H100, about 8 minutes.
#   1. compile the ten variants' default kernels once, in parallel (later builds hit the cache)
#   2. tests/gpu/test_op.py: the op for all ten variants under the verification rule, eager,
#      torch.compile(fullgraph=True), CUDA graph, layouts / strides / scale / LSE, relocated run
#   3. experiments/bench_op.py: host us per call (median, GC off; mean too) and op vs bare kernel
#      with the GPU held busy (and idle, as session 7 timed it), ten variants at 1k / 8k
#   4. experiments/llama_client.py: random-init Llama with the tuned causal / prefixlm kernels
# Writes two files: $OUT/op2_results.json (bench rows, llama rows, test summary) and $OUT/op2_log.txt.
# PARTS="tests bench" runs a subset (default: all four; the timeouts add up to ~570 s).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/op2_log.txt"
WORK=$(mktemp -d /tmp/op_s7.XXXX)
PARTS=${PARTS:-build tests bench llama}
part() { [[ " $PARTS " == *" $1 "* ]]; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  part build && echo "== 1. build (compile cache warm-up)" && timeout 120 python3 - "$WORK" <<'PY'
import sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from cubridge.op import build
from cubridge.spec import builtin_specs
t = time.time()
with ThreadPoolExecutor(12) as pool:
    list(pool.map(lambda s: build(s, Path(sys.argv[1]) / "warm" / s, heads_q=8, heads_kv=2), builtin_specs()))
print(f"built ten run directories in {time.time() - t:.0f} s")
PY
  if part tests; then
    echo "== 2. tests/gpu/test_op.py"
    CUBRIDGE_OP_RUNS="$WORK/tests" timeout 180 python3 -m pytest tests/gpu/test_op.py -q -p no:cacheprovider -rfE 2>&1 | tail -40
  fi
  if part bench; then
    echo "== 3. bench_op"
    timeout 130 python3 experiments/bench_op.py --out "$WORK/bench_op.json" --runs "$WORK/bench" 2>&1 | tail -30
  fi
  if part llama; then
    echo "== 4. llama_client"
    timeout 140 python3 experiments/llama_client.py --out "$WORK/llama.json" 2>&1 | tail -20
  fi
} 2>&1 | tee "$LOG"
python3 - "$WORK" "$OUT/op2_results.json" "$LOG" <<'PY'
import json, re, sys
from pathlib import Path
work, out, log = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]).read_text()
res = {"system": "cubridge_op", "tests": (re.findall(r"^.*\d+ (?:passed|failed|errors?)\b.* in [\d.]+s.*$", log, re.M) or ["no summary"])[-1]}
for name in ("bench_op", "llama"):
    f = work / f"{name}.json"
    res[name] = json.loads(f.read_text()) if f.is_file() else None
out.write_text(json.dumps(res, indent=1))
print("tests:", res["tests"])
for r in (res["bench_op"] or {}).get("rows", []):
    print(f"{r['variant']:<22} N={r['N']:>5} host {r['host_us_per_call']:6.2f} us (mean {r['host_us_mean']:6.2f})  op {r['op_ms']:.4f} ms  kernel {r['kernel_ms']:.4f} ms  x{r['op_over_kernel']:.3f}  idle x{r['op_over_kernel_idle']:.3f}")
for r in (res["llama"] or {}).get("rows", []):
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "logits_rule"}, "rule:", (r.get("logits_rule") or {}).get("passed"))
PY
