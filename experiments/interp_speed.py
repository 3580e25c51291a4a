"""How long the interpreter takes on the dense Hopper-style program (issue bar: < 5 s on the CPU
machine at B=2, H=4, kv heads 2, N=300, D=64). Prints one row per configuration and writes JSON.

    python experiments/interp_speed.py [--out experiments/results/interp_speed.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date

import torch

from cubridge.cuir.parser import parse_file
from cubridge.cuir.interp import interpret
from cubridge.paths import ref_kernel_dir
from cubridge.verify import Case, make_inputs

SHAPE = Case(B=2, Hq=4, Hkv=2, Nq=300, Nk=300, D=64)
BAR_S = 5.0


def time_one(prog, params, vectorise, repeats=5):
    q, k, v = make_inputs(SHAPE, torch.bfloat16)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        interpret(prog, {"Q": q, "K": k, "V": v}, params=params, vectorise=vectorise)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name in ("fa3_sm90", "fa2_sm80"):
        prog = parse_file(ref_kernel_dir(name) / "kernel.cuir")
        for causal in (1, 0):
            for vec in (True, False):
                t = time_one(prog, {"CAUSAL": causal}, vec)
                rows.append({"program": name, "causal": causal, "vectorise": vec, "first_s": t[0],
                             "median_s": statistics.median(t[1:]), "max_s": max(t)})
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "date": str(date.today()),
              "versions": {"torch": torch.__version__, "python": platform.python_version()},
              "shape": vars(SHAPE), "bar_s": BAR_S, "rows": rows}
    print(f"{'program':<10} {'causal':>6} {'vectorise':>9} {'first s':>8} {'median s':>9} {'max s':>7}")
    for r in rows:
        print(f"{r['program']:<10} {r['causal']:>6} {str(r['vectorise']):>9} {r['first_s']:8.3f} "
              f"{r['median_s']:9.3f} {r['max_s']:7.3f}")
    worst = max(r["max_s"] for r in rows if r["program"] == "fa3_sm90" and r["vectorise"])
    print(f"dense Hopper-style program, vectorised, worst of all runs: {worst:.3f} s (bar {BAR_S} s): "
          f"{'ok' if worst < BAR_S else 'OVER'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
