"""GPU check of Fa3Config.tail_split (kernel.cu TAIL_SPLIT, off by default; full attention: the last
#tiles mod #CTAs tiles split along KV into chunks, combined by the last chunk's consumer; session 13's
mid call ran it as experiments/patches/tail_split.patch) on whole outputs, where the tail tiles are: small shapes with a capped grid (max_ctas) so that tails of 2-5 chunks occur at every head
dim's default tile, and the peer benchmark's 8k shapes at the full grid (33 / 16 chunks), there on
the last head of the last batch (the tail tiles in the default order) against float64. Per case:
output NaN-poisoned, the verification rule on O and on lse (golden float64, ref in bf16), inputs
unchanged, a bitwise rerun, and max |patched - product| over the whole output.

    python experiments/tail_split_check.py --out $OUT/tail_split_check.json
"""
from __future__ import annotations

import argparse
import json
import math
from datetime import datetime, timezone
from pathlib import Path

import torch

from dataclasses import replace

from cubridge import rule
from cubridge.runtime.fa3_sm90 import default_config, fa3_forward, tail_chunks

# (B, Hq, Hkv, N, D, max_ctas or None = one per SM)
CASES = [(1, 3, 3, 1000, 128, 11), (2, 4, 2, 3000, 128, 7), (1, 8, 1, 2500, 64, 9), (3, 2, 2, 777, 128, 4),
         (2, 32, 32, 8192, 128, None), (2, 64, 8, 8192, 128, None)]


def reference(q, k, v, b, h, dtype):
    """O and lse of batch b, query head h in `dtype` (float64: golden; bf16: the rule's ref)."""
    hk = h // (q.shape[1] // k.shape[1])
    qs, ks, vs = q[b, h].to(dtype), k[b, hk].to(dtype), v[b, hk].to(dtype)
    s = (qs @ ks.T) * (1.0 / math.sqrt(q.shape[-1]))
    return s.softmax(-1) @ vs, (s if s.dtype == torch.float64 else s.float()).logsumexp(-1)


def run(case):
    bsz, hq, hkv, n, d, cap = case
    base = default_config(d, False, True, n)
    cfg = replace(base, tail_split=True)
    g = torch.Generator(device="cuda").manual_seed(7 * n + d + hq)
    q = torch.randn(bsz, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(bsz, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    saved = [t.clone() for t in (q, k, v)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_tiles = math.ceil(n / cfg.block_m) * hq * bsz
    grid = min(n_tiles, sms, cap or sms)
    split = tail_chunks(n_tiles, grid, math.ceil(n / cfg.block_n))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((bsz, hq, n), float("nan"), device="cuda")
    fa3_forward(q, k, v, config=cfg, out=out, lse=lse, max_ctas=cap)
    prod, _ = fa3_forward(q, k, v, config=base, max_ctas=cap)
    torch.cuda.synchronize()
    problems = []
    if bool(torch.isnan(out).any()) or bool(torch.isnan(lse).any()):
        problems.append("an output element was not written (NaN poison left)")
    heads = [(b, h) for b in range(bsz) for h in range(hq)] if n <= 4096 else [(bsz - 1, hq - 1), (0, 0)]
    worst = 0.0
    for b, h in heads:
        go, gl = reference(q, k, v, b, h, torch.float64)
        ro, rl = reference(q, k, v, b, h, torch.bfloat16)
        for name, got, gold, ref in (("O", out[b, h], go, ro), ("lse", lse[b, h], gl, rl)):
            verdict = rule.compare(got, gold, ref)
            worst = max(worst, verdict.max_err)
            if not verdict.passed:
                problems.append(f"{name} of batch {b} head {h}: {verdict}")
    if not all(torch.equal(a, s) for a, s in zip((q, k, v), saved)):
        problems.append("inputs changed")
    out2, lse2 = fa3_forward(q, k, v, config=cfg, max_ctas=cap)
    if not (torch.equal(out2, out) and torch.equal(lse2, lse)):
        problems.append("rerun not bitwise equal")
    return {"case": list(case), "config": f"{cfg.block_m}x{cfg.block_n}", "tiles": n_tiles, "grid": grid,
            "chunks_per_tail_tile": split, "heads_checked": len(heads), "max_err": worst,
            "max_diff_vs_product": float((out.float() - prod.float()).abs().max()),
            "check": "pass" if not problems else "FAIL: " + "; ".join(problems[:4])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
              "option": "tail_split", "rows": []}
    for case in CASES:
        result["rows"].append(run(case))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{'B Hq/Hkv N D cap':<26} {'config':<8} {'tiles':>6} {'grid':>5} {'chunks':>6} {'max_err':>9} "
          f"{'vs product':>10}  check")
    for r in result["rows"]:
        b, hq, hkv, n, d, cap = r["case"]
        print(f"{f'{b} {hq}/{hkv} {n} {d} {cap}':<26} {r['config']:<8} {r['tiles']:>6} {r['grid']:>5} "
              f"{r['chunks_per_tail_tile']:>6} {r['max_err']:>9.2e} {r['max_diff_vs_product']:>10.2e}  {r['check']}")
    return 0 if all(r["check"] == "pass" for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
