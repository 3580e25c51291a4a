"""How many sigmoids to run on the FMA pipe (cuir_sigmoid_fma) instead of MUFU tanh.approx, for the
lowered sigmoid and composite variants on fa3_sm90: each share (eighths of every thread's score
elements, spliced into the generated softmax region by with_share) is first verified
on the GPU under the verification rule (ragged, GQA, large scores), then timed round-robin beside
our causal softmax kernel at the same shape (bench_fa3's protocol: L2 flushed, median of 30).

    python experiments/sigmoid_fma_share.py --out $OUT/sigmoid_fma_share.json [--n 4096 8192 16384]

With --relu also relu. (A --fold option, composite with the softcap's 1/50 folded by hand, decided
whether to build that fold into the lowering; the lowering does it now, cubridge/lower/NOTES.md v14,
so the option is gone. Composite's sigmoid is now fused with its softcap, cubridge/lower/fusion.py,
and has no PLAIN line to share: --composite is empty by default and only the sigmoid variant takes
a share.)
"""
from __future__ import annotations

import argparse
import re
import json
from datetime import date
from pathlib import Path

import torch

from expkit import PATCHES, D, Variant, causal_baseline, check_all, time_ms_interleaved, versions
from cubridge.runtime.timing import tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402



PLAIN = "s[i] = cuir_sigmoid_half(fmaf(s[i], half_scale, half_bias));"
BIAS = re.compile(r"half_bias = 0\.5f \* (.+?);")
SIGMOID_FMA = (PATCHES / "knobs" / "sigmoid_fma.cuh").read_text()     # cuir_sigmoid_fma, not in the product


def with_share(source: str, eighths: int) -> str:
    """The lowered source with `eighths` of each thread's sigmoids (i % 8 < eighths) through
    patches/knobs/sigmoid_fma.cuh instead of MUFU tanh (the lowering emits the MUFU form only)."""
    if eighths == 0:
        return source
    bias = BIAS.search(source)
    assert PLAIN in source and bias and "struct SoftmaxState" in source, \
        "not a plain lowered sigmoid region (composite's is fused with its softcap: lower/fusion.py)"
    shared = (f"s[i] = i % 8 < {eighths} ? cuir_sigmoid_fma(fmaf(s[i], score_scale, {bias.group(1)}))"
              f" : cuir_sigmoid_half(fmaf(s[i], half_scale, half_bias));")
    return source.replace(PLAIN, shared).replace("struct SoftmaxState", SIGMOID_FMA + "struct SoftmaxState", 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--composite", type=int, nargs="*", default=[])
    ap.add_argument("--sigmoid", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--relu", action="store_true", help="also relu (no sigmoid: the third normalisation)")
    args = ap.parse_args()
    torch.manual_seed(0)
    systems = {}
    for e in args.composite:
        systems[f"composite e={e}"] = Variant("composite", lambda s, e=e: with_share(s, e))
    for e in args.sigmoid:
        systems[f"sigmoid e={e}"] = Variant("sigmoid", lambda s, e=e: with_share(s, e))
    if args.relu:
        systems["relu"] = Variant("relu", lambda s: s)
    result = {"gpu": torch.cuda.get_device_name(), "date": str(date.today()), "versions": versions(),
              "protocol": "round-robin, L2 flushed, median of 30 (bench_fa3.time_ms_interleaved)",
              "baseline": "cubridge/fa3_sm90 causal softmax, same shape, same run", "checks": {}, "rows": []}
    result["checks"] = check_all(systems, args.n)
    hq = 32
    for n in args.n:
        b, q, k, v, out, _, fns = causal_baseline(n, hq)
        for label, var in systems.items():
            fns[label] = var.fn(q, k, v, out)
        ms = time_ms_interleaved(list(fns.values()))
        base = None
        for (label, t) in zip(fns, ms):
            name = "causal" if label == "causal softmax" else label.split()[0]
            pairs = count_attended(load_spec(name).hooks_for(n, n, hq, hq, "cuda"), b, hq, n, n, device="cuda")
            tf = tflops(4.0 * D * pairs, t)
            base = tf if base is None else base
            row = {"system": label, "N": n, "B": b, "Hq": hq, "D": D, "ms": round(t, 4), "tflops": round(tf, 1),
                   "vs_causal_softmax": round(tf / base, 3)}
            result["rows"].append(row)
            print(f"{n:>6} {label:<22} {t:8.3f} ms {tf:7.1f} TFLOPS {tf / base:6.3f}x causal", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
