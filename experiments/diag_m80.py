"""Where an fa3_bwd_sm90 option's gradients go wrong, if they do (session 16: TILE_M80's layouts). One small full
attention case (default: B 1, H 2, Nq 200, Nk 256, D 128, bf16), each gradient against torch.autograd in float64:
the verification rule's verdict, then the largest error per block (dQ: 16 query rows x 16 columns, dK / dV: 16 key
rows x 16 columns) as a map of digits (0: under the rule's bound, 9: >= 2^9 times it), and, for dQ, the best
match of each wrong 8 x 8 block anywhere in the reference (a permuted layout shows as an offset). GPU.

    python3 experiments/diag_m80.py [--option OPTION] [--nq 200 --nk 256 --heads 2]
"""
from __future__ import annotations

import argparse
import math
import sys

import expkit  # noqa: F401 - cubridge importable from a bare checkout
import torch

from cubridge import rule


def block_map(x: torch.Tensor, ref: torch.Tensor, bound: float, rows: int = 16, cols: int = 16) -> list[str]:
    err = (x.double() - ref).abs()
    lines = []
    for r0 in range(0, err.shape[0], rows):
        line = ""
        for c0 in range(0, err.shape[1], cols):
            e = float(err[r0:r0 + rows, c0:c0 + cols].max())
            line += "0" if e <= bound else str(min(9, int(math.log2(e / bound)) + 1))
        lines.append(f"{r0:5d} {line}")
    return lines


def best_offsets(x: torch.Tensor, ref: torch.Tensor, bound: float, limit: int = 6) -> list[str]:
    """For the first wrong 8 x 8 blocks of x, where in ref (block-aligned, also transposed) they match best."""
    out = []
    nb_r, nb_c = x.shape[0] // 8, x.shape[1] // 8
    for br in range(nb_r):
        for bc in range(nb_c):
            blk = x[8 * br:8 * br + 8, 8 * bc:8 * bc + 8].double()
            if float((blk - ref[8 * br:8 * br + 8, 8 * bc:8 * bc + 8]).abs().max()) <= bound:
                continue
            best = (math.inf, None)
            for rr in range(ref.shape[0] // 8):
                for cc in range(ref.shape[1] // 8):
                    cand = ref[8 * rr:8 * rr + 8, 8 * cc:8 * cc + 8]
                    for t, c in (("", cand), ("T", cand.t())):
                        e = float((blk - c).abs().max())
                        if e < best[0]:
                            best = (e, f"{t}({rr},{cc})")
            out.append(f"block ({br},{bc}) best match {best[1]} err {best[0]:.3g} (bound {bound:.3g})")
            if len(out) >= limit:
                return out
    return out


def main(argv=None) -> int:
    from cubridge.runtime.fa3_bwd_sm90 import M80_OPTIONS, fa3_backward
    from cubridge.runtime.fa3_sm90 import fa3_forward
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--option", default=M80_OPTIONS[0])
    ap.add_argument("--nq", type=int, default=200)
    ap.add_argument("--nk", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2)
    args = ap.parse_args(argv)
    bwd_reference = expkit.bwd_reference()
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, d = args.heads, 128
    q, dout = (torch.randn(1, h, args.nq, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, h, args.nk, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    out, lse = fa3_forward(q, k, v, causal=False)
    grads = fa3_backward(dout, q, k, v, out, lse, causal=False, option=args.option)
    torch.cuda.synchronize()
    scale = d ** -0.5
    golden = bwd_reference.reference(q.double(), k.double(), v.double(), dout.double(), False, scale)[2]
    ref = bwd_reference.reference(q, k, v, dout, False, scale)[2]
    ok = True
    for name, x, g, r in zip(("dq", "dk", "dv"), grads, golden, ref):
        verdict = rule.compare(x, g, r)
        ok &= bool(verdict.passed)
        print(f"{name}: {'pass' if verdict.passed else 'FAIL'} {verdict}")
        if verdict.passed:
            continue
        bound = 2 * float((r.double() - g).abs().max()) + 1e-5
        for head in range(h):
            print(f"  head {head}: max error per 16 x 16 block (0 = within the bound, n = 2^(n-1)..2^n x it)")
            print("\n".join("  " + ln for ln in block_map(x[0, head], g[0, head], bound)))
            if name == "dq":
                print("\n".join("  " + ln for ln in best_offsets(x[0, head], g[0, head], bound)))
    print("diag_m80:", "all pass" if ok else "SOME GRADIENT FAILS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
