"""A/B of two sources of one lowered variant on fa3_sm90, in one process: the current lowering
(A) and the same source with text replacements (B), both verified under the rule on the GPU
(sigmoid_fma_share.check_all), then timed round-robin (bench_fa3's protocol), Llama2-7B heads.

    python experiments/ab_variant_source.py share_question --replace OLD NEW [--replace ...] \\
        --n 8192 1024 --out $OUT/ab.json

B is "what the kernel did before" when the replacements undo a change, e.g. the producer's
register budget: --replace "(kScanningProducer ? 56 : 40)" 40 --replace "(kScanningProducer ? 224 : 232)" 232
"""
from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

from expkit import D, TOKENS, Variant, check_all, replaced, time_ms_interleaved, versions
from cubridge.runtime.timing import tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"))
    ap.add_argument("--b-config", nargs="*", default=[], metavar="FIELD=INT",
                    help="Fa3Config fields B runs with instead of the variant default (e.g. stages=3)")
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 1024])
    ap.add_argument("--out")
    args = ap.parse_args()
    overrides = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.b_config}
    if not args.replace and not overrides:
        ap.error("give B something to differ by: --replace OLD NEW and / or --b-config FIELD=INT")
    systems = {"A (current)": Variant(args.variant, lambda s: s),
               "B (replaced)": Variant(args.variant, replaced(args.replace), overrides)}
    result = {"gpu": torch.cuda.get_device_name(), "date": str(date.today()), "versions": versions(),
              "variant": args.variant, "replace": args.replace, "b_config": overrides, "checks": {}, "rows": [],
              "protocol": "round-robin, L2 flushed, median of 30 (bench_fa3.time_ms_interleaved)"}
    result["checks"] = check_all(systems, args.n)
    for n in args.n:
        b, hq = max(1, TOKENS // n), 32
        q, k, v = (torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        pairs = count_attended(load_spec(args.variant).hooks_for(n, n, hq, hq, "cuda"), b, hq, n, n, device="cuda")
        ms = time_ms_interleaved([var.fn(q, k, v, out) for var in systems.values()])
        for label, t in zip(systems, ms):
            tf = tflops(4.0 * D * pairs, t)
            result["rows"].append({"system": label, "N": n, "B": b, "ms": round(t, 4), "tflops": round(tf, 1)})
            print(f"{n:>6} {label:<14} {t:8.3f} ms {tf:7.1f} TFLOPS", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
