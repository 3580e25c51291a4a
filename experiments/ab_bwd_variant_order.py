"""A/B of the Hopper variant backward's options in one process, beside FlexAttention (Triton, FLASH):
per variant at N, our backward on each --options entry (VariantBackward(use_hopper=True,
hopper_option=...)) and the peers' autograd backward, timed round-robin (cubridge.runtime.timing.
bench_round_robin: L2 flushed, median). Our options must agree: dK / dV bitwise (each CTA sums its own
tile in a fixed order, whatever order the CTAs run in), dQ within 2^-6 of its max (reduce-add order).
Writes $OUT-style JSON (--out) and prints a table last.

    python3 experiments/ab_bwd_variant_order.py --out $OUT/x.json [--n 8192] [--variants ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import bench_bwd_variants as bb
import expkit
import torch

from cubridge.runtime.timing import bench_round_robin, tflops
from cubridge.transfer.pairs import count_attended

DEFAULT_OPTIONS = ["bulk_overlap_lse_lean", "bulk_overlap_lse_lean_l2lpt"]


def ours_option(name, option, q, k, v, dout, out, lse):
    from cubridge.runtime.variant_bwd import VariantBackward
    bwd = VariantBackward(name, use_hopper=True, hopper_option=option)
    return {"bwd": lambda: bwd(dout, q, k, v, out, lse), "grads": bwd(dout, q, k, v, out, lse)}


def run_shape(name, n, options, peers, reps, fwd_ours):
    b = bb.TOKENS // n
    spec = bb.load_spec(name)
    hooks = spec.hooks_for(n, n, bb.H, bb.H, "cuda")
    flops = bb.BWD_FLOP_FACTOR * 4.0 * bb.D * count_attended(hooks, b, bb.H, n, n, device="cuda")
    q, k, v, dout = bb._inputs(n, b)
    out, lse = fwd_ours.fn(name, q, k, v)()
    systems = {f"ours:{o}": ours_option(name, o, q, k, v, dout, out, lse) for o in options}
    for peer in peers:
        try:
            systems[peer] = bb.flex(name, hooks, q, k, v, dout, "triton" if peer == "flex" else "flash")
        except bb.Refused as e:
            print(f"  {name} {peer} refused: {e}", flush=True)
    base = systems[f"ours:{options[0]}"]["grads"]
    for o in options[1:]:
        g = systems[f"ours:{o}"]["grads"]
        assert torch.equal(g[1], base[1]) and torch.equal(g[2], base[2]), f"{name}: {o} dK / dV differ from {options[0]}"
        rel = (g[0].float() - base[0].float()).abs().max().item() / max(base[0].float().abs().max().item(), 1e-30)
        assert rel <= 2 ** -6, f"{name}: {o} dQ differs from {options[0]} by {rel:.2e} of its max"
    names = [s for s, sy in systems.items() if sy.get("bwd") is not None]   # the backward alone
    timed = bench_round_robin([systems[s]["bwd"] for s in names], warmup=2, reps=reps)
    times = {s: {"bwd_ms": round(t.median_ms, 4)} for s, t in zip(names, timed)}
    ref = times[f"ours:{options[0]}"]["bwd_ms"]
    rows = []
    for s, t in times.items():
        rows.append({"variant": name, "N": n, "B": b, "system": s, "bwd_ms": t["bwd_ms"],
                     "bwd_tflops": round(tflops(flops, t["bwd_ms"]) or 0, 1),
                     "vs_first_option": round(ref / t["bwd_ms"], 3)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", nargs="+",
                    default=["share_question", "global_sliding_window", "prefixlm", "causal_blockwise"])
    ap.add_argument("--options", nargs="+", default=DEFAULT_OPTIONS)
    ap.add_argument("--peers", nargs="*", default=["flex", "flex_flash"])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    bb.BWD_KERNEL["kernel"] = "hopper"
    result = {"gpu": torch.cuda.get_device_name(), "options": args.options, "rows": [], "failed": [],
              "protocol": f"round-robin, L2 flushed, {args.reps} reps, median (bench_round_robin, backward only)"}
    fwd_ours = expkit.Ours()
    for n in args.n:
        for name in args.variants:
            try:
                result["rows"] += run_shape(name, n, args.options, args.peers, args.reps, fwd_ours)
            except Exception:  # noqa: BLE001 - one variant failing is reported, the others still run
                result["failed"].append({"variant": name, "N": n, "error": traceback.format_exc()[-1500:]})
                print(f"# {name} N={n}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
            torch.cuda.empty_cache()
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    print("| variant | N | system | bwd ms | bwd TFLOPS | speedup vs first option |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        print(f"| {r['variant']} | {r['N']} | {r['system']} | {r['bwd_ms']:.3f} | {r['bwd_tflops']:.0f} | "
              f"{r['vs_first_option']:.3f} |")
    for f in result["failed"]:
        print(f"| {f['variant']} | {f['N']} | FAILED | {f['error'].splitlines()[-1][:80]} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
