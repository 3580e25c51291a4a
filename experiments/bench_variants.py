"""Side-by-side benchmark of the ten variants: ours (rules transfer lowered onto fa3_sm90) vs
FlexAttention (the same mask_mod / score_mod), SDPA with a boolean mask, eager PyTorch, and for
the normalisations FlexAttention cannot express (relu, sigmoid, composite) torch.compile of the
reference and our own causal softmax kernel at the same shape. One JSON per run.

    python experiments/bench_variants.py --out $OUT/variants.json [--n 1024 8192] [--variants ...]

TFLOPS = 4 * B * Hq * D * (attended pairs) / time, pairs counted exactly from the spec's mask.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from datetime import date

import torch
import torch.nn.functional as F

from expkit import D, TOKENS, Ours, versions
from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
from cubridge.runtime.timing import bench, compiled_flex_attention, tflops
from cubridge.spec import builtin_specs, load_spec
from cubridge.transfer.pairs import count_attended

MODELS = {"llama2-7b": (32, 32), "qwen2.5-72b": (64, 8), "llama3.1-405b": (128, 8)}
NO_FLEX = ("relu", "sigmoid", "composite")
EAGER_MAX_N = 8192          # the materialised fp32 score matrix beyond this does not fit


def causal_softmax(q, k, v):
    cfg = default_config(D, True, True, q.shape[2])
    out = torch.empty_like(q)
    return lambda: fa3_forward(q, k, v, causal=True, config=cfg, out=out)


def rows_for(args):
    out = []
    for n in args.n:                     # shapes in the order given: the most wanted first
        for model in args.models:
            for name in args.variants:
                if model != "llama2-7b" and (name != "prefixlm" or n not in args.gqa_n):
                    continue                 # the GQA bars are for prefixlm at a few lengths
                out.append((name, model, n))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--variants", nargs="+", default=builtin_specs())
    ap.add_argument("--models", nargs="+", default=["llama2-7b"],
                    help="llama2-7b, qwen2.5-72b, llama3.1-405b (GQA models: prefixlm only)")
    ap.add_argument("--gqa-n", type=int, nargs="+", default=[1024, 8192], help="lengths for the GQA models")
    ap.add_argument("--systems", nargs="+",
                    default=["ours", "flex", "sdpa_mask", "eager", "compiled_reference", "ours_causal"])
    ap.add_argument("--budget-ms", type=float, default=1500.0)
    ap.add_argument("--sweep-variants", nargs="*", default=["global_sliding_window", "share_question", "composite"],
                    help="variants also timed at other BLOCK_N (what the tuner would choose between)")
    ap.add_argument("--sweep-block-n", type=int, nargs="*", default=[64, 96, 176])
    args = ap.parse_args()
    torch.manual_seed(0)
    ours, flex = Ours(), {}
    result = {"gpu": torch.cuda.get_device_name(), "date": str(date.today()), "versions": versions(),
              "protocol": "CUDA events, 5 warm-ups, median, L2 flushed before each rep (cubridge.runtime.timing)",
              "rows": [], "skipped": []}
    compiled = {}
    for name, model, n in rows_for(args):
        hq, hkv = MODELS[model]
        b = max(1, TOKENS // n)
        spec = load_spec(name)
        hooks = spec.hooks_for(n, n, hq, hkv, "cuda")
        pairs = count_attended(hooks, b, hq, n, n, device="cuda")
        flops = 4.0 * D * pairs
        q = torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, n, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, n, D, device="cuda", dtype=torch.bfloat16)
        systems = {}
        if "ours" in args.systems:
            systems["cubridge/fa3_sm90"] = lambda: ours.fn(name, q, k, v)   # noqa: B023 (called at once)
            for bn in (args.sweep_block_n if name in args.sweep_variants else []):
                systems[f"cubridge/fa3_sm90 block_n={bn}"] = lambda bn=bn: ours.fn(name, q, k, v, bn)
        if "ours_causal" in args.systems and name in NO_FLEX:
            systems["cubridge/fa3_sm90 causal softmax"] = lambda: causal_softmax(q, k, v)
        if "flex" in args.systems and name not in NO_FLEX:
            def mk_flex():
                if not flex:
                    flex["fx"], flex["cbm"] = compiled_flex_attention()
                fx, cbm = flex["fx"], flex["cbm"]
                bm = cbm(hooks.mask_mod, None, None, n, n, device="cuda") if hooks.mask_mod else None
                return lambda: fx(q, k, v, score_mod=hooks.score_mod, block_mask=bm, enable_gqa=hq != hkv)
            systems["flex"] = mk_flex
        if "sdpa_mask" in args.systems and name not in NO_FLEX and hooks.score_mod is None:
            def mk_sdpa():
                qi = torch.arange(n, device="cuda").view(-1, 1)
                ki = torch.arange(n, device="cuda").view(1, -1)
                mask = hooks.mask_mod(torch.zeros((), dtype=torch.long, device="cuda"),
                                      torch.zeros((), dtype=torch.long, device="cuda"), qi, ki) \
                    if hooks.mask_mod else torch.ones(n, n, dtype=torch.bool, device="cuda")
                from torch.nn.attention import SDPBackend, sdpa_kernel
                kk, vv = (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)) if hq != hkv else (k, v)
                def call():
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
                return call
            systems["sdpa_mask"] = mk_sdpa
        if "eager" in args.systems and n <= EAGER_MAX_N:
            systems["eager"] = lambda: (lambda: spec.run_reference(q.float(), k.float(), v.float()))
        if "compiled_reference" in args.systems and name in NO_FLEX and n <= EAGER_MAX_N:
            def mk_compiled():
                if name not in compiled:
                    import torch._dynamo
                    torch._dynamo.config.cache_size_limit = 1 << 12
                    compiled[name] = torch.compile(spec.reference)
                c = compiled[name]
                return lambda: c(q.float(), k.float(), v.float())
            systems["compiled_reference"] = mk_compiled
        for system, make in systems.items():
            label = system.split(" ")[0]
            variant = "causal" if "causal softmax" in system else name
            config = system.split(" ", 1)[1] if " block_n=" in system else None
            try:
                t0 = time.time()
                fn = make()
                t = bench(fn, budget_ms=args.budget_ms)
                fl = flops if variant == name else 4.0 * D * b * hq * n * (n + 1) / 2
                row = {"system": label, "variant": variant, "model": model, "N": n, "B": b, "Hq": hq,
                       "Hkv": hkv, "D": D, "dtype": "bf16", "ms": round(t.median_ms, 4),
                       "tflops": round(tflops(fl, t.median_ms), 1), "for_variant": name,
                       "setup_s": round(time.time() - t0, 1), "config": config}
                result["rows"].append(row)
                print(f"{name:<22} {model:<13} {n:>6} {system:<34} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOPS",
                      flush=True)
            except Exception as e:  # a baseline that cannot run at this shape is recorded, not fatal
                result["skipped"].append({"system": system, "variant": name, "model": model, "N": n,
                                          "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{name:<22} {model:<13} {n:>6} {system:<34} skipped: {type(e).__name__}: {str(e)[:120]}",
                      flush=True)
                if not isinstance(e, torch.cuda.OutOfMemoryError):
                    traceback.print_exc(limit=3)
            finally:
                torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    summary(result)


def summary(result):
    by = {}
    for r in result["rows"]:
        key = r["system"] + ("/causal" if r["variant"] != r["for_variant"] else "")
        slot = by.setdefault((r["for_variant"], r["model"], r["N"]), {})
        slot[key] = max(slot.get(key, 0.0), r["tflops"])    # ours: the best config, as the tuner picks
    print("\nvariant                model          N      ours    flex  ratio   eager   compiled  ours-causal")
    for (name, model, n), s in by.items():
        ours = s.get("cubridge/fa3_sm90")
        fx = s.get("flex")
        ratio = f"{ours / fx:5.2f}" if ours and fx else "  -  "
        print(f"{name:<22} {model:<13} {n:>6} {ours or 0:7.1f} {fx or 0:7.1f} {ratio} {s.get('eager', 0):7.1f} "
              f"{s.get('compiled_reference', 0):9.1f} {s.get('cubridge/fa3_sm90/causal', 0):9.1f}")


if __name__ == "__main__":
    sys.exit(main())
