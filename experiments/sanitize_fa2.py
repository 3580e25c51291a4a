"""Small fa2_sm80 cases to run under compute-sanitizer (memcheck, racecheck).

Causal GQA (Hq=4, Hkv=1) with ragged lengths (Nq=150, Nk=200: neither a multiple of any tile),
both head dims, plus one non-causal case; each result is checked against float32 attention so a
silent failure under the tool is also caught.

    compute-sanitizer --tool memcheck  --error-exitcode 9 python3 experiments/sanitize_fa2.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 experiments/sanitize_fa2.py
"""
from __future__ import annotations

import math
import sys

import torch

import expkit  # noqa: E402,F401 - cubridge importable from a bare checkout
from cubridge.runtime.fa2_sm80 import Fa2Sm80  # noqa: E402

TOLERANCE = 2e-2   # bf16 output vs float32 attention, |x| ~ 1


def reference(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def main() -> int:
    fa2 = Fa2Sm80()
    worst = 0.0
    for d, causal, (nq, nk) in [(128, True, (150, 200)), (64, True, (200, 150)), (128, False, (150, 200))]:
        q = torch.randn(1, 4, nq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 1, nk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 1, nk, d, device="cuda", dtype=torch.bfloat16)
        out, lse = fa2(q, k, v, causal=causal)
        torch.cuda.synchronize()
        err = (out.float() - reference(q, k, v, causal)).abs().max().item()
        worst = max(worst, err)
        print(f"sanitize case D={d} causal={causal} Nq={nq} Nk={nk} GQA 4/1: max err {err:.2e}")
    print("sanitize cases", "ok" if worst < TOLERANCE else "WRONG")
    return 0 if worst < TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
