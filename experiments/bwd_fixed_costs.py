"""Where fa3_bwd_sm90's time goes besides its main loop (issue 17; ref_kernels/fa3_bwd_sm90/NOTES.md,
"Session 9: against FA4's SM90 backward", "Where the gap is"). Session 9's timings fit
time = F + FLOPs / R with F ~ 1.5 ms for ours against ~0.9-1.1 ms for FA4 and cuDNN (16k tokens at
8k and 16k: the same 4096 CTAs and pre / post work). This splits one call of fa3_backward into the
device time of each kernel it launches (torch.profiler, CUPTI) and the rest of the timed window
(GPU idle: host work the GPU waited for), then fits the main kernel alone over the two lengths:
its own F is per-CTA prologue / epilogue and wave tails, the remainder is pre / post kernels and
host gaps.

  python3 experiments/bwd_fixed_costs.py --out fixed.json [--option bulk_overlap_lse [bulk_overlap_lse_lean ...]] (GPU)

Several options: each row of each option is measured in turn (same process, same inputs per shape),
and the table has one line per option and mask.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import expkit  # noqa: F401 - cubridge importable from a bare checkout
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cubridge.runtime.timing import attention_flops, bench_round_robin

TOKENS, H, D = 16384, 32, 128
BWD_FLOP_FACTOR = 2.5
MAIN_KERNEL = "fa3_bwd_sm90"
FLUSH_BYTES = 128 << 20   # copied (a memcpy, not a kernel) before each profiled call: L2 cold as when timed


def make_call(option: str, n: int, causal: bool):
    from cubridge.runtime.autograd import forward_with_lse
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    b = max(1, TOKENS // n)
    gen = torch.Generator(device="cuda").manual_seed(n + causal)
    q, k, v, dout = (torch.randn(b, H, n, D, device="cuda", generator=gen).bfloat16() for _ in range(4))
    out, lse = forward_with_lse(q, k, v, causal)
    flops = BWD_FLOP_FACTOR * attention_flops(b, H, D, n, n, causal)
    return functools.partial(fa3_backward, dout, q, k, v, out, lse, causal=causal, option=option), flops


def kernel_ms(fn, calls: int) -> dict[str, float]:
    """Device milliseconds per call of each kernel name fn launches (memcpy / memset left out)."""
    src = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            dst.copy_(src)
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or e.name.startswith(("Memcpy", "Memset")):
            continue
        totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12), flush=True)
    return {name: ms / calls for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])}


def shape_row(option: str, n: int, causal: bool, reps: int) -> dict:
    fn, flops = make_call(option, n, causal)
    fn()
    wall = bench_round_robin([fn], warmup=3, reps=reps)[0].median_ms
    try:
        kernels = kernel_ms(fn, calls=5)
    except Exception as err:   # noqa: BLE001 - no profiler (CUPTI) here: the wall time still counts
        print(f"# profiler failed: {str(err).splitlines()[0][:160]}", flush=True)
        kernels = {}
    main = sum(ms for name, ms in kernels.items() if MAIN_KERNEL in name and "convert" not in name)
    total = sum(kernels.values())
    row = dict(option=option, N=n, causal=causal, flops=flops, wall_ms=round(wall, 4),
               kernel_sum_ms=round(total, 4), main_ms=round(main, 4), idle_ms=round(wall - total, 4),
               kernels={k: round(v, 4) for k, v in kernels.items()})
    print(f"{'causal' if causal else 'full':6s} N={n:5d} wall {wall:7.3f} ms  kernels {total:7.3f}"
          f"  main {main:7.3f}  others {total - main:6.3f}  idle {wall - total:6.3f}", flush=True)
    return row


def fit(rows: list[dict], key: str) -> dict | None:
    """time = F + FLOPs / R over the two lengths of one mask (R in TFLOPS, F in ms)."""
    if len(rows) != 2 or rows[0]["flops"] == rows[1]["flops"]:
        return None
    (f0, t0), (f1, t1) = sorted((r["flops"], r[key]) for r in rows)
    per_flop = (t1 - t0) / (f1 - f0)
    return dict(R_tflops=round(1e-9 / per_flop, 1) if per_flop > 0 else None, F_ms=round(t0 - f0 * per_flop, 4))


def main(argv=None) -> int:
    from cubridge.runtime.fa3_bwd_sm90 import DEFAULT_OPTION, OPTIONS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--option", nargs="+", default=[DEFAULT_OPTION], choices=list(OPTIONS))
    ap.add_argument("--n", type=int, nargs=2, default=[8192, 16384])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    rows, fits = [], {}
    for option in args.option:
        for causal in (True, False):
            mine = [shape_row(option, n, causal, args.reps) for n in args.n]
            rows += mine
            fits[f"{option} {'causal' if causal else 'full'}"] = {key: fit(mine, key) for key in ("wall_ms", "main_ms")}
            torch.cuda.empty_cache()   # the next shapes' inputs, not this one's cached blocks
    result = dict(device=torch.cuda.get_device_name(), options=args.option, rows=rows, fits=fits)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print("\n| option mask | wall: R TFLOPS, F ms | main kernel: R, F | mean idle ms | mean other kernels ms |")
    for label, f in fits.items():
        option, mask = label.rsplit(" ", 1)
        mine = [r for r in rows if r["option"] == option and r["causal"] == (mask == "causal")]
        idle = statistics.mean(r["idle_ms"] for r in mine)
        other = statistics.mean(r["kernel_sum_ms"] - r["main_ms"] for r in mine)
        print(f"| {label} | {f['wall_ms']} | {f['main_ms']} | {idle:.3f} | {other:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
