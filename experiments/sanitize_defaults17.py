"""compute-sanitizer target for session 17's dense forward defaults at the lengths they apply (D 64 causal 4k with
align_end + tile_sections, D 128 causal 4k with tile_sections, D 128 causal 16k's 128 x 176 + sections), each checked
against a float32 reference of a sampled row block; exit 1 on a wrong answer.

    compute-sanitizer --tool memcheck python3 experiments/sanitize_defaults17.py
"""
from __future__ import annotations

import sys

import torch

import expkit  # noqa: F401 - makes the checkout's cubridge importable
from cubridge.runtime.fa3_sm90 import default_config, fa3_forward


def main() -> int:
    bad = 0
    for d, n, hq in ((64, 4096 + 64, 2), (128, 4096, 2), (128, 16384, 1)):
        cfg = default_config(d, True, True, n)
        g = torch.Generator(device="cuda").manual_seed(17 + d + n)
        q, k, v = (torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        out, _ = fa3_forward(q, k, v, causal=True, config=cfg)
        rows = slice(n - 256, n)                      # the last rows see every key: the longest tiles
        s = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) / d ** 0.5
        i = torch.arange(n, device="cuda")
        s = s.masked_fill(i[None, None, rows, None] < i[None, None, None, :], float("-inf"))
        ref = torch.softmax(s, -1) @ v.float()
        err = (out[:, :, rows].float() - ref).abs().max().item()
        ok = err < 2e-2
        bad += not ok
        print(f"D {d} N {n} {cfg.block_m}x{cfg.block_n} sections {cfg.tile_sections} align_end {cfg.align_end}: "
              f"max err {err:.2e} {'ok' if ok else 'WRONG'}")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
