"""experiments/expkit/sass_stalls.py (experiments/ncu_stalls.py's reducer) on a hand-made ncu source
page in the layout session 8's composite_sass_top200.csv shows: ncu's notes before the header are
skipped, each PC gets its step phase from its opcode and the landmarks before it (an mbarrier retry
branch, a wgmma wait, a named barrier, the bulk reduce), and the summary's shares add up."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
HEAD = ("Address,Source,Warp Stall Sampling (All Samples),Instructions Executed,stall_barrier,stall_long_sb,"
        "stall_wait,stall_math\n")


@pytest.fixture(scope="module")
def stalls():
    before, added = list(sys.path), [m for m in ("expkit", "expkit.sass_stalls") if m not in sys.modules]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        from expkit import sass_stalls
        yield sass_stalls
    finally:
        sys.path[:] = before
        for m in added:
            sys.modules.pop(m, None)


def page(rows):
    body = "".join(f'0x{16 * i:x},"{s}",{n},{e},{b},{l},{w},{m}\n' for i, (s, n, e, b, l, w, m) in enumerate(rows))
    return "==PROF== Disconnected from process 1\n" + HEAD + body


ROWS = [("      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR22+0x30010], R5", 40, 100, 0, 0, 40, 0),
        ("@!P0  BRA 0x200", 100, 10, 0, 100, 0, 0),
        ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", 2, 80, 0, 0, 2, 0),
        ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", 1, 80, 0, 0, 1, 0),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 200, 10, 0, 0, 200, 0),
        ("FFMA R24, R24, R3, -R4", 7, 10, 0, 0, 0, 7),
        ("MUFU.EX2 R24, R24", 30, 10, 0, 0, 0, 30),
        ("FMUL R25, R24, R2", 5, 10, 0, 0, 0, 5),
        ("BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", 150, 10, 150, 0, 0, 0),
        ("UBLKRED.G.S.ADD.F32.RN [UR4], [UR6], UR8", 3, 1, 0, 0, 3, 0),
        ("EXIT", 0, 1, 0, 0, 0, 0)]


def test_the_page_is_read_and_phased(stalls):
    rows = stalls.read_page(page(ROWS))
    assert [r["samples"] for r in rows] == [n for _, n, *_ in ROWS]
    assert rows[1]["stalls"] == {"long_sb": 100} and rows[0]["sass"].startswith("SYNCS.PHASECHK")
    phase = [r["phase"].split(" (")[0] for r in stalls.annotate(rows)]
    assert phase == ["mbarrier wait", "mbarrier wait", "HGMMA issue", "HGMMA issue", "wgmma wait",
                     "after a wgmma wait", "P pass", "P pass", "named barrier", "bulk copy / reduce / wait_group",
                     "other"]
    assert rows[5]["context"] == "SYNCS.PHASECHK.TRANS64.TRYWAIT > HGMMA x2 > WARPGROUP.DEPBAR.LE"


def test_the_summary_adds_up(stalls):
    s = stalls.summarize(stalls.read_page(page(ROWS)), top=3)
    assert s["samples"] == sum(n for _, n, *_ in ROWS) and s["hgmma"] == 2 and s["instructions"] == len(ROWS)
    assert sum(s["phases"].values()) == s["samples"]
    assert [t["samples"] for t in s["top"]] == [200, 150, 100]
    assert s["reasons"]["wait"] == 246 and list(s["reasons"])[0] == "wait"
    assert "wgmma wait" in stalls.table("k", s).splitlines()[3]


def test_a_page_without_rows_is_named(stalls):
    with pytest.raises(ValueError, match="no 'Address,Source"):
        stalls.read_page("==PROF== nothing profiled\n")
    with pytest.raises(ValueError, match="no instruction rows"):
        stalls.read_page(HEAD)


def test_opcode_drops_predicates(stalls):
    assert stalls.opcode("@!P0  BRA 0x7f") == "BRA" and stalls.opcode("  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4]") \
        == "HGMMA.64x64x16.F32.BF16" and stalls.opcode("") == ""
