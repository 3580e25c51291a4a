"""A/B of the Hopper variant backward's options in one process, beside FlexAttention (Triton, FLASH):
per variant at N, our backward on each --options entry (VariantBackward(use_hopper=True,
hopper_option=...)) and the peers' autograd backward, timed round-robin (cubridge.runtime.timing.
bench_round_robin: L2 flushed, median). Our options should agree (a row says DISAGREES otherwise): dK / dV
bitwise (each CTA sums its own tile in a fixed order, whatever order the CTAs run in; an empty step
adds exact zeros; "+nofold", "+scsplit": within 2^-6 like dQ), dQ within 2^-6 of its max (reduce-add order). An option
"OPTION+qlist" is OPTION with q_range lowered as the exact query-tile list (cubridge.lower.fa3_bwd_sm90, CUBRIDGE_BWD_Q_LIST);
"OPTION+maskall" runs every step down the masked path (the cost of the mask per half-step);
"OPTION+wide" (TILE_ORDER 2 options) makes one section of all (batch, head) pairs (l2_bytes unbounded);
"OPTION+secK" sections of K pairs (K a power of two; +sec1 runs each pair's KV tiles in a row: TILE_ORDER 0's order);
"OPTION+nofit" sections sized by the whole L2 (CUBRIDGE_BWD_FIT_SECTIONS=0; the default sizes them by L2 / f);
"OPTION+staged" the dQ convert staged through shared memory (CUBRIDGE_BWD_STAGED_CONVERT=1, kernel.cu DQ_CONVERT 2);
"OPTION+tiled" the tiled dQ convert (CUBRIDGE_BWD_STAGED_CONVERT=0: the staged one is the variants' default since
session 16);
"OPTION+fused" the dQ convert fused into the main kernel (CUBRIDGE_BWD_FUSED_CONVERT=1, kernel.cu DQ_FUSE; session 16);
"OPTION+fused2" the same with the completions counted once per CTA (CUBRIDGE_BWD_FUSED_CONVERT=2, DQ_FUSE 2);
"OPTION+cap" sections capped at SMs / KV tiles pairs (CUBRIDGE_BWD_SECTION_CAP=1: 16 at 1k, 4 at 4k, 2 at 8k);
"OPTION+split" lowers with CUBRIDGE_BWD_RELU_SPLIT=1 (relu on the split passes on ISSUE 2 options);
"OPTION+nofold" with CUBRIDGE_BWD_NORM_FOLD=0 (sigmoid's constants not folded into the score region; folded, the
default since session 13, otherwise: "+fold" is kept as a no-op);
"OPTION+scsplit" lowers with CUBRIDGE_BWD_SOFTCAP_SPLIT=1 (a softcapped sigmoid, composite, on the split passes);
"OPTION+argcache" / "OPTION+noargcache" keep each shape's packed VariantArgs / pack them per call
(VariantBackward.cache_args; CUBRIDGE_BWD_ARGS_CACHE, on by default since session 14: per call, a blocking
host-to-device copy of the bound tables syncs the stream);
"OPTION+fit" (TILE_ORDER 2 options) sizes the sections by the attended fraction f of the pairs: l2_bytes =
L2 / f, i.e. a pair's Q / dO / dQ footprint counted at f (8k: global_sliding_window 32 pairs, share_question
16, prefixlm 8, against 4 unscaled; "+wide" = all 32).
"OPTION+rowless" lowers with CUBRIDGE_BWD_ROWLESS=1 (session 17: sigmoid / relu read no row terms: no O / dO read in the
preprocess, no LSE / Dvec rows loaded per stage; dK / dV bitwise the same); "OPTION+dsf" with CUBRIDGE_BWD_DS_FACTOR=1
(the P pass leaves dS / dP in the f32 P^T: composite and relu on the split passes; dK within 2^-6, as dQ);
"OPTION+scanbits" with CUBRIDGE_BWD_SCAN_BITS=1 (q_scan's runs built a run at a time; the same runs).
Suffixes combine ("bulk_overlap_lse_lean_l2lpt+qlist+wide"). --tokens T: B = T // N (default 16384; the eager bar's
shape, B 1 at 8k, is --tokens 8192).
Writes $OUT-style JSON (--out) and prints a table last.

    python3 experiments/ab_bwd_variant_order.py --out $OUT/x.json [--n 8192] [--variants ...]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import threading
import traceback
from pathlib import Path

import expkit
from expkit.peers import flex_autograd
import torch

from cubridge.runtime.timing import bench_round_robin, tflops
from cubridge.spec import load_spec
from cubridge.transfer.pairs import count_attended

# bench_bwd_variants.py's shapes: bf16, D = 128, 16 heads (MHA), B = 16384 // N
TOKENS, H, D = 16384, 16, 128
BWD_FLOP_FACTOR = 2.5

# "+maskall": the runs region's q_step_partial made to answer "masked" for every step (experiment
# only: what one masked half-step costs beside an unmasked one)
STEP_PARTIAL = "int m, int len_q, int len_k) {\n  return q_partial_at(va, b, h_kv, group, n0, kv_lo, m, len_q, len_k);\n}"
MASK_ALL = "int m, int len_q, int len_k) {\n  return true;\n}"
SECTION = re.compile(r"sec(\d+)")   # "+secK": TILE_ORDER 2 sections of K (batch, head) pairs
DEFAULT_OPTIONS = ["bulk_overlap_lse_lean", "bulk_overlap_lse_lean_l2lpt", "bulk_overlap_lse_lean+qlist"]
_ENV_LOCK = threading.Lock()   # lowered_option sets the lowering's env around one lowering (prebuild's threads)


def lowered_option(name, option):
    """(VariantBackward on `option`'s base, its suffixes) with the source lowered as the suffixes ask:
    "+qlist" the exact list (CUBRIDGE_BWD_Q_LIST=1), "+split" relu's split passes (CUBRIDGE_BWD_RELU_SPLIT=1),
    "+nofold" CUBRIDGE_BWD_NORM_FOLD=0 (else 1, the default), "+scsplit" CUBRIDGE_BWD_SOFTCAP_SPLIT=1, set only while the source is lowered (VariantBackward.hopper lowers once, on first use)."""
    import dataclasses

    from cubridge.lower.fa3_bwd_sm90 import (DS_FACTOR_ENV, NORM_FOLD_ENV, Q_LIST_ENV, RELU_SPLIT_ENV, ROWLESS_ENV,
                                             SCAN_BITS_ENV, SOFTCAP_SPLIT_ENV)
    from cubridge.runtime.variant_bwd import VariantBackward
    base, *extras = option.split("+")
    known = {"qlist", "maskall", "wide", "split", "fold", "nofold", "fit", "nofit", "staged", "tiled", "fused", "fused2", "cap", "argcache", "noargcache", "scsplit", "rowless", "dsf", "scanbits"}
    unknown = {e for e in extras if e not in known and not SECTION.fullmatch(e)}
    assert not unknown, f"{option}: unknown suffix {sorted(unknown)} ({sorted(known)}, secK)"
    extra = "qlist" if "qlist" in extras else ""
    bwd = VariantBackward(name, use_hopper=True, hopper_option=base)
    if {"argcache", "noargcache"} & set(extras):   # else the environment / default decides, as in the product
        bwd.cache_args = "argcache" in extras
    envs = {Q_LIST_ENV: "1" if extra == "qlist" else "0", RELU_SPLIT_ENV: "1" if "split" in extras else "0",
            NORM_FOLD_ENV: "0" if "nofold" in extras else "1",   # on by default since session 13 ("+fold" a no-op)
            SOFTCAP_SPLIT_ENV: "1" if "scsplit" in extras else "0", ROWLESS_ENV: "1" if "rowless" in extras else "0",
            DS_FACTOR_ENV: "1" if "dsf" in extras else "0", SCAN_BITS_ENV: "1" if "scanbits" in extras else "0"}
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in envs}
        os.environ.update(envs)
        try:
            source = bwd.hopper.source
        finally:
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
    if "split" in extras and bwd.ir.norm == "relu":
        assert "constexpr bool kDsFromP16 = kDsFromP32;" in source, f"{option}: relu split not lowered"
    if "nofold" not in extras and bwd.ir.norm == "sigmoid":
        assert "norm_fold" in source, f"{option}: normalisation not folded"
    if "scsplit" in extras and bwd.ir.norm == "sigmoid" and bwd.ir.score is not None:
        assert "cuir_softcap_grad_from_p" in source, f"{option}: softcapped sigmoid not split"
    if bwd.ir.norm != "softmax":
        assert ("constexpr bool kRowTerms = false;" in source) == ("rowless" in extras), f"{option}: row terms not as asked"
        assert ("constexpr bool kDsFactor = kDsFromP32;" in source) == ("dsf" in extras), f"{option}: dS factor not as asked"
    assert ("#define FA3B_Q_TILE_LIST" in source) == (extra == "qlist"), f"{option}: q_range not as asked"
    assert ("q_ffs(rest)" in source) == ("scanbits" in extras and extra != "qlist"), f"{option}: scan not as asked"
    if "maskall" in extras:   # every step down the masked path: correct, slower by the mask's cost
        assert source.count(STEP_PARTIAL) == 1, f"{option}: q_step_partial not found"
        bwd._hopper = dataclasses.replace(bwd.hopper, source=source.replace(STEP_PARTIAL, MASK_ALL))
    return bwd, extras


def prebuild(variants, options, ns, fwd_ours) -> None:
    """Every (variant, option) backward cubin at D 128 bf16 and every variant's forward (as
    expkit.Ours.fn configures it) built up front, 16 at a time (nvcc releases the GIL; built one by
    one on first call they took most of a device call). Failures surface again at the call."""
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.lower.fa3_sm90 import wide_tile
    from cubridge.runtime import fa3_bwd_sm90 as hb
    from cubridge.runtime import fa3_sm90

    def guarded(label, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - reported again where the variant runs
            print(f"  prebuild {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    # lowered one by one here (the lowering is not made for threads), only nvcc runs in the pool
    def converts(o):   # (fused, staged) as the call will build: "+fused", "+staged" / "+tiled", else the default
        extras = o.split("+")[1:]
        staged = "staged" in extras or ("tiled" not in extras and hb.staged_convert_enabled(hb.STAGED_VARIANT_DEFAULT))
        fused = 2 if "fused2" in extras else 1 if "fused" in extras else 0
        return (fused, staged and not fused)
    sources = {(o.split("+")[0], *converts(o), guarded(f"{v} {o}", lambda: lowered_option(v, o)[0].hopper.source))
               for v in variants for o in options}
    jobs = [(hb.build_cubin, D, False, True, option, fused, staged, src) for option, fused, staged, src in sources if src]
    for v in variants:
        lowered = guarded(f"{v} forward", fwd_ours.lowered, v)
        if lowered:
            jobs += [(fa3_sm90.build_cubin, fa3_sm90.default_config(D, False, True, n, variant=True,
                                                                    wide=wide_tile(lowered[1].ir)), lowered[2])
                     for n in ns]

    def build(job):
        fn, *args, source = job
        if fn is hb.build_cubin:
            d, causal, bf16, option, fused, staged = args
            return guarded(f"backward {option}", lambda: fn(d, causal, bf16, option=option, source=source, fuse=fused,
                                                            staged_convert=staged))
        return guarded("forward", lambda: fn(args[0], source=source))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(build, jobs))


def ours_option(name, option, q, k, v, dout, out, lse, attended_fraction=1.0):
    """Our backward on `option` (lowered_option's suffixes; "+wide", "+fit" as the module's docstring)."""
    bwd, extras = lowered_option(name, option)
    l2 = None
    sections = [int(m.group(1)) for m in map(SECTION.fullmatch, extras) if m]
    if "wide" in extras:      # TILE_ORDER 2 with one section of every (batch, head): an unbounded L2 budget
        l2 = 1 << 50
    elif sections:            # "+secK": sections of K pairs (K a power of two; 1 = each pair's tiles in a row)
        l2 = section_l2_bytes(sections[0], q.shape[2])
    elif "nofit" in extras:   # sections sized by the whole L2 (CUBRIDGE_BWD_FIT_SECTIONS=0's sizing)
        l2 = torch.cuda.get_device_properties(q.device).L2_cache_size
    elif "fit" in extras:     # a pair's footprint counted at the attended fraction
        l2 = int(torch.cuda.get_device_properties(q.device).L2_cache_size / max(attended_fraction, 1e-6))
    call = functools.partial(_with_l2, bwd, l2) if l2 is not None else bwd
    from cubridge.runtime.fa3_bwd_sm90 import FUSED_CONVERT_ENV, STAGED_CONVERT_ENV
    from cubridge.runtime.variant_bwd import SECTION_CAP_ENV
    envs = {STAGED_CONVERT_ENV: "1"} if "staged" in extras else {}   # the dQ convert staged (kernel.cu DQ_CONVERT 2)
    envs.update({STAGED_CONVERT_ENV: "0"} if "tiled" in extras else {})   # the tiled convert (the default until 16)
    envs.update({SECTION_CAP_ENV: "1"} if "cap" in extras else {})   # sections capped at SMs / KV tiles pairs
    envs.update({FUSED_CONVERT_ENV: "1"} if "fused" in extras else {})   # the dQ convert in the main kernel
    envs.update({FUSED_CONVERT_ENV: "2"} if "fused2" in extras else {})   # ... counted once per CTA
    if envs:
        call = functools.partial(expkit.call_with_env, envs, call)
    return {"bwd": lambda: call(dout, q, k, v, out, lse), "grads": call(dout, q, k, v, out, lse)}


def section_l2_bytes(section: int, len_q: int, group: int = 1) -> int:
    """The l2_bytes for which fa3_bwd_sm90.tile_sections answers `section` pairs (a power of two) at this shape."""
    from cubridge.runtime import fa3_bwd_sm90 as hb
    per_pair = group * len_q * (2 * D * hb.ELEM_BYTES + D * 4 + 2 * 4)   # tile_sections' footprint of a pair
    l2 = section * per_pair
    assert hb.tile_sections(1 << 20, group, len_q, D, True, l2) == section, f"section {section} is not a power of two"
    return l2


def _with_l2(bwd, l2_bytes, *args):
    """bwd(*args) with fa3_backward's l2_bytes set (VariantBackward looks fa3_backward up at each call). Forced over
    the l2_bytes VariantBackward passes itself since session 13's fit sections (a functools.partial keyword loses to
    the call's: "+wide" then ran the fit sections unnoticed)."""
    from cubridge.runtime import fa3_bwd_sm90 as hb
    orig = hb.fa3_backward

    def forced(*a, **kw):
        kw["l2_bytes"] = l2_bytes
        return orig(*a, **kw)
    hb.fa3_backward = forced
    try:
        return bwd(*args)
    finally:
        hb.fa3_backward = orig


def _inputs(n: int, b: int):
    return expkit.bwd_inputs(b, H, H, n, D, seed=n * 131 + b)      # q, k, v, dout


def flex_backward(hooks, q, k, v, dout, backend: str) -> dict:
    """FlexAttention's backward (autograd.grad on a retained graph) with the spec's mask / score mods;
    backend "flash": kernel_options={"BACKEND": "FLASH"}. Raises what the backend raises."""
    if not hooks.flex_expressible:
        raise RuntimeError(f"{hooks.normalization.kind} normalisation: FlexAttention is softmax only")
    leaves, forward = flex_autograd(hooks, q, k, v, backend)
    out = forward()
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return {"bwd": lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), "grads": grads}


def run_shape(name, n, options, peers, reps, fwd_ours, tokens: int = TOKENS):
    b = max(1, tokens // n)
    hooks = load_spec(name).hooks_for(n, n, H, H, "cuda")
    pairs = count_attended(hooks, b, H, n, n, device="cuda")
    flops = BWD_FLOP_FACTOR * 4.0 * D * pairs
    q, k, v, dout = _inputs(n, b)
    out, lse = fwd_ours.fn(name, q, k, v)()
    systems = {f"ours:{o}": ours_option(name, o, q, k, v, dout, out, lse, pairs / (b * H * n * n)) for o in options}
    for peer in peers:
        try:
            systems[peer] = flex_backward(hooks, q, k, v, dout, "triton" if peer == "flex" else "flash")
        except Exception as e:  # noqa: BLE001 - the backend's refusal is recorded, the others still run
            print(f"  {name} {peer} refused: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
    base = systems[f"ours:{options[0]}"]["grads"]
    agree = {}
    for o in options[1:]:
        g = systems[f"ours:{o}"]["grads"]
        rels = [(x.float() - y.float()).abs().max().item() / max(y.float().abs().max().item(), 1e-30)
                for x, y in zip(g, base)]
        bitwise = bool(torch.equal(g[1], base[1]) and torch.equal(g[2], base[2]))
        # "+nofold" / "+scsplit" compute P and dS with other roundings: dK / dV within 2^-6 as dQ, not bitwise
        loose = {"fold", "nofold", "scsplit", "dsf"} & set(o.split("+"))
        same = max(rels) <= 2 ** -6 if loose else bitwise and rels[0] <= 2 ** -6
        agree[f"ours:{o}"] = {"dkdv_bitwise": bitwise, "dq_rel": rels[0], "dkdv_rel": max(rels[1:]),
                              "agrees": bool(same)}
    names = [s for s, sy in systems.items() if sy.get("bwd") is not None]   # the backward alone
    timed = bench_round_robin([systems[s]["bwd"] for s in names], warmup=2, reps=reps)
    times = {s: {"bwd_ms": round(t.median_ms, 4)} for s, t in zip(names, timed)}
    ref = times[f"ours:{options[0]}"]["bwd_ms"]
    rows = []
    for s, t in times.items():
        rows.append({"variant": name, "N": n, "B": b, "system": s, "bwd_ms": t["bwd_ms"],
                     "bwd_tflops": round(tflops(flops, t["bwd_ms"]) or 0, 1),
                     "vs_first_option": round(ref / t["bwd_ms"], 3), **agree.get(s, {})})
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
    ap.add_argument("--tokens", type=int, default=TOKENS, help="B = tokens // N (8192: the eager bar's B 1 at 8k)")
    args = ap.parse_args(argv)
    result = {"gpu": torch.cuda.get_device_name(), "options": args.options, "rows": [], "failed": [],
              "protocol": f"round-robin, L2 flushed, {args.reps} reps, median (bench_round_robin, backward only)"}
    fwd_ours = expkit.Ours()
    prebuild(args.variants, args.options, args.n, fwd_ours)
    for n in args.n:
        for name in args.variants:
            try:
                result["rows"] += run_shape(name, n, args.options, args.peers, args.reps, fwd_ours, args.tokens)
            except Exception:  # noqa: BLE001 - one variant failing is reported, the others still run
                result["failed"].append({"variant": name, "N": n, "error": traceback.format_exc()[-1500:]})
                print(f"# {name} N={n}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
            torch.cuda.empty_cache()
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    print("| variant | N | system | bwd ms | bwd TFLOPS | speedup vs first option |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        note = "" if r.get("agrees", True) else (f" DISAGREES (dK/dV bitwise {r['dkdv_bitwise']}, dQ {r['dq_rel']:.1e}, "
                                                    f"dK/dV {r['dkdv_rel']:.1e})")
        print(f"| {r['variant']} | {r['N']} | {r['system']} | {r['bwd_ms']:.3f} | {r['bwd_tflops']:.0f} | "
              f"{r['vs_first_option']:.3f}{note} |")
    for f in result["failed"]:
        print(f"| {f['variant']} | {f['N']} | FAILED | {f['error'].splitlines()[-1][:80]} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
