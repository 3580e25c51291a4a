"""Attended-pair counting tile by tile (cubridge/transfer/pairs.py) equals evaluating the mask on
every pair, for every built-in and corpus spec, at ragged shapes with Nq != Nk and tiles cut by
the sequence end; and it is fast where the mask is index-only."""
from __future__ import annotations

from pathlib import Path

import pytest

from cubridge.spec import Hooks, builtin_specs, count_attended_pairwise, load_spec
from cubridge.transfer.pairs import count_attended
from cubridge.transfer import pairs

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
SPECS = builtin_specs() + [str(p) for p in sorted(CORPUS.glob("[a-z]*.py"))]
SMALL = {"ag_natten": {"canvas": (12, 20), "kernel": (5, 7)}, "bitpacked_blocks": {"block": 24},
         "ag_document_causal": {"lengths": (37, 61, 23, 90)}, "llama4_chunked": {"chunk": 70},
         "ag_document_sliding": {"lengths": (37, 61, 23, 90), "window": 16}}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: Path(s).stem)
def test_tile_count_equals_pairwise(spec, monkeypatch):
    monkeypatch.setattr(pairs, "TILE", 32)          # many tiles, ragged last ones, at test size
    s = load_spec(spec)
    params = SMALL.get(Path(spec).stem, {})
    for B, Hq, Hkv, Nq, Nk in ((2, 4, 2, 300, 300), (1, 2, 1, 177, 250), (1, 2, 2, 130, 333)):
        hooks = s.hooks_for(Nq, Nk, Hq, Hkv, **params)
        fast = pairs.count_pairs(hooks, B, Hq, Nq, Nk)
        assert fast is not None, "the corpus and built-in masks all trace"
        assert fast == count_attended_pairwise(hooks, B, Hq, Nq, Nk), (spec, Nq, Nk)


def test_untraceable_mask_falls_back_to_pairwise():
    def odd(b, h, q, kv):
        return (q.float().cos() > 0) & (kv <= q)          # cos: the tracer refuses it
    hooks = Hooks(mask_mod=odd)
    assert pairs.count_pairs(hooks, 1, 1, 50, 50) is None
    assert count_attended(hooks, 1, 1, 50, 50) == count_attended_pairwise(hooks, 1, 1, 50, 50)


def test_causal_at_16k_classifies_all_but_the_diagonal():
    """Cost is the partial blocks: for causal at 16k, the 1024 diagonal 16 x 16 sub-tiles of the
    128 diagonal tiles (no wall-clock bound)."""
    calls = []
    orig = pairs._count_partial
    pairs._count_partial = lambda expr, t, blocks, size, Nq, Nk: calls.append((len(blocks[0]), size)) or \
        orig(expr, t, blocks, size, Nq, Nk)
    try:
        n = 16384
        got = count_attended(load_spec("causal").hooks_for(n, n, 32, 8), 1, 32, n, n)
    finally:
        pairs._count_partial = orig
    assert got == 32 * n * (n + 1) // 2 and calls == [(n // pairs.SUB, pairs.SUB)]   # the diagonal only
