"""Issue 18, item 4: A/B of FA4-inspired changes to fa3_sm90, each verified, timed round-robin
beside the unpatched kernel and FlashAttention-4 (ref_kernels/fa3_sm90/NOTES.md v17 has the
predictions).

Patches (experiments/patches/*.patch, unified diffs against ref_kernels/fa3_sm90/: lazy_rescale,
max_four_chains, k_before_v (session 7), s9_kernel, pv_wait_first (the P V wait before the whole
softmax, as before session 11), k_wait_before_turn; --patches may also name the experiment knobs,
e.g. knobs/kv_ascending; session 7's softmax_overlap and all_four are in git history) are applied to a copy of the kernel directory
(expkit.patched_source); the patched kernel.cu (with any patched header inlined) is
launched as a "variant" source, so the launch is the product's own. The unpatched kernel runs the
same way (`unpatched`), so only the source differs; `dense` is the product path, and the config
rows (FA4's tile shape, FA4's one-tile-per-CTA grid) run the product path with another Fa3Config.
Every system is checked first: output NaN-poisoned, then the rule at sampled rows (float64 golden,
bf16 ref), inputs unchanged, a bitwise rerun, and the patched output against the unpatched one.

    python experiments/ab_peer_patches.py --out $OUT/ab.json [--quick] [--patches NAME ...]
    python experiments/ab_peer_patches.py --long --tiles 128x160 --no-grid --patches kv_rotate l2_evict
        (session 9: full and causal D128, MHA 32/32 and GQA 64/8, 8k and 16k, where FA4 leads full;
        --tiles adds product-path rows at other BLOCK_M x BLOCK_N; NAME+NAME applies both patches,
        NAME@128x160 runs a patch at that tile instead of the default one, at D 128; --head-dims 128 64
        adds the same shapes at D 64)
    python experiments/ab_peer_patches.py --long --head-dims 128 64 --no-grid --patches s9_kernel \\
        --variants prefixlm relu
        (session 10: the forward as session 9 measured it against the product, dense and lowered
        variants: a patch of kernel.cu outside the regions the lowering regenerates reaches the
        variants too)
    python experiments/ab_peer_patches.py --build-only      # apply + compile every patch (CPU)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from expkit import KERNEL_REL, PATCHES, ROOT, inline_headers, patched_files, patched_source

# (variant, D, Hq, Hkv, N): where the gap to FA4 is (ANCHORS.md), short and long
SHAPES = [("causal", 128, 32, 32, 8192), ("full", 128, 32, 32, 8192), ("causal", 128, 32, 32, 1024),
          ("full", 128, 32, 32, 1024), ("causal", 64, 32, 32, 1024), ("causal", 128, 64, 8, 8192)]
QUICK_SHAPES = SHAPES[:3]
# Session 9 (peers_dense.json): FA4 leads full attention at D 128 by 5-11% from 4k on, causal is at par
# (--long: full / causal x MHA 32/32, GQA 64/8 x --lengths, 8k and 16k by default)


def parse_tile(text: str) -> tuple[int, int]:
    """'128x160' -> (128, 160)."""
    m, _, n = text.partition("x")
    if not (m.isdigit() and n.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: a tile is BLOCK_MxBLOCK_N, e.g. 128x160")
    return int(m), int(n)


def parse_tile_at(text: str) -> tuple[int, int, int, int | None]:
    """'128x160' -> (128, 128, 160, None) (D 128, the default's stages); 'd64:192x128s3' ->
    (64, 192, 128, 3): a tile row at that head dim with that many K/V stages."""
    d, sep, tile = text.partition(":") if ":" in text else ("d128", ":", text)
    tile, s_sep, stages = tile.partition("s")
    if not (d.startswith("d") and d[1:].isdigit()) or (s_sep and not stages.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: a tile row is [dD:]BLOCK_MxBLOCK_N[sSTAGES], e.g. d64:192x128s3")
    return (int(d[1:]), *parse_tile(tile), int(stages) if s_sep else None)


def split_patch(spec: str) -> tuple[list[str], tuple[int, int] | None]:
    """'a+b@128x160' -> (['a', 'b'], (128, 160)); no '@': the shape's default tile (None)."""
    names, _, tile = spec.partition("@")
    return names.split("+"), parse_tile(tile) if tile else None


def patch_config(spec: str, shape):
    """The config a patch spec runs at on `shape`: the default, or its @tile at D 128."""
    base = configs_for(shape)["default"]
    tile = split_patch(spec)[1]
    return base if tile is None or shape[1] != 128 else replace(base, block_m=tile[0], block_n=tile[1])


def patch_names() -> list[str]:
    """The A/B patches (experiments/patches/*.patch; the knobs under knobs/ are not A/B'd by default)."""
    return sorted(p.stem for p in PATCHES.glob("*.patch"))


def configs_for(shape, tiles=(), grid=True, options=()):
    """name -> Fa3Config: the default, FA4's choices where they differ from ours (its tile; its
    one-tile-per-CTA grid unless grid=False), `tiles` (D, BLOCK_M, BLOCK_N, stages or None) at their D as
    `tileMxN` where they differ from both, and the default with each of `options` (Fa3Config
    bool fields, NAME+NAME for several) set as `opt_NAME`."""
    from cubridge.runtime.fa3_sm90 import Fa3Config, default_config
    name, d, _, _, n = shape
    causal = name == "causal"
    base = default_config(d, causal, seqlen=n)
    fa4_tile = Fa3Config(d, 192 if d == 64 else 128, 128, 2, causal, True, persistent=True)
    out = {"default": base}
    if (fa4_tile.block_m, fa4_tile.block_n, fa4_tile.stages) != (base.block_m, base.block_n, base.stages):
        out["fa4_tile"] = fa4_tile
    if grid:
        out["fa4_grid"] = replace(base, persistent=False)   # one tile per CTA, as FA4's SM90 forward
    seen = {(c.block_m, c.block_n, c.stages) for c in out.values()}
    for td, bm, bn, stages in tiles:
        if td != d:
            continue
        cfg = replace(base, block_m=bm, block_n=bn, stages=stages or base.stages)
        if (bm, bn, cfg.stages) not in seen:
            out[f"tile{bm}x{bn}" + (f"s{stages}" if stages else "")] = cfg
    for spec in options:
        out[f"opt_{spec}"] = replace(base, **parse_options(spec))
    return out


def parse_options(spec: str) -> dict:
    """'kv_rotate+l2_hints=0' -> {'kv_rotate': True, 'l2_hints': False}; an int field takes its value
    ('exp2_emu=2+block_m=128' -> {'exp2_emu': 2, 'block_m': 128}; NAME=1 is True / 1 alike)."""
    def value(text: str):
        return True if text == "" else int(text) if text.isdigit() and text not in ("0", "1") else text != "0"
    return {name.partition("=")[0]: value(name.partition("=")[2]) for name in spec.split("+")}


def build_all(patches, shapes, tiles=(), grid=True, options=()):
    """Compile every (source, config) the run needs, in parallel (nvcc runs outside the GIL)."""
    from cubridge.runtime.fa3_sm90 import build_cubin
    jobs = {(None, c) for s in shapes for c in configs_for(s, tiles, grid, options).values()}
    jobs |= {(p, patch_config(p, s)) for s in shapes for p in patches}
    sources = {p: patched_source(*split_patch(p)[0]) for p in patches}
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda j: build_cubin(j[1], source=sources[j[0]] if j[0] else None), jobs))
    return sources


class _NoArgs(ctypes.Structure):          # the dense kernel's VariantArgs (one unused int)
    _fields_ = [("unused", ctypes.c_int32)]


def run_shape(shape, sources, args, result):
    import torch
    from expkit.peers import SampledCheck, Unsupported, make_cudnn, make_fa4
    from cubridge.lower import Launchable
    from cubridge.runtime.fa3_sm90 import fa3_forward
    from cubridge.runtime.timing import bench_round_robin, tflops
    from cubridge.spec import load_spec
    from cubridge.transfer.pairs import count_attended
    name, d, hq, hkv, n = shape
    b = 16384 // n
    hooks = load_spec(name).hooks_for(n, n, hq, hkv, "cuda")
    flops = 4.0 * d * count_attended(hooks, b, hq, n, n, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7 * n + d + hq)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    saved = [t.clone() for t in (q, k, v)]
    check = SampledCheck(q, k, v, hooks)
    causal, cfgs = name == "causal", configs_for(shape, args.tiles, args.grid, args.options)
    systems = {}
    for label, cfg in cfgs.items():
        systems["dense" if label == "default" else label] = (cfg, None)
    systems["unpatched"] = (cfgs["default"], Launchable((ROOT / KERNEL_REL / "kernel.cu").read_text(), _NoArgs(0), []))
    for p, text in sources.items():
        systems[p] = (patch_config(p, shape), Launchable(text, _NoArgs(0), []))
    fns, infos, base_out = [], [], None
    for label, (cfg, variant) in systems.items():
        out = torch.full_like(q, float("nan"))
        fn = (lambda cfg=cfg, variant=variant, out=out:
              fa3_forward(q, k, v, causal=causal, config=cfg, out=out, variant=variant)[0])
        first = fn().clone()
        torch.cuda.synchronize()
        verdict = check.verdict(first)
        status = "pass" if verdict.passed else f"FAIL {verdict}"
        if bool(torch.isnan(first).any()):
            status = "FAIL: an output element was not written (NaN poison left)"
        if not all(torch.equal(a, s) for a, s in zip((q, k, v), saved)):
            status = "FAIL: inputs changed"
        if not torch.equal(fn(), first):
            status = "FAIL: rerun not bitwise equal"
        if label == "unpatched":
            base_out = first
        other_tile = label in cfgs or label == "dense" or "@" in label
        same = None if base_out is None or other_tile else bool(torch.equal(first, base_out))
        fns.append(fn)
        infos.append({"system": label, "config": f"{cfg.block_m}x{cfg.block_n}s{cfg.stages}{'P' if cfg.persistent else 'G'}",
                      "check": status, "max_err": verdict.max_err, "bitwise_equal_unpatched": same})
    # FA4 as a user calls it; with GQA also without its packed Q tiles (pack_gqa defaults on there)
    # (--cudnn: SDPA's cuDNN backend beside them, the best peer at 1k)
    fa4_rows = [("fa4", {})] + ([("fa4_nopack", {"pack_gqa": False})] if hq != hkv else [])
    peer_rows = [(label, f"flash_attn_func{options or ''}", lambda options=options: make_fa4(name, q, k, v, **options))
                 for label, options in fa4_rows]
    peer_rows += [("sdpa_cudnn", "sdpa cudnn", lambda: make_cudnn(name, q, k, v))] * args.cudnn
    for label, config, make in peer_rows:
        try:
            fa4_fn, _ = make()
            fa4_status = "pass" if check.verdict(fa4_fn()).passed else "FAIL (rule at sampled rows)"
            fns.append(fa4_fn)
            infos.append({"system": label, "config": config, "check": fa4_status,
                          "bitwise_equal_unpatched": None})
        except Exception as e:  # noqa: BLE001 (a peer that breaks is recorded, not fatal)
            reason = str(e) if isinstance(e, Unsupported) else f"{type(e).__name__}: {str(e)[:300]}"
            result["skipped"].append({"shape": list(shape), "system": label, "reason": reason})
    times = bench_round_robin(fns, warmup=5, reps=args.reps)
    base_ms = times[[i["system"] for i in infos].index("unpatched")].median_ms
    for info, t in zip(infos, times):
        row = {"variant": name, "D": d, "Hq": hq, "Hkv": hkv, "N": n, "B": b, **info,
               "ms": round(t.median_ms, 4), "tflops": round(tflops(flops, t.median_ms), 1),
               "speedup_vs_unpatched": round(base_ms / t.median_ms, 3)}
        result["rows"].append(row)
        print(f"{name:<7} D{d:<4} {hq}/{hkv:<3} N={n:<6} {info['system']:<18} {info['config']:<12} "
              f"{row['tflops']:7.1f} TFLOPS  x{row['speedup_vs_unpatched']:.3f}  {info['check'][:60]}", flush=True)


# The regions cubridge.lower.fa3_sm90 regenerates for a variant: a patch inside one of them does
# not reach the lowered variants.
GENERATED = ("extra_io", "kv_range", "score", "mask", "softmax", "epilogue")


def variant_transform(spec: str):
    """The edit that puts patch spec (NAME or NAME+NAME) into a lowered variant's source, or None
    where it cannot: a header-only patch inlines its headers; a kernel.cu patch takes the patched
    kernel.cu with the variant's generated regions put in (the lowering onto the patched kernel).
    A region the patch edits reaches a variant only where the variant kept the reference's body
    (the lowering copies it: softmax and epilogue of a softmax variant); where the variant
    generated its own, the edit stops with an error naming the region."""
    from cubridge.lower import regions
    names = split_patch(spec)[0]
    changed = patched_files(*names)
    if "kernel.cu" not in changed:
        return lambda src: inline_headers(src, changed)
    product = (ROOT / KERNEL_REL / "kernel.cu").read_text()
    patched = changed["kernel.cu"]
    edited = [n for n in GENERATED if regions.body(patched, n) != regions.body(product, n)]

    def transform(src):
        own = [n for n in edited if regions.body(src, n) != regions.body(product, n)]
        if own:
            raise SystemExit(f"error: --patches {spec}: edits the {own[0]} region, which this variant "
                             "generates itself; A/B it on softmax variants only (e.g. prefixlm)")
        kept = {n: regions.body(src, n) for n in GENERATED if n not in edited}
        return inline_headers(regions.replace(patched, kept), changed)
    return transform


def variant_runners(patches):
    """label -> bench_variants.Ours: the lowered variants as shipped, and under each patch that
    reaches them (variant_transform); the patches that do not are printed."""
    from expkit import Ours
    runners = {"unpatched": Ours()}
    for p in patches:
        transform = variant_transform(p)
        if transform is None:
            print(f"{p}: edits a region the lowering regenerates; not A/B'd on the variants", flush=True)
        else:
            runners[p] = Ours(transform=transform)
    return runners


def reachable(runners, variants):
    """variant -> {label: runner} of the runners whose patch reaches it, and the skipped pairs
    (a patch editing a region the variant generates itself: variant_transform stops there)."""
    out, skipped = {}, []
    for v in variants:
        out[v] = {}
        for label, ours in runners.items():
            try:
                ours.lowered(v)
                out[v][label] = ours
            except SystemExit as e:
                skipped.append({"variant": v, "system": label, "reason": str(e)})
                print(f"{v} x {label}: skipped ({e})", flush=True)
    return out, skipped


def build_variants(per_variant, n):
    from cubridge.runtime.fa3_sm90 import build_cubin, default_config
    cfg = default_config(128, False, True, n, variant=True)
    jobs = [(ours, v) for v, runners in per_variant.items() for ours in runners.values()]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda j: build_cubin(cfg, source=j[0].lowered(j[1])[2]), jobs))


def run_variant(name, n, runners, args, result):
    """One lowered variant (Llama2-7B heads, D = 128) under each runner: checked, then timed."""
    import torch
    from expkit.peers import SampledCheck
    from cubridge.runtime.timing import bench_round_robin, tflops
    from cubridge.spec import load_spec
    from cubridge.transfer.pairs import count_attended
    b, h, d = 16384 // n, 32, 128
    hooks = load_spec(name).hooks_for(n, n, h, h, "cuda")
    flops = 4.0 * d * count_attended(hooks, b, h, n, n, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(11 * n + 5)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    saved = [t.clone() for t in (q, k, v)]
    check = SampledCheck(q, k, v, hooks)
    fns, infos, base_out = [], [], None
    for label, ours in runners.items():
        out = torch.full_like(q, float("nan"))
        run = ours.fn(name, q, k, v, out=out)
        fn = (lambda run=run, out=out: (run(), out)[1])
        first = fn().clone()
        verdict = check.verdict(first)
        status = "pass" if verdict.passed else f"FAIL {verdict}"
        if bool(torch.isnan(first).any()):
            status = "FAIL: an output element was not written (NaN poison left)"
        if not all(torch.equal(a, s) for a, s in zip((q, k, v), saved)):
            status = "FAIL: inputs changed"
        if not torch.equal(fn(), first):
            status = "FAIL: rerun not bitwise equal"
        base_out = first if base_out is None else base_out
        fns.append(fn)
        infos.append({"system": label, "config": "variant default", "check": status, "max_err": verdict.max_err,
                      "bitwise_equal_unpatched": bool(torch.equal(first, base_out))})
    times = bench_round_robin(fns, warmup=5, reps=args.reps)
    for info, t in zip(infos, times):
        row = {"variant": name, "D": d, "Hq": h, "Hkv": h, "N": n, "B": b, **info, "ms": round(t.median_ms, 4),
               "tflops": round(tflops(flops, t.median_ms), 1),
               "speedup_vs_unpatched": round(times[0].median_ms / t.median_ms, 3)}
        result["rows"].append(row)
        print(f"{name:<22} N={n:<6} {info['system']:<18} {row['tflops']:7.1f} TFLOPS  "
              f"x{row['speedup_vs_unpatched']:.3f}  {info['check'][:60]}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--patches", nargs="*", default=None, help=f"default: all ({', '.join(patch_names())})")
    ap.add_argument("--quick", action="store_true", help="causal / full D128 8k and causal 1k only")
    ap.add_argument("--long", action="store_true",
                    help="full and causal D128, MHA 32/32 and GQA 64/8, 8k and 16k (session 9's gap to FA4)")
    ap.add_argument("--head-dims", nargs="*", type=int, default=[128],
                    help="with --long: these head dims (e.g. 128 64)")
    ap.add_argument("--lengths", nargs="*", type=int, default=[8192, 16384],
                    help="with --long: these sequence lengths (B = 16384 // N)")
    ap.add_argument("--masks", nargs="*", choices=("full", "causal"), default=["full", "causal"],
                    help="with --long: these masks")
    ap.add_argument("--tiles", nargs="*", type=parse_tile_at, default=[],
                    help="also time the product kernel at these BLOCK_MxBLOCK_N tiles (D 128 shapes; "
                         "dD:MxN at head dim D, MxNsK with K stages, e.g. d64:192x128s3)")
    ap.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                    help="the fa4_grid row (one tile per CTA); --no-grid leaves it out")
    ap.add_argument("--options", nargs="*", default=[],
                    help="also time the product with these Fa3Config options set (kv_rotate, l2_hints; "
                         "NAME+NAME for both, NAME=0 to clear one the default sets, NAME=N for an int field: "
                         "exp2_emu=2, block_m=128) as opt_NAME rows")
    ap.add_argument("--cudnn", action="store_true", help="also time SDPA's cuDNN backend (sdpa_cudnn rows)")
    ap.add_argument("--build-only", action="store_true", help="apply and compile every patch, no GPU")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--variants", nargs="*", default=[],
                    help="also A/B these lowered variants at --variant-n under the patches that reach them "
                         "(variant_transform)")
    ap.add_argument("--variant-n", type=int, default=8192)
    ap.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                    help="the dense shapes (--no-dense: variants only)")
    args = ap.parse_args(argv)
    patches = patch_names() if args.patches is None else args.patches
    from cubridge.runtime.fa3_sm90 import Fa3Config
    flags = {f for f, v in Fa3Config.__dataclass_fields__.items() if v.type in ("bool", bool)} - {
        "causal", "bf16", "persistent"} | {"tile_sections", "exp2_emu", "block_m", "block_n", "stages"}   # ints
    unknown = [o for spec in args.options for o in parse_options(spec) if o not in flags]
    if unknown:
        ap.error(f"--options: {unknown[0]} is not a bool field of Fa3Config ({', '.join(sorted(flags))})")
    try:
        missing = [q for p in patches for q in split_patch(p)[0] if not (PATCHES / f"{q}.patch").exists()]
    except argparse.ArgumentTypeError as e:
        ap.error(f"--patches: {e}")
    if missing:
        ap.error(f"--patches: no experiments/patches/{missing[0]}.patch (have: {', '.join(patch_names())})")
    long_shapes = [(v, d, hq, hkv, n) for d in args.head_dims for n in args.lengths for hq, hkv in ((32, 32), (64, 8))
                   for v in args.masks]
    shapes = (long_shapes if args.long else QUICK_SHAPES if args.quick else SHAPES) if args.dense else []
    sources = build_all(patches, shapes, args.tiles, args.grid, args.options) if shapes else {}
    runners, per_variant, skipped = None, {}, []
    if args.variants:
        runners = variant_runners([p for p in patches if split_patch(p)[1] is None])
        per_variant, skipped = reachable(runners, args.variants)
        build_variants(per_variant, args.variant_n)
    print(f"built {len(patches)} patch(es) x their configs: {', '.join(patches)}"
          + (f"; variants {args.variants} x {list(runners)}" if runners else ""), flush=True)
    if args.build_only:
        return 0
    import torch
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
              "torch": torch.__version__, "patches": patches, "rows": [], "skipped": [],
              "protocol": f"bench_round_robin, 5 warm-ups, median of {args.reps}, L2 flushed",
              "skipped_variants": skipped}
    for shape in shapes:
        run_shape(shape, sources, args, result)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    for name in args.variants:
        run_variant(name, args.variant_n, per_variant[name], args, result)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    print_table(result["rows"])
    return 0


def print_table(rows):
    """One line per shape: the product's TFLOPS, each other system's speedup over it (x < 1:
    slower than the product), and any failed check."""
    shapes = {}
    for r in rows:
        shapes.setdefault((r["variant"], r["D"], r["Hq"], r["Hkv"], r["N"]), []).append(r)
    print("\nshape                        product  speedup of each system over the product")
    for (v, d, hq, hkv, n), rs in shapes.items():
        base = next((r for r in rs if r["system"] == "unpatched"), None)
        if base is None:
            continue
        others = "  ".join(f"{r['system']} {base['ms'] / r['ms']:.3f}" for r in rs if r is not base)
        failed = [r["system"] for r in rs if not str(r["check"]).startswith("pass")]
        print(f"{v:<8} D{d:<3} {hq}/{hkv:<3} {n:>6} {base['tflops']:8.1f}  {others}"
              + (f"  FAILED: {' '.join(failed)}" if failed else ""))


if __name__ == "__main__":
    sys.exit(main())
