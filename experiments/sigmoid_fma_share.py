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
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fa3 import time_ms_interleaved  # noqa: E402
from bench_variants import D, TOKENS, Ours, versions  # noqa: E402
from cubridge import rule  # noqa: E402
from cubridge.lower.cexpr import SIGMOID_FMA  # noqa: E402
from cubridge.runtime.fa3_sm90 import build_cubin, default_config, fa3_forward  # noqa: E402
from cubridge.runtime.timing import tflops  # noqa: E402
from cubridge.spec import count_attended, load_spec  # noqa: E402

CHECK_SHAPES = [(1, 4, 4, 1000, 128), (2, 8, 2, 300, 64), (1, 4, 1, 17, 128), (1, 2, 2, 2500, 128)]


PLAIN = "s[i] = cuir_sigmoid_half(fmaf(s[i], half_scale, half_bias));"
BIAS = re.compile(r"half_bias = 0\.5f \* (.+?);")


def with_share(source: str, eighths: int) -> str:
    """The lowered source with `eighths` of each thread's sigmoids (i % 8 < eighths) through
    cexpr.SIGMOID_FMA instead of MUFU tanh (the lowering emits the MUFU form only)."""
    if eighths == 0:
        return source
    bias = BIAS.search(source)
    assert PLAIN in source and bias and "struct SoftmaxState" in source, \
        "not a plain lowered sigmoid region (composite's is fused with its softcap: lower/fusion.py)"
    shared = (f"s[i] = i % 8 < {eighths} ? cuir_sigmoid_fma(fmaf(s[i], score_scale, {bias.group(1)}))"
              f" : cuir_sigmoid_half(fmaf(s[i], half_scale, half_bias));")
    return source.replace(PLAIN, shared).replace("struct SoftmaxState", SIGMOID_FMA + "struct SoftmaxState", 1)


def causal_baseline(n: int, hq: int = 32):
    """Llama2-7B-head bf16 inputs at N (16k tokens per shape), an output buffer, our causal softmax
    kernel's default config there, and {"causal softmax": its call}: the baseline every
    normalisation is read against. Returns (b, q, k, v, out, cfg, fns)."""
    b = max(1, TOKENS // n)
    q, k, v = (torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    cfg = default_config(D, True, True, n)
    return b, q, k, v, out, cfg, {"causal softmax": lambda: fa3_forward(q, k, v, causal=True, config=cfg, out=out)}


class Variant:
    """One lowered variant with an edited source (bench_variants.Ours does the lowering and launch)."""

    def __init__(self, name, source_fn, overrides=None):
        self.name, self.spec, self.ours = name, load_spec(name), Ours(source_fn)
        self.source = self.ours.lowered(name)[2]
        self.overrides = overrides or {}

    def fn(self, q, k, v, out):
        return self.ours.fn(self.name, q, k, v, out=out, overrides=self.overrides)


def check_all(systems: dict, lengths) -> dict:
    """Build every (source, config) up front, in parallel (nvcc runs outside the GIL), then the
    verification rule for each system: {label: "passed" or its failures}, printed as it goes."""
    configs = {default_config(dh, False, True, n, variant=True) for (_, _, _, n, dh) in CHECK_SHAPES}
    configs |= {default_config(D, False, True, n, variant=True) for n in lengths}
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: build_cubin(job[0], source=job[1]),
                      [(c, var.source) for var in systems.values() for c in configs]))
    checks = {}
    for label, var in systems.items():
        checks[label] = check(var) or "passed"
        print(f"check {label:<22} {checks[label]}", flush=True)
    return checks


def check(var: Variant) -> list[str]:
    """The verification rule at the GPU test shapes, plus scores scaled 4x (softcap and sigmoid
    saturation exercised)."""
    failures = []
    for shape in CHECK_SHAPES:
        for scale in (1.0, 4.0):
            B, Hq, Hkv, N, Dh = shape
            g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{var.name}{shape}{scale}".encode()))
            dtype = torch.float16 if N == 300 else torch.bfloat16
            q = (torch.randn(B, Hq, N, Dh, device="cuda", generator=g) * scale).to(dtype)
            k = (torch.randn(B, Hkv, N, Dh, device="cuda", generator=g) * scale).to(dtype)
            v = torch.randn(B, Hkv, N, Dh, device="cuda", generator=g).to(dtype)
            out = torch.full_like(q, float("nan"))
            var.fn(q, k, v, out)()
            torch.cuda.synchronize()
            golden = var.spec.run_reference(q.double(), k.double(), v.double())
            verdict = rule.compare(out, golden, var.spec.run_reference(q, k, v))
            if torch.isnan(out).any() or not verdict.passed:
                failures.append(f"{shape} x{scale}: {verdict}")
    return failures


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
