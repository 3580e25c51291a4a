"""Where the eager baseline of issue 17's >= 10x bar spends its backward: torch.autograd of a spec's
eager reference (spec.run_reference, as experiments/bench_bwd_variants.py times it: bf16, D 128, 16
heads, B 1, 8k) profiled per kernel (torch.profiler / CUPTI), split into GEMMs and the rest (the
elementwise passes over the N x N score matrices, which an eager backward reads and writes in HBM).
Read beside our backward's time: the bar is eager / ours >= 10, so what the eager side costs per
element pass says how far per-element trimming in ours can go. GPU only.

    python3 experiments/eager_bwd_split.py --out $OUT/x.json [--variants sigmoid composite relu] [--n 8192]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import expkit  # noqa: F401 - cubridge importable from a bare checkout
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cubridge.runtime.timing import bench_round_robin
from cubridge.spec import load_spec

H, D = 16, 128
GEMM_MARKS = ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "cublas")   # cuBLAS / CUTLASS kernel names


def kind(name: str) -> str:
    return "gemm" if any(m in name.lower() for m in GEMM_MARKS) else "elementwise"


def one(name: str, n: int, calls: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v, dout = (torch.randn(1, H, n, D, device="cuda", generator=gen).bfloat16() for _ in range(4))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = load_spec(name).run_reference(*leaves)

    def bwd():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)
    bwd()
    wall = bench_round_robin([bwd], warmup=2, reps=5)[0].median_ms
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            bwd()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / calls
    split = {"gemm": 0.0, "elementwise": 0.0}
    for kname, ms in per.items():
        split[kind(kname)] += ms
    top = sorted(per.items(), key=lambda kv: -kv[1])[:8]
    del out, leaves
    torch.cuda.empty_cache()
    return {"variant": name, "N": n, "B": 1, "H": H, "D": D, "wall_ms": round(wall, 4),
            "gemm_ms": round(split["gemm"], 4), "elementwise_ms": round(split["elementwise"], 4),
            "kernels": len(per), "top": [{"kernel": kname[:120], "ms": round(ms, 4), "kind": kind(kname)}
                                         for kname, ms in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--variants", nargs="+", default=["sigmoid", "composite", "relu"])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    rows = []
    for name in args.variants:
        try:
            rows.append(one(name, args.n, args.calls))
        except Exception as e:  # noqa: BLE001 - one variant failing is reported, the others still run
            rows.append({"variant": name, "N": args.n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        if args.out:
            args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    for r in rows:
        if "error" in r:
            print(f"{r['variant']}: FAILED {r['error']}")
            continue
        print(f"{r['variant']} N={r['N']}: top kernels")
        for t in r["top"]:
            print(f"    {t['ms']:8.3f} ms  {t['kind']:11s} {t['kernel'][:90]}")
    print("| variant | N | eager bwd ms (timed) | GEMM ms | elementwise ms | kernels |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" not in r:
            print(f"| {r['variant']} | {r['N']} | {r['wall_ms']:.3f} | {r['gemm_ms']:.3f} | {r['elementwise_ms']:.3f} | "
                  f"{r['kernels']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
