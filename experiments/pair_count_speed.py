"""Issue 19 item 5: the attended-pair count (what `cubridge analyze` and the tuner's FLOP count use)
at N = 16k on this CPU, for every built-in spec and every corpus spec, one process, one spec at a
time, each timed from its hooks to the count (the trace included). B = 2, Hq = 32, Hkv = 8 (the
corpus benchmark's heads). No GPU.

    python3 experiments/pair_count_speed.py --out /tmp/pairs16k.json [--n 16384]

Prints a table (seconds per spec, slowest first) and the bar's verdict (every spec under 5 s), and
writes rows {spec, source, N, pairs, seconds, cpu_load} to --out. The machine's load average is
recorded beside each row: on a shared 2-core machine a loaded row reads slower than the code is.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from cubridge.spec import builtin_specs, load_spec
from cubridge.transfer.pairs import count_attended

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"
B, HQ, HKV = 2, 32, 8


def specs():
    for name in builtin_specs():
        yield name, "builtin", name
    for p in sorted(CORPUS.glob("*.py")):
        if not p.name.startswith("_"):
            yield p.stem, "corpus", str(p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=16384)
    args = ap.parse_args()
    rows = []
    for name, source, path in specs():
        spec = load_spec(path)
        t0 = time.perf_counter()
        hooks = spec.hooks_for(args.n, args.n, HQ, HKV, "cpu", B=B)
        pairs = count_attended(hooks, B, HQ, args.n, args.n)
        dt = time.perf_counter() - t0
        rows.append({"spec": name, "source": source, "N": args.n, "pairs": pairs, "seconds": round(dt, 3),
                     "cpu_load": round(os.getloadavg()[0], 2)})
        print(f"{name:<28} {source:<8} {dt:7.2f} s  load {rows[-1]['cpu_load']}", flush=True)
    Path(args.out).write_text(json.dumps({"N": args.n, "B": B, "Hq": HQ, "Hkv": HKV, "cpus": os.cpu_count(),
                                          "rows": rows}, indent=1))
    slow = sorted(rows, key=lambda r: -r["seconds"])
    print("slowest:", ", ".join(f"{r['spec']} {r['seconds']} s" for r in slow[:5]))
    print(f"bar (every spec under 5 s at {args.n}): {'met' if slow[0]['seconds'] < 5 else 'NOT met'}")


if __name__ == "__main__":
    main()
