"""Attended-pair counting tile by tile (cubridge/transfer/pairs.py) equals evaluating the mask on
every pair, for every built-in and corpus spec, at ragged shapes with Nq != Nk and tiles cut by
the sequence end; and it is fast where the mask is index-only."""
from __future__ import annotations

from pathlib import Path

import pytest

from cubridge.spec import Hooks, builtin_specs, count_attended_pairwise, load_spec
from cubridge.transfer.pairs import count_attended
from cubridge.transfer import pairs
from cubridge.transfer.trace import trace_mask

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
        if hooks.mask_mod is not None and pairs._diagonal_expr(trace_mask(hooks.mask_mod).expr) is not None:
            with monkeypatch.context() as m:       # the tile path too where the diagonal one applies
                m.setattr(pairs, "_diagonal_expr", lambda expr: None)
                assert pairs.count_pairs(hooks, B, Hq, Nq, Nk) == fast, (spec, Nq, Nk)


def test_untraceable_mask_falls_back_to_pairwise():
    def odd(b, h, q, kv):
        return (q.float().cos() > 0) & (kv <= q)          # cos: the tracer refuses it
    hooks = Hooks(mask_mod=odd)
    assert pairs.count_pairs(hooks, 1, 1, 50, 50) is None
    assert count_attended(hooks, 1, 1, 50, 50) == count_attended_pairwise(hooks, 1, 1, 50, 50)


def test_causal_at_16k_classifies_all_but_the_diagonal(monkeypatch):
    """Cost is the partial blocks: for causal at 16k on the tile path, the 1024 diagonal 16 x 16
    sub-tiles of the 128 diagonal tiles (no wall-clock bound)."""
    calls = []
    orig = pairs._count_partial
    monkeypatch.setattr(pairs, "_diagonal_expr", lambda expr: None)
    monkeypatch.setattr(pairs, "_count_partial", lambda expr, t, blocks, size, Nq, Nk:
                        calls.append((len(blocks[0]), size)) or orig(expr, t, blocks, size, Nq, Nk))
    n = 16384
    got = count_attended(load_spec("causal").hooks_for(n, n, 32, 8), 1, 32, n, n)
    assert got == 32 * n * (n + 1) // 2 and calls == [(n // pairs.SUB, pairs.SUB)]   # the diagonal only


def test_a_mask_of_the_diagonal_is_counted_one_value_per_diagonal(monkeypatch):
    """A dilated window has no full tile: the tile path evaluated every pair of its band (5.7 s at
    16k). As a function of q_idx - kv_idx it is evaluated once per diagonal, no tile at all."""
    monkeypatch.setattr(pairs, "_count_all", None)            # the tile path is not taken
    s = load_spec(str(CORPUS / "ag_dilated_sliding_window.py"))
    hooks = s.hooks_for(16384, 16384, 32, 8)
    got = count_attended(hooks, 2, 32, 16384, 16384)
    band = sum(16384 - d for d in range(0, 1025, 4)) * 2 - 16384          # |d| <= 1024, d % 4 == 0
    assert got == 2 * 32 * band


def test_per_head_table_masks_are_counted_once_per_distinct_head():
    """ag_head_mask reads local[b][h] (causal or windowed per head): heads with the same table
    value have the same count, so two (b, h) classes are counted for B = 2, Hq = 32, not 64."""
    hooks = load_spec(str(CORPUS / "ag_head_mask.py")).hooks_for(300, 300, 32, 8, B=2)
    traced = trace_mask(hooks.mask_mod)
    tables = {n: c.tensor for n, c in traced.captures.items()}
    classes = pairs._bh_classes(traced.expr, tables, 2, 32)
    assert len(classes) == 2 and sum(w for _, _, w in classes) == 64
    assert pairs.count_pairs(hooks, 2, 32, 300, 300) == count_attended_pairwise(hooks, 2, 32, 300, 300)
