"""Launch one lowered variant (rules transfer onto fa3_sm90) a few times at one shape, for ncu:

    ncu --section SpeedOfLight --section WarpStateStats -k regex:fa3 --launch-skip 2 --launch-count 1 \
        python experiments/profile_variant.py global_sliding_window 16384 [--block-n 128]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cubridge.cuir.parser import parse_file  # noqa: E402
from cubridge.lower import lower  # noqa: E402
from cubridge.paths import ref_kernel_dir  # noqa: E402
from cubridge.runtime.fa3_sm90 import default_config, fa3_forward  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.rules import transfer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("n", type=int)
    ap.add_argument("--block-n", type=int)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    hq = hkv = 32
    d, n = 128, args.n
    b = max(1, 16384 // n)
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), load_spec(args.variant))
    kern = lower(cand.program, "fa3_sm90")
    cfg = default_config(d, False, True, n)
    if args.block_n:
        cfg = replace(cfg, block_n=args.block_n)
    inputs = cand.bind(Nq=n, Nk=n, Hq=hq, Hkv=hkv, B=b, params={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n},
                       device="cuda")
    launch = kern.args(inputs, "cuda")
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    for _ in range(args.reps):
        fa3_forward(q, k, v, causal=False, config=cfg, variant=launch)
    torch.cuda.synchronize()
    print(f"{args.variant} N={n} B={b} {cfg}: {args.reps} launches done")


if __name__ == "__main__":
    main()
