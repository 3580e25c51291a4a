"""A/B of two sources of lowered variants on fa3_sm90, in one process: the current lowering
(A) and the same source with text replacements and / or kernel patches (B), both verified under
the rule on the GPU (expkit.check_all), then timed round-robin (bench_fa3's protocol), Llama2-7B
heads. A B that fails its check is not timed (its failures are in `checks`).

    python experiments/ab_variant_source.py share_question --replace OLD NEW [--replace ...] \\
        --n 8192 1024 --out $OUT/ab.json
    python experiments/ab_variant_source.py global_sliding_window prefixlm --patch mask_classes \\
        --n 1024 4096 --out $OUT/ab.json

B is "what the kernel did before" when the replacements undo a change, e.g. the producer's
register budget: --replace "(kScanningProducer ? 56 : 40)" 40 --replace "(kScanningProducer ? 224 : 232)" 232
--patch NAME applies experiments/patches/NAME.patch to each lowered source (expkit.lowered_patched:
its kernel.cu hunks must lie outside the generated regions; changed headers are inlined).
"""
from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from expkit import D, TOKENS, Variant, check_all, lowered_patched, replaced, time_ms_interleaved, versions
from cubridge.runtime.timing import tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"))
    ap.add_argument("--patch", action="append", default=[], metavar="NAME",
                    help="experiments/patches/NAME.patch applied to B's lowered source (repeatable)")
    ap.add_argument("--b-config", nargs="*", default=[], metavar="FIELD=INT",
                    help="Fa3Config fields B runs with instead of the variant default (e.g. stages=3)")
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 1024])
    ap.add_argument("--out")
    args = ap.parse_args()
    overrides = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.b_config}
    if not args.replace and not overrides and not args.patch:
        ap.error("give B something to differ by: --replace OLD NEW, --patch NAME and / or --b-config FIELD=INT")
    edit = replaced(args.replace) if args.replace else (lambda s: s)
    b_source = (lambda s: lowered_patched(edit(s), *args.patch)) if args.patch else edit
    result = {"gpu": torch.cuda.get_device_name(), "date": str(date.today()), "versions": versions(),
              "variants": args.variants, "replace": args.replace, "patch": args.patch, "b_config": overrides,
              "checks": {}, "rows": [], "protocol": "round-robin, L2 flushed, median of 30 (bench_fa3.time_ms_interleaved)"}
    systems = {}
    for name in args.variants:
        systems[f"{name} A (current)"] = Variant(name, lambda s: s)
        systems[f"{name} B (changed)"] = Variant(name, b_source, overrides)
    result["checks"] = check_all(systems, args.n)
    for name in args.variants:
        pair = {label: var for label, var in systems.items() if var.name == name}
        timed = {label: var for label, var in pair.items() if result["checks"][label] == "passed"}
        for n in args.n:
            _time(name, n, timed, result)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    _table(result)


def _time(name, n, systems, result):
    if not systems:
        return
    b, hq = max(1, TOKENS // n), 32
    q, k, v = (torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    pairs = count_attended(load_spec(name).hooks_for(n, n, hq, hq, "cuda"), b, hq, n, n, device="cuda")
    ms = time_ms_interleaved([var.fn(q, k, v, out) for var in systems.values()])
    for label, t in zip(systems, ms):
        tf = tflops(4.0 * D * pairs, t)
        result["rows"].append({"system": label, "variant": name, "N": n, "B": b, "ms": round(t, 4), "tflops": round(tf, 1)})
        print(f"{n:>6} {label:<40} {t:8.3f} ms {tf:7.1f} TFLOPS", flush=True)


def _table(result):
    """variant, N, A and B TFLOPS, B / A: the last thing printed."""
    by = {}
    for r in result["rows"]:
        by.setdefault((r["variant"], r["N"]), {})[r["system"].rsplit(" ", 2)[-2]] = r["tflops"]
    print(f"\n{'variant':<24} {'N':>6} {'A TFLOPS':>9} {'B TFLOPS':>9} {'B / A':>6}")
    for (name, n), t in by.items():
        ratio = f"{t['B'] / t['A']:6.3f}" if "A" in t and "B" in t else f"{'-':>6}"
        print(f"{name:<24} {n:>6} {t.get('A', '-'):>9} {t.get('B', '-'):>9} {ratio}")
    bad = {k: v for k, v in result["checks"].items() if v != "passed"}
    print("checks: all passed" if not bad else f"checks FAILED (not timed): {sorted(bad)}")


if __name__ == "__main__":
    main()
