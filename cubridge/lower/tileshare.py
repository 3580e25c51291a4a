"""Useful share of a mask's visited tiles at a KV tile width: attended pairs / pairs executed.

A query tile runs every KV tile that holds an attended pair (itspace.py), each in full. A wider KV
tile runs faster per executed pair (the dense kernel's 128 x 176: +2-5% at 8k, v11 sweep) but
executes more masked pairs where the mask has edges inside the visited range: a sliding window's
far edge and diagonal both cut tiles, and 176 never lines up with a 128-row query tile or a window
of a multiple of 128. Exact counts at 8k (session 13): ag_sliding_window (w 1024) 0.890 at 128 vs
0.782 at 176, phi3 (w 2047) 0.941 vs 0.877, mistral (w 4096) 0.970 vs 0.934, causal 0.985 vs
0.966 (the measured near-dense family that gains from 176).

The mask (a VariantIR mask over iq, ik, b, h) is evaluated with the CuIR interpreter's semantics on
a sample of query tiles at one sequence length; a mask that reads runtime scalars or tables (values
unknown at lowering) or b / h is not evaluated (None: the caller keeps its rule).
"""
from __future__ import annotations

import functools

from cubridge.cuir import nodes as N

SAMPLE_N = 8192          # the length the wide tile starts at (runtime default_config)
SAMPLE_TILES = 16        # query tiles evaluated, evenly spread (windows are shift-invariant)


def _names(e, out: set) -> set:
    if isinstance(e, N.Name):
        out.add(e.id)
    elif isinstance(e, tuple):
        for x in e:
            _names(x, out)
    elif hasattr(e, "__dataclass_fields__"):
        for f in e.__dataclass_fields__:
            if f != "line":
                _names(getattr(e, f), out)
    return out


def useful_shares(mask, widths=(128, 176), block_m: int = 128, n: int = SAMPLE_N) -> dict | None:
    """{width: attended / executed pairs over the visited tiles of the sampled query tiles}, or
    None where the mask reads anything but iq and ik (or keeps no pair in the sample)."""
    if mask is None or not _names(mask, set()) <= {"iq", "ik"}:
        return None
    return _shares(mask, tuple(widths), block_m, n)


@functools.lru_cache(maxsize=64)
def _shares(mask, widths, block_m, n):
    import torch

    from cubridge.cuir.interp import Interpreter
    it = Interpreter(N.Program([], source="<tileshare>"), {}, None, "in_order", False)
    tiles = n // block_m
    step = max(1, tiles // SAMPLE_TILES)
    keys = torch.arange(n).view(1, -1)
    per_tile = []                  # one query tile at a time: [block_m, n] booleans (32k: 4M)
    for m in range(step - 1, tiles, step):
        rows = torch.arange(m * block_m, (m + 1) * block_m).view(-1, 1)
        kept = torch.as_tensor(it.eval(mask, {"iq": rows, "ik": keys}, None)).bool()
        per_tile.append(kept.expand(block_m, n).sum(0))
    kept = torch.stack(per_tile)                                          # [query tile, key]
    attended = int(kept.sum())
    if attended == 0:
        return None
    out = {}
    for w in widths:
        pad = -n % w
        per_tile = torch.nn.functional.pad(kept, (0, pad)).view(kept.shape[0], -1, w).sum(2)
        executed = int((per_tile > 0).sum()) * block_m * w
        out[w] = attended / executed
    return out
