"""The useful share of a mask's visited tiles per KV tile width (cubridge/lower/tileshare.py) and
the rules built on it (lower.fa3_sm90.wide_tile, edge-heavy row intervals): exact
against brute-force tile counts where every query tile is sampled, windows refused the 176 tile,
causal / prefix / chunked masks kept on it, masks that read scalars / b / h not evaluated. No GPU."""
from __future__ import annotations

import pytest
import torch

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.lower.cexpr import LowerError
from cubridge.lower.fa3_sm90 import WIDE_SHARE_ENV, wide_share_enabled, wide_tile
from cubridge.lower.tileshare import useful_shares
from cubridge.runtime.kernels import reference_kernel
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer
from cubridge.transfer.trace import trace_mask


def _expr(fn):
    return trace_mask(fn).expr


def _brute(fn, n, bm, bn):
    q, k = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    m = fn(0, 0, q, k).expand(n, n)
    pad = -n % bn
    t = torch.nn.functional.pad(m.int(), (0, pad)).view(n // bm, bm, -1, bn).sum((1, 3))
    return int(m.sum()) / (int((t > 0).sum()) * bm * bn)


@pytest.mark.parametrize("fn", [
    lambda b, h, q, k: (k <= q) & (q - k <= 100),         # a window narrower than a tile
    lambda b, h, q, k: (k <= q) & (q - k < 300),          # a window across tiles, odd edges
    lambda b, h, q, k: k <= q,                            # causal
    lambda b, h, q, k: (k <= q) & (k // 200 == q // 200),  # chunks not aligned to either tile
])
def test_shares_exact_where_every_query_tile_is_sampled(fn):
    got = useful_shares(_expr(fn), widths=(128, 176), n=1024)    # 8 query tiles: all sampled
    for w in (128, 176):
        assert got[w] == pytest.approx(_brute(fn, 1024, 128, w), rel=1e-12), w


def test_windows_lose_share_at_176_causal_does_not():
    win = useful_shares(_expr(lambda b, h, q, k: (k <= q) & (q - k <= 1024)))
    causal = useful_shares(_expr(lambda b, h, q, k: k <= q))
    assert win[176] < 0.9 * win[128]                 # ag_sliding_window: 0.80 vs 0.89 sampled
    assert causal[176] > 0.98 * causal[128]


def test_refused_masks():
    """b / h (per-head masks) and anything but the two indices: not evaluated, None."""
    assert useful_shares(_expr(lambda b, h, q, k: (k <= q) & (h < 4))) is None
    assert useful_shares(_expr(lambda b, h, q, k: (k <= q) & (b == 0))) is None
    assert useful_shares(None) is None
    assert useful_shares(_expr(lambda b, h, q, k: k > q + 100000)) is None      # keeps nothing


def _ir(spec):
    prog = parse_file(reference_kernel("fa3_sm90").cuir_path())
    return lower(transfer(prog, load_spec(spec), spec_params={}).program, "fa3_sm90").ir


def test_wide_rule_and_edge_heavy_row_intervals(monkeypatch):
    """Default (session 13 mid call): windows stay 128 x 128 and, with many partial tiles, take row
    intervals; causal / prefix keep 176 and mask_pred; CUBRIDGE_WIDE_SHARE=0 is session 12's rule."""
    from cubridge.lower.fa3_sm90 import MASK_ROWS_ENV
    from cubridge.lower.rowrange import ROW_RANGE_ENV
    specs = ("tests/corpus/ag_sliding_window.py", "tests/corpus/mistral_sliding_window.py",
             "tests/corpus/ag_causal.py", "prefixlm")
    from cubridge.lower.fa3_sm90 import RANGE_WIDE_ENV
    monkeypatch.delenv(WIDE_SHARE_ENV, raising=False)
    monkeypatch.delenv(MASK_ROWS_ENV, raising=False)
    monkeypatch.delenv(ROW_RANGE_ENV, raising=False)
    monkeypatch.setenv(RANGE_WIDE_ENV, "0")                  # (the 16k rule: test_range_wide_rule_sees_chunk_edges)
    irs = [_ir(s) for s in specs]
    assert [wide_tile(ir) for ir in irs] == [False] * 4      # the arithmetic range: the dense 8k tile
    monkeypatch.setenv(ROW_RANGE_ENV, "0")                   # the scan: session 13's rule
    assert wide_share_enabled()
    assert [wide_tile(ir) for ir in irs] == [False, False, True, True]     # prefixlm: C0, kept
    rows = ["#define CUIR_MASK_ROWS 1" in _lowered_source(s) for s in specs]
    assert rows == [True, False, False, False]          # share at 128: 0.89, 0.97, 0.985, (C0)
    monkeypatch.setenv(WIDE_SHARE_ENV, "0")
    assert [wide_tile(ir) for ir in irs] == [True, True, True, True]
    monkeypatch.setenv(WIDE_SHARE_ENV, "yes")
    with pytest.raises(LowerError, match=WIDE_SHARE_ENV):
        wide_tile(irs[0])


def _lowered_source(spec):
    prog = parse_file(reference_kernel("fa3_sm90").cuir_path())
    return lower(transfer(prog, load_spec(spec), spec_params={}).program, "fa3_sm90").source


def test_range_wide_rule_sees_chunk_edges(monkeypatch):
    """CUBRIDGE_RANGE_WIDE=1 (session 16): range variants take 128 x 176 from 16k where 176 keeps 0.985 of
    128's share at 16k and 32k: causal / prefix masks do (0.990), llama4_chunked's 8192-key chunks do not
    (0.972 at 16k), windows do not; a scalar prefix (prefixlm) is not evaluated and kept. Off: never."""
    from cubridge.lower.fa3_sm90 import RANGE_WIDE_ENV, range_shares_keep_wide
    from cubridge.lower.rowrange import ROW_RANGE_ENV
    from cubridge.runtime.fa3_sm90 import default_config
    monkeypatch.delenv(WIDE_SHARE_ENV, raising=False)
    monkeypatch.delenv(ROW_RANGE_ENV, raising=False)
    specs = ("tests/corpus/ag_causal.py", "tests/corpus/llama4_chunked.py", "prefixlm",
             "tests/corpus/mistral_sliding_window.py")
    irs = [_ir(s) for s in specs]
    monkeypatch.setenv(RANGE_WIDE_ENV, "0")
    assert [wide_tile(ir) for ir in irs] == [False] * 4
    monkeypatch.setenv(RANGE_WIDE_ENV, "1")
    got = [wide_tile(ir) for ir in irs]
    assert got == [16384, False, 16384, False]
    assert [default_config(128, False, True, n, variant=True, wide=got[0]).block_n for n in (8192, 16384, 32768)] == [128, 176, 176]
    # what counts is where the edges fall: 8192 = 46 * 176 + 96 (96 masked keys per first tile of a chunk),
    # 16384 = 93 * 176 + 16 (sampled at 32k: 0.990, as causal)
    assert not range_shares_keep_wide(_expr(lambda b, h, q, k: (k <= q) & (k // 8192 == q // 8192)))
    assert range_shares_keep_wide(_expr(lambda b, h, q, k: (k <= q) & (k // 16384 == q // 16384)))
    assert range_shares_keep_wide(_expr(lambda b, h, q, k: k <= q))
    monkeypatch.setenv(RANGE_WIDE_ENV, "2")
    with pytest.raises(LowerError, match=RANGE_WIDE_ENV):
        wide_tile(irs[0])
