"""experiments/cta_timeline.py's analysis on a hand-made stamp buffer (the GPU run happens once per
session, a wrong reading would cost it): two CTAs of two consumers, known step, hand-over, epilogue
and start-up cycles, one CTA a tile longer (the tail), globaltimer stamps with bit 63 set (torch's
int64 reads them negative)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(scope="module")
def timeline():
    before = list(sys.path)
    added = [m for m in ("expkit", "cta_timeline") if m not in sys.modules]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import cta_timeline
        yield cta_timeline
    finally:
        sys.path[:] = before
        for m in added:
            sys.modules.pop(m, None)


STEP, BOUND, EPI, KV, GHZ = 3400, 1000, 900, 47, 2.0
G_BASE = (1 << 55) + 12345          # << 8 sets bit 63: negative as int64


def _cta(T, g0, clk0, ntiles):
    inv = {v: k for k, v in T.EV.items()}

    def enc(ev, v):
        word = (v << 8 | inv[ev]) % (1 << 64)
        return word - (1 << 64) if word >= 1 << 63 else word     # as torch's int64 .tolist() gives it
    rows = [[0] * T.LEN for _ in range(T.ROWS)]
    rows[0][:3] = [enc("g_entry", g0), enc("entry", clk0), enc("first_k", clk0 + 500)]
    for c in (1, 2):
        m = [enc("g_entry", g0), enc("entry", clk0)]
        for i in range(ntiles):
            fs = clk0 + 4000 + i * (KV * STEP + BOUND)
            m += [enc("tile", fs - 1500), enc("kv", KV), enc("first_turn", fs - 800)]
            if i:
                m += [enc("epilogue", fs - 600), enc("epilogue_done", fs - 600 + EPI)]
            m += [enc("first_s", fs), enc("loop_end", fs + (KV - 1) * STEP)]
        end = fs + (KV - 1) * STEP + 2000
        m += [enc("epilogue", end - 1500), enc("epilogue_done", end - 1500 + EPI), enc("exit", end),
              enc("g_exit", g0 + round((end - clk0) / GHZ))]
        rows[c][:len(m)] = m
    return rows


def test_the_phases_come_back(timeline):
    rows = _cta(timeline, G_BASE, 10**6, 31) + _cta(timeline, G_BASE + 500, 5 * 10**6, 32)
    r = timeline.analyse(rows, 2, 2)
    assert (r["ctas_read"], r["truncated_rows"], r["tiles_per_cta"][:2], r["max_kv"]) == (2, 0, [31, 32], KV)
    assert r["step_cycles"] == STEP and r["boundary_cycles"] == BOUND and r["epilogue_cycles"] == EPI
    assert r["startup_cycles"] == 4000 and r["producer_first_k_cycles"] == 500 and r["drain_cycles"] == 2000
    assert r["sm_ghz"] == pytest.approx(GHZ, rel=1e-3)
    span_ns = 500 + (4000 + 31 * (KV * STEP + BOUND) + (KV - 1) * STEP + 2000) / GHZ
    assert r["span_us"] == pytest.approx(span_ns / 1e3, abs=0.01)
    # the 31-tile CTA idles one tile (KV * STEP + BOUND cycles) at the end: half of that is the mean
    assert r["tail_idle"] == pytest.approx((KV * STEP + BOUND) / GHZ / span_ns / 2, abs=1e-3)
    assert 0 < r["overhead"] < 0.02 and r["what_each_costs"]["tail_idle"] == r["tail_idle"]


def test_an_empty_buffer_says_so(timeline):
    assert "error" in timeline.analyse([[0] * timeline.LEN for _ in range(timeline.ROWS)], 1, 2)
