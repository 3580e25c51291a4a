"""Hopper backward benchmark: cubridge's fa3_bwd_sm90 beside fa2_bwd_sm80, SDPA's cuDNN backward and
(when flash_attn.cute imports) FlashAttention-4, dense bf16 D = 128, 32 heads, 16k tokens per
shape, causal and full at 8k and 1k. Backward only: ours called directly after one forward, the
peers through torch.autograd.grad; round-robin with L2 flushed (bench_round_robin). TFLOPS = 2.5 x
the forward's FLOPs on attended pairs. Each row carries a sanity note against SDPA cuDNN's
gradients (go / no-go only; the rule is tests/gpu/test_bwd_sm90.py).

  python3 experiments/bench_bwd_sm90.py --out results.json      (GPU)
  python3 experiments/bench_bwd_sm90.py --sanitize-case         (small launches for compute-sanitizer)
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import expkit  # noqa: E402,F401 - cubridge importable from a bare checkout
from cubridge.runtime.timing import attention_flops, bench_round_robin  # noqa: E402

TOKENS, H, D = 16384, 32, 128
BWD_FLOP_FACTOR = 2.5
SANITY_REL = 0.05


def ours(name: str, causal: bool, q, k, v, dout):
    from cubridge.runtime.autograd import forward_with_lse
    out, lse = forward_with_lse(q, k, v, causal)
    if name == "cubridge/fa3_bwd_sm90":
        from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
        return lambda: fa3_backward(dout, q, k, v, out, lse, causal=causal)
    from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
    bwd = Fa2BwdSm80()
    return lambda: bwd(dout, q, k, v, out, lse, causal=causal)


def peer(name: str, causal: bool, q, k, v, dout):
    if name == "sdpa_cudnn":
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    from flash_attn.cute import flash_attn_func   # fa4: [B, N, H, D] leaves, its native layout
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    do = dout.transpose(1, 2).contiguous()
    return lambda: [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, do, retain_graph=True)]


SYSTEMS = {"cubridge/fa3_bwd_sm90": ours, "cubridge/fa2_bwd_sm80": ours, "sdpa_cudnn": peer, "fa4": peer}


def sanity(grads, ref) -> str:
    bad = []
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        rel = float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6))
        if not rel <= SANITY_REL:
            bad.append(f"{name} rel err {rel:.3g}")
    return "WRONG: " + ", ".join(bad) if bad else ""


def bench_shape(n: int, causal: bool, reps: int) -> list[dict]:
    b = TOKENS // n
    gen = torch.Generator(device="cuda").manual_seed(n + causal)
    q, k, v, dout = (torch.randn(b, H, n, D, device="cuda", generator=gen).bfloat16() for _ in range(4))
    runnable, grads = [], {}
    for name, make in SYSTEMS.items():
        try:
            fn = make(name, causal, q, k, v, dout)
            grads[name] = fn()   # first call: builds / autotunes outside the timing
            runnable.append((name, fn))
        except Exception as err:   # noqa: BLE001 - a missing peer is reported, not fatal
            print(f"# {name} N={n} {'causal' if causal else 'full'}: skipped: {str(err).splitlines()[0][:160]}")
    timings = bench_round_robin([fn for _, fn in runnable], warmup=3, reps=reps)
    flops = BWD_FLOP_FACTOR * attention_flops(b, H, D, n, n, causal)
    ref, rows = grads.get("sdpa_cudnn"), []
    for (name, _), t in zip(runnable, timings):
        note = sanity(grads[name], ref) if ref is not None and name != "sdpa_cudnn" else ""
        rows.append(dict(direction="backward", system=name, variant="causal" if causal else "full",
                         model="llama2-7b", N=n, B=b, Hq=H, Hkv=H, D=D, dtype="bf16", ms=round(t.median_ms, 4),
                         tflops=round(flops / (t.median_ms * 1e-3) / 1e12, 1), note=note))
        print(f"{name:24s} {rows[-1]['variant']:6s} N={n:5d} {t.median_ms:8.3f} ms {rows[-1]['tflops']:6.1f} TFLOPS {note}",
              flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    systems = list(dict.fromkeys(r["system"] for r in rows))
    shapes = list(dict.fromkeys((r["variant"], r["N"]) for r in rows))
    cell = {(r["system"], r["variant"], r["N"]): r for r in rows}
    print("\n| shape | " + " | ".join(systems) + " |")
    print("| --- |" + " --- |" * len(systems))
    for var, n in shapes:
        vals = [(f"{cell[(s, var, n)]['tflops']:.1f}" + (" WRONG" if cell[(s, var, n)]["note"] else ""))
                if (s, var, n) in cell else "-" for s in systems]
        print(f"| {var} {n // 1024}k | " + " | ".join(vals) + " |")


def sanitize_case() -> None:
    """Ragged causal GQA (D = 128 bf16) and full MQA (D = 64 fp16) through the Hopper backward."""
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    from cubridge.runtime.fa3_sm90 import fa3_forward
    for (b, hq, hkv, nq, nk, d, dtype, causal) in ((1, 4, 2, 77, 300, 128, torch.bfloat16, True),
                                                   (1, 2, 1, 200, 77, 64, torch.float16, False)):
        q, dout = (torch.randn(b, hq, nq, d, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype) for _ in range(2))
        out, lse = fa3_forward(q, k, v, causal=causal)
        grads = fa3_backward(dout, q, k, v, out, lse, causal=causal)
        torch.cuda.synchronize()
        print(f"sanitize case D={d} {dtype} causal={causal}: finite={all(bool(g.isfinite().all()) for g in grads)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 1024])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sanitize-case", action="store_true")
    ap.add_argument("--table", type=Path, help="print the table of a results JSON and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    if args.sanitize_case:
        sanitize_case()
        return 0
    rows = []
    for n in args.n:
        for causal in (True, False):
            try:
                rows += bench_shape(n, causal, args.reps)
            except Exception:   # noqa: BLE001 - keep the other shapes' rows
                traceback.print_exc()
            if args.out:   # after every shape: a run cut short keeps what it measured
                args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                    date=datetime.now().isoformat(), rows=rows), indent=1))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
