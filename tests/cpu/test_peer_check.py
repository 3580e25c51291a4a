"""experiments/expkit/peers.py's sampled check: the rows it computes equal the spec's own reference
at those rows, for every variant (MHA and GQA), and it fails an output with a wrong mask. The
benchmark's go / no-go for every system rests on it, so it must be able to fail."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from expkit.peers import SampledCheck, fa4_window, sample_rows, sampled_attention  # noqa: E402

from cubridge.spec import builtin_specs, load_spec  # noqa: E402


def _inputs(hq, hkv, n, d=16, b=2):
    g = torch.Generator().manual_seed(n + hq)
    return [torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("name", builtin_specs())
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_sampled_rows_match_reference(name, hq, hkv):
    n = 160
    q, k, v = _inputs(hq, hkv, n)
    spec = load_spec(name)
    hooks = spec.hooks_for(n, n, hq, hkv)
    full = spec.run_reference(q, k, v)
    rows = sample_rows(n)
    heads = torch.tensor([0, hq - 1])
    got = sampled_attention(q, k, v, hooks, rows, heads, q.shape[0] - 1, torch.float64)
    want = full[-1][heads][:, rows]
    assert torch.allclose(got, want, atol=1e-10), (name, (got - want).abs().max())


def test_rows_cover_both_ends_and_middle():
    rows = sample_rows(1024).tolist()
    assert rows[0] == 0 and rows[-1] == 1023 and 512 in rows and len(rows) == 96


def test_check_passes_reference_and_fails_wrong_mask():
    n, hq, hkv = 160, 4, 2
    q, k, v = (t.float() for t in _inputs(hq, hkv, n))
    spec = load_spec("global_sliding_window")
    hooks = spec.hooks_for(n, n, hq, hkv)
    check = SampledCheck(q, k, v, hooks)
    assert check.verdict(spec.run_reference(q, k, v)).passed
    # FA4's plain window (no global tokens) differs: the check must say so.
    left, _ = fa4_window("global_sliding_window")
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (ki <= qi) & (qi - ki <= left)
    scores = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / 4.0
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    window_out = p @ v.repeat_interleave(2, 1)
    assert not check.verdict(window_out).passed


def test_ours_runs_at_the_products_config():
    """bench_peers times a lowered variant where the product runs it: a tuned run's bucket for N
    (what cubridge.load picks), else the untuned default that build_run writes."""
    from expkit.peers import parse_point, point_label, product_point
    run = Path(__file__).resolve().parents[2] / "experiments" / "results" / "session11_h100" / "tune_prefixlm"
    runs = {"prefixlm": str(run)}
    assert point_label(product_point("prefixlm", 128, 16384, runs)[0]) == "128x160s2p"   # bucket N > 11585
    assert point_label(product_point("prefixlm", 128, 4096, runs)[0]) == "128x128s2p"
    point, origin = product_point("global_sliding_window", 128, 16384, runs)     # no run: the default
    assert point_label(point) == "128x128s2p" and origin.startswith("untuned default")
    # a mask with the arithmetic KV range (lower/rowrange.py, session 14) takes 128 x 128 at 8k and, by the
    # chunk-edge-aware rule (lower/fa3_sm90.py RANGE_WIDE, on since session 16), 128 x 176 from 16k
    assert point_label(product_point("causal_blockwise", 128, 8192, runs)[0]) == "128x128s2p"
    assert point_label(product_point("causal_blockwise", 128, 16384, runs)[0]) == "128x176s2p"
    assert product_point("prefixlm", 64, 4096, runs)[1].startswith("untuned")     # the run is D 128
    assert parse_point("192x80s3") == {"block_m": 192, "block_n": 80, "stages": 3, "persistent": False}
    with pytest.raises(ValueError, match="BMxBNsS"):
        parse_point("128x160")
