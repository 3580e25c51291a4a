"""Launch one lowered variant (rules transfer onto fa3_sm90, as bench_variants.py runs it) a few
times at one shape, Llama2-7B heads, for ncu:

    ncu --section SpeedOfLight --section WarpStateStats -k regex:fa3 --launch-skip 2 --launch-count 1 \
        python experiments/profile_variant.py global_sliding_window 16384 [--block-n 128]

With --dense the reference kernel itself runs (variant: causal or full, no lowering); with --cudnn
cuDNN's SDPA runs instead, for a side-by-side profile (ncu -k regex:cudnn|sm90).
"""
from __future__ import annotations

import argparse

import torch

from expkit import D, TOKENS, Ours  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("n", type=int)
    ap.add_argument("--block-n", type=int)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--dense", action="store_true", help="the reference kernel (causal or full)")
    ap.add_argument("--cudnn", action="store_true", help="cuDNN SDPA (causal or full)")
    ap.add_argument("--head-dim", type=int, default=D, help="64 or 128 (--dense / --cudnn only)")
    args = ap.parse_args()
    b, h, d = max(1, TOKENS // args.n), 32, args.head_dim
    if d != D and not (args.dense or args.cudnn):
        ap.error("lowered variants are profiled at D = 128")
    q, k, v = (torch.randn(b, h, args.n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if (args.dense or args.cudnn) and args.variant not in ("causal", "full"):
        ap.error("--dense / --cudnn run causal or full only")
    causal = args.variant == "causal"
    if args.dense:
        from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
        cfg, out = default_config(d, causal, True, args.n), torch.empty_like(q)
        def run():
            fa3_forward(q, k, v, causal=causal, config=cfg, out=out)
    elif args.cudnn:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        run = Ours().fn(args.variant, q, k, v, args.block_n)
    for _ in range(args.reps):
        run()
    torch.cuda.synchronize()
    print(f"{args.variant} N={args.n} B={b}: {args.reps} launches done")


if __name__ == "__main__":
    main()
