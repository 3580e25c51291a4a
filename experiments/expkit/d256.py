"""Head dim 256 rows shared by experiments/bench_d256.py and experiments/ncu_stalls_fwd.py (issue 19): the
row syntax of our configs (BLOCK_MxBLOCK_N and option flags) and the dense causal callables of ours and
FlashAttention-4 at D = 256. Needs torch (and a GPU to call what it makes)."""
from __future__ import annotations

import argparse

from expkit.peers import Unsupported, bshd

D = 256
# Our rows: BLOCK_M x BLOCK_N, then flags: g = one tile per CTA (FA4's SM90 launch; default
# persistent: grid = #SMs, dynamic scheduler), f = free consumers (Fa3Config.wg_turns=False: no GEMM
# turns, FA4's schedule at D 256), r = O rescaled while the next QK runs (rescale_before_pv, FA4's
# rescale_O_before_gemm), s = the whole softmax before the P V wait (softmax_first), k = the producer
# issues K_i before V_{i-1} (k_before_v, FA4's load order), e = the P V waited for before the softmax
# (pv_wait_early: the V slot freed earlier), z = mbarrier waits sleep in the barrier (mbar_sleep), u = the
# consumer index warp-uniform in the consumers (uniform_q: the Q descriptor in uniform registers), l = tiles in
# L2-sized sections of heads, longest first inside a section (tile_sections), L = one section of every head (all
# tiles longest first, tile_sections=1 << 16), v = V_{i-1} waited for before the QK issue (v_wait_first: O's rescale
# and both GEMMs' issue in one block); --rows picks them.


def parse_row(text: str) -> tuple[int, int, dict]:
    """'128x80' -> (128, 80, {}); '128x80gf' -> (128, 80, Fa3Config overrides).

    >>> parse_row("128x80"), parse_row("128x64g"), parse_row("128x80fr")
    ((128, 80, {}), (128, 64, {'persistent': False}), (128, 80, {'wg_turns': False, 'rescale_before_pv': True}))
    >>> parse_row("128x80frs")[2]["softmax_first"], parse_row("128x80fru")[2]["uniform_q"]
    (True, True)
    """
    body = text.rstrip("gfrskezulLv")
    flags = text[len(body):]
    m, _, n = body.partition("x")
    if not (m.isdigit() and n.isdigit()) or len(set(flags)) != len(flags):
        raise argparse.ArgumentTypeError(f"{text!r}: a row is BLOCK_MxBLOCK_N[g][f][r][s][k][e][z][u][l|L][v], e.g. 128x80, 128x80g, 128x80frk")
    return int(m), int(n), {**({"persistent": False} if "g" in flags else {}),
                            **({"wg_turns": False} if "f" in flags else {}),
                            **({"rescale_before_pv": True} if "r" in flags else {}),
                            **({"softmax_first": True} if "s" in flags else {}),
                            **({"k_before_v": True} if "k" in flags else {}),
                            **({"pv_wait_early": True} if "e" in flags else {}),
                            **({"mbar_sleep": True} if "z" in flags else {}),
                            **({"uniform_q": True} if "u" in flags else {}),
                            **({"tile_sections": 1} if "l" in flags else {}),
                            **({"tile_sections": 1 << 16} if "L" in flags else {}),
                            **({"v_wait_first": True} if "v" in flags else {})}


def ours_dense(q, k, v, bm, bn, options):
    """Ours, dense causal at BLOCK_M x BLOCK_N with Fa3Config overrides `options` (parse_row's), persistent."""
    import torch

    from cubridge.runtime.fa3_sm90 import Fa3Config, fa3_forward
    cfg = Fa3Config(**{**dict(head_dim=D, block_m=bm, block_n=bn, stages=2, causal=True, bf16=True, persistent=True), **options})
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    return lambda: fa3_forward(q, k, v, causal=True, config=cfg, out=out, lse=lse)[0]


def fa4(q, k, v, **kw):
    """FlashAttention-4 (flash_attn.cute), causal, on BSHD copies; kw: more flash_attn_func arguments."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 (any import failure is the reason)
        raise Unsupported(f"flash_attn.cute not importable: {type(e).__name__}: {str(e)[:200]}")
    qt, kt, vt = bshd(q), bshd(k), bshd(v)

    def fn():
        out = flash_attn_func(qt, kt, vt, causal=True, **kw)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return fn
