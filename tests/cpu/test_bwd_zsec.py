"""TILE_ORDER 5 (option ..._dqw_early_zsec, session 17 bwdc17): CAUSAL_OPTION's CTA order from a 3-D grid (section,
KV tiles, pairs / section) whose coordinates are S2R reads. Host side: the grid and the section that divides the
pairs; SASS: its consumer main loop is DEFAULT_OPTION's (TILE_ORDER 0's) instruction for instruction, where
CAUSAL_OPTION's (the decode with divisions) is not (ref_kernels/fa3_bwd_sm90/NOTES.md "Session 17 (bwdc17)")."""
import re
import shutil
import sys
from pathlib import Path

import pytest

from cubridge.errors import LaunchError
from cubridge.runtime import fa3_bwd_sm90 as hb

ZSEC = hb.DEFAULT_OPTION + "_zsec"
ROOT = Path(__file__).resolve().parents[2]


def order(grid, decode):
    """The (n, pair) sequence a grid dispatches (x fastest), decoded."""
    gx, gy, gz = grid
    return [decode(x, y, z, gx) for z in range(gz) for y in range(gy) for x in range(gx)]


def l2lpt_order(tiles, pairs, section):   # kernel.cu tile_coord_at, in Python
    out = []
    for idx in range(tiles * pairs):
        per = section * tiles
        s = idx // per
        r = idx - s * per
        width = min(section, pairs - s * section)
        n = r // width
        out.append((n, s * section + r - n * width))
    return out


def test_zsec_option_and_grid():
    assert hb.OPTIONS[ZSEC] == hb.OPTIONS[hb.CAUSAL_OPTION]._replace(tile_order=5)
    assert "-DTILE_ORDER=5" in hb.options(128, True, True, ZSEC)
    assert ZSEC not in hb.VARIANT_OPTIONS   # the variants' mask reads b, which TILE_ORDER 5 folds into the head
    assert hb._grid(ZSEC, 64, 32, 2, 4) == (4, 64, 16) and hb._grid(ZSEC, 64, 32, 2) == (1, 64, 64)
    assert [hb.zsec_section(s, p) for s, p in ((4, 64), (4, 6), (8, 12), (2, 3), (1, 5))] == [4, 2, 4, 1, 1]
    with pytest.raises(LaunchError, match="does not divide"):
        hb._grid(ZSEC, 8, 3, 2, 4)


@pytest.mark.parametrize("tiles,pairs,section", [(64, 64, 4), (128, 32, 2), (8, 6, 2), (5, 3, 1)])
def test_zsec_visits_l2lpt_order(tiles, pairs, section):
    """The CTA order of the zsec grid is TILE_ORDER 2's for a section that divides the pairs (the launcher's)."""
    grid = (section, tiles, pairs // section)
    assert order(grid, lambda x, y, z, gx: (y, x + gx * z)) == l2lpt_order(tiles, pairs, section)


def _loop(text: str) -> list[str]:
    sys.path.insert(0, str(ROOT / "experiments"))
    from expkit.sass_stalls_fwd import parse_listing
    ins = parse_listing(text)
    hg = [a for a, op, _ in ins if op.startswith("HGMMA")]
    end, head = next((a, t) for a, op, t in ins if op.startswith("BRA") and a > hg[-1] and t is not None and t < hg[0])
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and head <= int(m.group(1), 16) <= end:
            out.append(re.sub(r"0x[0-9a-f]+", "", m.group(2).split("`")[0]))
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA 13.0) to build the cubins")
def test_zsec_consumer_loop_is_the_defaults(tmp_path):
    """D 128 causal bf16: the HGMMA main loop of zsec equals DEFAULT_OPTION's (registers included); CAUSAL_OPTION's
    differs (the 1-D decode moves ptxas' schedule)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import sass_step_count as ssc
    loops = {o: _loop(ssc.ours(o, 128, True, True, tmp_path)) for o in (hb.DEFAULT_OPTION, ZSEC, hb.CAUSAL_OPTION)}
    assert loops[ZSEC] == loops[hb.DEFAULT_OPTION]
    assert loops[hb.CAUSAL_OPTION] != loops[hb.DEFAULT_OPTION]
