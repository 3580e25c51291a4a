"""A/B of two versions of ref_kernels/fa3_sm90/kernel.cu in one process, timed round-robin with
bench_fa3's protocol (L2 flushed, median of 30), beside cuDNN. The older version is launched as
a "variant" source (same VariantArgs, same launch), so nothing but the source differs.

    python experiments/ab_fa3_kernel.py OTHER_kernel.cu --out ab.json

OTHER must have the current entry-point signature (tile_order included) and reset the tile
counter when done (release_tile_counter). The committed
ab_fa3_v7_vs_v6_h200.json compared kernel_v6_74f23f2.cu from a checkout of commit f771bc0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from expkit import REPEATS, TOKENS, WARMUP, NoArgs, attended_pairs, source_at, time_ms_interleaved
from cubridge.lower import Launchable  # noqa: E402
from cubridge.runtime.fa3_sm90 import default_config, fa3_forward  # noqa: E402

SHAPES = [(32, 32, 128, 1024), (32, 32, 128, 8192), (32, 32, 64, 8192), (64, 8, 128, 8192)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", help="the other kernel.cu: a path or COMMIT:ref_kernels/fa3_sm90/kernel.cu "
                                "(compiled with -I ref_kernels/fa3_sm90)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = source_at(args.old).read_text()
    if "fa3_sm90_tile_counts" not in text:   # the launch passes tile_order since commit 7c9a782
        sys.exit(f"{args.old}: its entry point predates the tile_order parameter this runtime passes; "
                 "A/B it from a checkout of commit f771bc0 (where 74f23f2:ref_kernels/fa3_sm90/kernel.cu was measured)")
    if "tma_load_4d" not in text:   # the runtime encodes 4-D maps (D, N, H, B) since session 8
        sys.exit(f"{args.old}: it reads 3-D TMA maps; this runtime encodes 4-D ones (A/B it from a checkout "
                 "before the 4-D maps)")
    if "release_tile_counter" not in text:   # the runtime keeps one counter per stream since then
        sys.exit(f"{args.old}: it does not reset the tile counter after a launch, which the runtime now "
                 "expects (one zeroed counter per stream); add release_tile_counter or A/B from an older checkout")
    old = Launchable(text, NoArgs(0), [])
    rows = []
    for hq, hkv, d, n in SHAPES:
        b = TOKENS // n
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        for causal in (True, False):
            cfg = default_config(d, causal, seqlen=n)
            out = torch.empty_like(q)
            ref = fa3_forward(q, k, v, causal=causal, config=cfg)[0].clone()
            got = fa3_forward(q, k, v, causal=causal, config=cfg, variant=old)[0]
            assert torch.equal(ref, got) or (ref - got).abs().max().item() < 2e-2, "versions disagree"

            def new_fn():
                fa3_forward(q, k, v, causal=causal, config=cfg, out=out)

            def old_fn():
                fa3_forward(q, k, v, causal=causal, config=cfg, out=out, variant=old)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
            names = ("new", "old", "cudnn")
            ms = time_ms_interleaved([new_fn, old_fn, cudnn])
            flops = 4 * b * hq * d * attended_pairs(n, causal)
            row = dict(Hq=hq, Hkv=hkv, D=d, N=n, B=b, causal=causal,
                       **{f"{s}_tflops": round(flops / t / 1e9, 1) for s, t in zip(names, ms)})
            rows.append(row)
            print(row, flush=True)
    res = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now().isoformat(),
               versions=dict(torch=torch.__version__, cuda=torch.version.cuda,
                             cudnn=torch.backends.cudnn.version(), python=platform.python_version()),
               protocol=f"CUDA events, {WARMUP} warm-up, median of {REPEATS}, L2 flushed, round-robin",
               old=str(args.old), rows=rows)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
