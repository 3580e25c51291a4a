"""Where a variant backward's time goes at short lengths (issue 17; ref_kernels/fa3_bwd_sm90/NOTES.md,
"Session 14 (variant backward)": at 1k every variant backward costs 0.69-0.82 ms whatever its pairs).

For each variant and length: the device time of every kernel one backward call launches
(torch.profiler, CUPTI), for ours (VariantBackward on the Hopper kernel, as bench_bwd_variants.py
calls it) and for FlexAttention with the FLASH and Triton backends (autograd.grad on a retained
graph), beside the round-robin wall time of each, so the per-call floor splits into named kernels
and host gaps (wall - sum of kernels).

  python3 experiments/vbwd_profile.py --n 1024 4096 --variants prefixlm global_sliding_window --out p.json  (GPU)
  [--tokens 8192: B = tokens // N, the eager bar's B 1 at 8k]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import expkit
from expkit.peers import flex_autograd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cubridge.runtime.timing import bench_round_robin
from cubridge.spec import load_spec

FLUSH_BYTES = 128 << 20
TOKENS, H, D = 16384, 16, 128   # bench_bwd_variants.py's shapes: bf16, 16 heads (MHA), B = 16384 // N


class Refused(Exception):
    """A peer that cannot run this variant (FLASH unavailable, a normalisation Flex cannot express)."""


def _inputs(n: int, b: int):
    """q, k, v, dout as bench_bwd_variants.py draws them (expkit.bwd_inputs, same seed)."""
    return expkit.bwd_inputs(b, H, H, n, D, seed=n * 131 + b)


def ours(name: str, q, k, v, dout):
    """Our backward (VariantBackward on the Hopper kernel) on our forward's out / LSE, as bench_bwd_variants.py."""
    from expkit import Ours
    from cubridge.runtime.variant_bwd import VariantBackward
    bwd = VariantBackward(name, use_hopper=True)
    out, lse = Ours().fn(name, q, k, v)()
    return lambda: bwd(dout, q, k, v, out, lse)


def flex(hooks, q, k, v, dout, backend: str):
    """FlexAttention's backward alone: autograd.grad on a retained graph (backend "flash": FA4's CuTe DSL)."""
    if not hooks.flex_expressible:
        raise Refused(f"{hooks.normalization.kind} normalisation: FlexAttention is softmax only")
    leaves, forward = flex_autograd(hooks, q, k, v, backend)
    try:
        out = forward()
        torch.autograd.grad(out, leaves, dout, retain_graph=True)
    except Exception as e:  # noqa: BLE001 - the backend's refusal is the recorded reason
        raise Refused(f"{type(e).__name__}: {str(e).strip()[:200]}")
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def kernel_ms(fn, calls: int = 5) -> dict[str, float]:
    """Device ms per call of each kernel fn launches (memsets counted: they are per-call work too)."""
    src = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            dst.copy_(src)
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or e.name.startswith("Memcpy"):
            continue
        name = e.name[:90]
        totals[name] = totals.get(name, 0.0) + e.time_range.elapsed_us() / 1e3
    return {k: round(v / calls, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def one(name: str, n: int, reps: int, tokens: int = TOKENS) -> list[dict]:
    b = max(1, tokens // n)
    spec = load_spec(name)
    hooks = spec.hooks_for(n, n, H, H, "cuda")
    q, k, v, dout = _inputs(n, b)
    systems = {"cubridge": ours(name, q, k, v, dout)}
    for peer, backend in (("flex_flash", "flash"), ("flex", "triton")):
        try:
            systems[peer] = flex(hooks, q, k, v, dout, backend)
        except Refused as e:
            print(f"  {name} {n} {peer}: refused {str(e)[:120]}", flush=True)
    names = list(systems)
    walls = bench_round_robin([systems[s] for s in names], warmup=2, reps=reps)
    rows = []
    for s, t in zip(names, walls):
        ks = kernel_ms(systems[s])
        total = sum(ks.values())
        rows.append(dict(variant=name, N=n, B=b, H=H, D=D, system=s, wall_ms=round(t.median_ms, 4),
                         kernel_sum_ms=round(total, 4), gap_ms=round(t.median_ms - total, 4), kernels=ks))
        print(f"{name:22s} N={n:5d} {s:10s} wall {t.median_ms:7.3f}  kernels {total:7.3f}  gap {t.median_ms - total:6.3f}",
              flush=True)
        for kname, ms in list(ks.items())[:8]:
            print(f"      {ms:7.4f} ms  {kname}", flush=True)
    del systems
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, nargs="+", default=[1024])
    ap.add_argument("--variants", nargs="+", default=["prefixlm", "global_sliding_window", "share_question"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=TOKENS, help="B = tokens // N (8192: the eager bar's B 1 at 8k)")
    args = ap.parse_args(argv)
    rows = []
    for n in args.n:
        for name in args.variants:
            rows += one(name, n, args.reps, args.tokens)
            if args.out:
                args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                    torch=torch.__version__, rows=rows), indent=1))
    print("\n| variant | N | system | wall ms | kernels ms | gap ms | top kernel |")
    for r in rows:
        top = next(iter(r["kernels"].items()), ("-", 0))
        print(f"| {r['variant']} | {r['N']} | {r['system']} | {r['wall_ms']} | {r['kernel_sum_ms']} | {r['gap_ms']} "
              f"| {top[0][:40]} {top[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
