"""Variant backward timing: cubridge's lowered fa2_bwd_sm80 (cubridge.runtime.variant_bwd) vs
torch.autograd of the spec's eager reference, per variant, bf16, D = 128, Hq / Hkv = 16 / 4, B = 1.
Each system's backward alone is timed (round-robin, L2 flushed: cubridge.runtime.timing); the
eager one re-runs torch.autograd.grad on a retained graph. A go / no-go sanity check compares the
gradients with the eager ones (max |ours - eager| / max |eager| per gradient).

    python experiments/bench_bwd_variants.py --out $OUT/x.json [--n 8192] [--reps 10]
    python experiments/bench_bwd_variants.py --table $OUT/x.json
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

import expkit  # noqa: F401 - cubridge importable from a bare checkout
from cubridge.runtime.timing import bench_round_robin

VARIANTS = ["prefixlm", "causal_blockwise", "global_sliding_window", "share_question", "relative_pos",
            "sigmoid", "relu", "composite"]
HQ, HKV, D, B = 16, 4, 128, 1


def bench_variant(name: str, n: int, reps: int) -> list[dict]:
    from cubridge.runtime.variant_bwd import VariantBackward
    bwd = VariantBackward(name)
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, dout = (torch.randn(B, HQ, n, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, HKV, n, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = bwd.spec.run_reference(*leaves)
    from cubridge.runtime.variant_bwd import reference_forward
    with torch.no_grad():
        _, lse = reference_forward(bwd.spec, q, k, v)
    saved_out = out.detach().contiguous()

    def ours():
        return bwd(dout, q, k, v, saved_out, lse.contiguous())

    def eager():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)
    mine, theirs = ours(), eager()
    sanity = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                 for a, b in zip(mine, theirs))
    t_ours, t_eager = bench_round_robin([ours, eager], warmup=2, reps=reps)
    base = dict(direction="backward", variant=name, N=n, B=B, Hq=HQ, Hkv=HKV, D=D, dtype="bf16")
    return [dict(base, system="cubridge/fa2_bwd_sm80", ms=round(t_ours.median_ms, 4), max_rel_vs_eager=round(sanity, 5),
                 speedup_vs_eager=round(t_eager.median_ms / t_ours.median_ms, 2)),
            dict(base, system="eager_autograd", ms=round(t_eager.median_ms, 4))]


def print_table(rows: list[dict]) -> None:
    print(f"| variant | N | cubridge bwd ms | eager autograd ms | speedup | max rel vs eager |")
    print("| --- | --- | --- | --- | --- | --- |")
    eager = {(r["variant"], r["N"]): r["ms"] for r in rows if r["system"] == "eager_autograd"}
    for r in rows:
        if r["system"].startswith("cubridge"):
            print(f"| {r['variant']} | {r['N']} | {r['ms']:.3f} | {eager.get((r['variant'], r['N']), float('nan')):.3f} | "
                  f"{r['speedup_vs_eager']:.1f}x | {r['max_rel_vs_eager']:.2e} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, nargs="+", default=[8192])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--table", type=Path, help="print the table of a results JSON and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    rows = []
    for n in args.n:
        for name in args.variants:
            try:
                rows += bench_variant(name, n, args.reps)
                print(f"{name:24s} N={n}: ours {rows[-2]['ms']:.3f} ms, eager {rows[-1]['ms']:.3f} ms, "
                      f"rel {rows[-2]['max_rel_vs_eager']:.2e}", flush=True)
            except Exception:   # noqa: BLE001 - one variant failing is reported, the others still run
                print(f"# {name} N={n}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
            torch.cuda.empty_cache()
            if args.out:
                args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
