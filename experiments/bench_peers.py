"""Issue 18, item 1: ours against the strongest peers, one process, round-robin timer.

Per shape every system (experiments/expkit/peers.py: cubridge/fa3_sm90, fa4, flex_flash, flex,
sdpa_cudnn) is built and run once, its output checked under the verification rule at sampled
rows (float64 golden, bf16 ref) and against ours over the whole output; then all that ran are
timed together with cubridge.runtime.timing.bench_round_robin (L2 flushed before every call).
A system that cannot run is recorded with its reason; one that fails the check is timed but
marked (`check` starts with FAIL) and never counts as the best peer.
TFLOPS = 4 * D * (attended pairs, counted from the spec's mask) / time; 16k tokens per shape.

    python experiments/bench_peers.py --out $OUT/peers.json            # everything (long)
    python experiments/bench_peers.py --quick --out $OUT/peers.json    # dense D128 + 3 variants, 1k / 8k
    python experiments/bench_peers.py --plan                           # list the shapes, no GPU
    python experiments/bench_peers.py --n 8192 --dense-d --variants prefixlm \
        --variant-heads gqa16/4 --layout bhnd bnhd --out $OUT/model.json  # the Llama client's attention

Our lowered variants run at the tile config the product would use for the shape (recorded in each
row as `config` / `config_origin`): a --tuned-run DIR's dispatch bucket (what cubridge.load(DIR)
picks), else the untuned default that cubridge.op.build.build_run writes (the kernel's
variant_default: 128 x 128 at D 128). --ours-config times every variant at one config instead (an
A/B of that policy); --ours-patch NAME applies experiments/patches/NAME.patch to our variants.

--layout bnhd gives every system [B, N, H, D] memory seen as [B, H, N, D] (what transformers'
projections hand the attention function; every system reads it in place: FA4's BSHD is this
memory); --variant-heads picks the variants' head counts (gqa16/4: the Llama client).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from expkit.peers import SampledCheck, Unsupported, makers, max_diff, parse_point, point_label, product_point  # noqa: E402

from cubridge.runtime.timing import bench_round_robin, tflops  # noqa: E402
from cubridge.spec import builtin_specs, load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402

TOKENS = 16384
LENGTHS = [1024, 4096, 8192, 16384]
HEADS = {"mha": (32, 32), "gqa": (64, 8),        # Llama2-7B; GQA 64/8 (Qwen2.5-72B)
         "gqa16/4": (16, 4)}                       # experiments/llama_client.py's model
LAYOUTS = ("bhnd", "bnhd")
QUICK_VARIANTS = ["prefixlm", "global_sliding_window", "relative_pos"]
PEERS = ("fa4", "flex_flash", "sdpa_cudnn", "flex")
OURS = "cubridge/fa3_sm90"


def plan(args) -> list[tuple[str, int, int, int, int, str]]:
    """(variant, D, Hq, Hkv, N, layout) in the order timed: the most wanted shapes first."""
    return [(*shape, layout) for shape in _shapes(args) for layout in args.layout]


def _shapes(args) -> list[tuple[str, int, int, int, int]]:
    shapes = []
    for n in args.n:
        for d in args.dense_d:
            for heads in args.dense_heads:
                for name in ("causal", "full"):
                    shapes.append((name, d, *HEADS[heads], n))
        for heads in args.variant_heads:
            for name in args.variants:
                shapes.append((name, 128, *HEADS[heads], n))
    return shapes


def versions() -> dict:
    from importlib import metadata
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    if torch.cuda.is_available():
        out["cudnn"] = torch.backends.cudnn.version()
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "triton", "nvidia-cudnn-frontend"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def ours_point(args, name, d, n) -> tuple[dict, str]:
    """(point, origin) our lowered variant runs at: --ours-config, else what the product would use
    for the shape (a --tuned-run's bucket, else the untuned default: expkit.peers.product_point)."""
    if args.ours_config:
        return parse_point(args.ours_config), "--ours-config"
    return product_point(name, d, n, args.tuned_runs)


def prebuild(shapes, ours_variants, args) -> None:
    """Compile our cubins for every shape up front, in parallel (nvcc runs outside the GIL): one
    at a time they took most of a device call."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace
    from cubridge.runtime.fa3_sm90 import build_cubin, default_config
    jobs = set()
    for name, d, _, _, n, _ in shapes:
        if name in ("causal", "full"):
            jobs.add((default_config(d, name == "causal", seqlen=n), None))
        else:
            point = ours_point(args, name, d, n)[0]
            jobs.add((replace(default_config(d, False, True, n, variant=True), **point), ours_variants.lowered(name)[2]))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda job: build_cubin(job[0], source=job[1]), jobs))


def inputs(b, h, n, d, layout, g):
    """A [B, H, N, D] bf16 view: contiguous (bhnd) or over [B, N, H, D] memory (bnhd)."""
    if layout == "bnhd":
        return torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    return torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)


def run_shape(name, d, hq, hkv, n, layout, args, ours_variants, result):
    b = max(1, TOKENS // n)
    spec = load_spec(name)
    hooks = spec.hooks_for(n, n, hq, hkv, "cuda")
    flops = 4.0 * d * count_attended(hooks, b, hq, n, n, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1000 * n + d + hq)
    q, k, v = (inputs(b, h, n, d, layout, g) for h in (hq, hkv, hkv))
    check = SampledCheck(q, k, v, hooks)
    base = {"variant": name, "N": n, "B": b, "D": d, "Hq": hq, "Hkv": hkv, "dtype": "bf16", "layout": layout}
    point, origin = (None, "dense default_config") if name in ("causal", "full") else ours_point(args, name, d, n)
    ran, ours_out = [], None
    for system, make in makers(name, hooks, q, k, v, ours_variants, point).items():
        if system not in args.systems and system != OURS:
            continue
        try:
            t0 = time.time()
            fn, note = make()
            out = fn()
            torch.cuda.synchronize()
            verdict = check.verdict(out)
            diff = max_diff(out, ours_out) if ours_out is not None else 0.0
            config = {}
            if system == OURS:
                ours_out = out.clone()
                config = {"config": point_label(point) if point else note, "config_origin": origin,
                          "patch": args.ours_patch}
            status = "pass" if verdict.passed else f"FAIL {verdict}"
            if not bool(torch.isfinite(out).all()):     # ours was NaN-poisoned: also catches unwritten rows
                status = "FAIL: NaN/Inf in the output (the sampled rows are only part of it)"
            ran.append((system, fn, {"check": status, "max_err": verdict.max_err, "bound": verdict.bound,
                                     "max_diff_vs_ours": round(diff, 6), "note": note,
                                     "setup_s": round(time.time() - t0, 1), **config}))
        except Unsupported as e:
            result["skipped"].append({**base, "system": system, "reason": str(e)})
        except Exception as e:  # noqa: BLE001 (a peer that breaks is recorded, not fatal)
            result["skipped"].append({**base, "system": system,
                                      "reason": f"{type(e).__name__}: {str(e)[:300]}"})
            traceback.print_exc(limit=2)
        finally:
            torch.cuda.empty_cache()
    if not ran:
        return
    times = bench_round_robin([fn for _, fn, _ in ran], warmup=args.warmup, reps=args.reps)
    for (system, _, info), t in zip(ran, times):
        row = {"system": system, **base, "ms": round(t.median_ms, 4), "p20_ms": round(t.p20_ms, 4),
               "p80_ms": round(t.p80_ms, 4), "tflops": round(tflops(flops, t.median_ms), 1), **info}
        result["rows"].append(row)
        flag = "" if info["check"] == "pass" else "  << " + info["check"][:70]
        print(f"{name:<22} D{d:<4} {hq:>3}/{hkv:<3} N={n:<6} B={b} {layout} {system:<18} {row['ms']:9.3f} ms "
              f"{row['tflops']:7.1f} TFLOPS  diff {info['max_diff_vs_ours']:.2e}{flag}", flush=True)


def summary(result) -> list[dict]:
    """Per shape: ours, each peer, the best peer that passed its check, and ours / best."""
    table = {}
    for r in result["rows"]:
        key = (r["variant"], r["D"], r["Hq"], r["Hkv"], r["N"], r.get("layout", "bhnd"))
        table.setdefault(key, {})[r["system"]] = r
    lines = []
    for key, by in table.items():
        ours = by.get(OURS)
        peers = {s: by[s] for s in PEERS if s in by}
        good = {s: r["tflops"] for s, r in peers.items() if r["check"] == "pass"}
        best = max(good, key=good.get) if good else None
        lines.append({"variant": key[0], "D": key[1], "Hq": key[2], "Hkv": key[3], "N": key[4], "layout": key[5],
                      "ours": ours["tflops"] if ours else None, "ours_config": ours.get("config") if ours else None,
                      "ours_check": ours["check"] if ours else None,
                      **{s: (r["tflops"], r["check"] == "pass") for s, r in peers.items()},
                      "best_peer": best, "ratio": round(ours["tflops"] / good[best], 3)
                      if ours and best and ours["check"] == "pass" else None})
    return lines


def print_table(lines) -> None:
    print(f"\n{'variant (our config)':<34} {'D':>3} {'heads':>6} {'N':>6} {'ours':>7} " +
          " ".join(f"{p:>11}" for p in PEERS) + f" {'best peer':>11} {'ours/best':>9}")
    for ln in lines:
        cells = []
        for p in PEERS:
            if p in ln:
                tf, ok = ln[p]
                cells.append(f"{tf:10.1f}{' ' if ok else '!'}")
            else:
                cells.append(f"{'-':>11}")
        ratio = f"{ln['ratio']:9.3f}" if ln["ratio"] is not None else f"{'-':>9}"
        ours = f"{ln['ours']:7.1f}" if ln["ours"] is not None else f"{'-':>7}"
        label = ln["variant"] + ("" if ln.get("layout", "bhnd") == "bhnd" else f" ({ln['layout']})")
        label += f" {ln.get('ours_config') or ''}"
        print(f"{label:<34} {ln['D']:>3} {ln['Hq']:>3}/{ln['Hkv']:<2} {ln['N']:>6} {ours} " +
              " ".join(cells) + f" {ln['best_peer'] or '-':>11} {ratio}")
    print("('!' = failed the check: timed, never the best peer)")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="dense D128 MHA + 3 variants at 1k and 8k")
    ap.add_argument("--plan", action="store_true", help="print the shapes and exit (no GPU)")
    ap.add_argument("--n", type=int, nargs="+", default=LENGTHS)
    ap.add_argument("--dense-d", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--dense-heads", nargs="*", default=["mha", "gqa"], choices=list(HEADS))
    ap.add_argument("--variants", nargs="*",
                    default=[s for s in builtin_specs() if s not in ("full", "causal")])
    ap.add_argument("--variant-heads", nargs="+", default=["mha"], choices=list(HEADS),
                    help="head counts of the variant shapes (gqa16/4: experiments/llama_client.py's model)")
    ap.add_argument("--layout", nargs="+", default=["bhnd"], choices=LAYOUTS,
                    help="input memory: [B, H, N, D] or [B, N, H, D] seen as [B, H, N, D] (transformers)")
    ap.add_argument("--systems", nargs="+", default=list(PEERS), help="peers to run (ours always runs)")
    ap.add_argument("--tuned-run", action="append", default=[], metavar="DIR",
                    help="a cubridge-tune run directory: its variant (dispatch.json spec_name) runs at the "
                         "run's config for each N (what cubridge.load(DIR) picks); other variants at the "
                         "untuned default (build_run's)")
    ap.add_argument("--ours-config", metavar="BMxBNsS[p]", help="every lowered variant at this tile config "
                    "instead (e.g. 128x160s2p; an A/B of the default policy)")
    ap.add_argument("--ours-patch", action="append", default=[], metavar="NAME",
                    help="experiments/patches/NAME.patch applied to our lowered variants (expkit.lowered_patched)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.dense_d, args.dense_heads = [1024, 8192], [128], ["mha"]
        args.variants, args.reps = QUICK_VARIANTS, min(args.reps, 20)
    unknown = [s for s in args.systems if s not in PEERS]
    if unknown:
        ap.error(f"--systems: unknown {unknown}; choose from {list(PEERS)}")
    bad = [v for v in args.variants if v not in builtin_specs()]
    if bad:
        ap.error(f"--variants: unknown {bad}; built-in specs are {builtin_specs()}")
    if args.ours_config:
        try:
            parse_point(args.ours_config)
        except ValueError as e:
            ap.error(f"--ours-config: {e}")
    args.tuned_runs = {}
    for run in args.tuned_run:
        dispatch = Path(run) / "dispatch.json"
        if not dispatch.is_file():
            ap.error(f"--tuned-run {run}: no dispatch.json (not a tuned cubridge-tune run)")
        args.tuned_runs[json.loads(dispatch.read_text())["spec_name"]] = run
    return args


def main(argv=None) -> int:
    args = parse(argv)
    shapes = plan(args)
    if args.plan:
        for s in shapes:
            print(*s)
        return 0
    if not torch.cuda.is_available():
        print("error: bench_peers.py: no CUDA device (use --plan to list the shapes)", file=sys.stderr)
        return 2
    from expkit import Ours, lowered_patched
    ours_variants = Ours((lambda src: lowered_patched(src, *args.ours_patch)) if args.ours_patch else None)
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
              "versions": versions(), "tokens": TOKENS, "ours_patch": args.ours_patch,
              "ours_config": args.ours_config or "what the product runs (tuned run / untuned default)",
              "protocol": f"bench_round_robin, {args.warmup} warm-ups, median of {args.reps}, L2 flushed; "
                          "check = rule at sampled rows (float64 golden, bf16 ref)",
              "rows": [], "skipped": []}
    prebuild(shapes, ours_variants, args)
    for shape in shapes:
        run_shape(*shape, args, ours_variants, result)
        result["summary"] = summary(result)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    print_table(result.get("summary", []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
