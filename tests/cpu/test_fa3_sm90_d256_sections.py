"""Session 16's D 256 options without a GPU (issue 19 bar 3): tile_sections (tiles.cuh TILE_SECTIONS, off by default)
hands the dense kernel's tiles out in sections of heads sized to L2, longest first inside a section, instead of head
by head. A mirror of decode_tile's sectioned branch is a permutation of the tiles at every shape (full sections and
a short last one); the builds are spill-free with the steady KV step unchanged, and the default builds do not change
(experiments/sass_unchanged.py). v_wait_first (consumer.cuh V_WAIT_FIRST, off) waits for V before the QK issue, so
that ptxas puts O's rescale among the QK HGMMAs (FA4's SASS) instead of right before the P V issue.
tests/gpu/test_fa3_sm90_d256.py (s16) runs both under the rule."""
from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cubridge.runtime.fa3_sm90 import KERNEL_SOURCE, Fa3Config

from test_fa3_sm90_build import _disassembler, _nvcc   # tests/cpu is on sys.path (no __init__.py)
from test_fa3_sm90_d256_build import _build, _fwd_spill

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
NEEDS_NVCC = pytest.mark.skipif(_nvcc() is None or _disassembler() is None,
                                reason="nvcc and a SASS disassembler not found (needs the CUDA toolkit, no GPU)")
FRU = dict(causal=True, wg_turns=False, rescale_before_pv=True, uniform_q=True)


def decode_sections(t: int, num_m: int, bh_all: int, sec_heads: int, causal: bool = True) -> tuple[int, int]:
    """tiles.cuh decode_tile's kTileSections branch: work tile t -> (bh, m_block)."""
    per_sec = sec_heads * num_m
    sec, r = divmod(t, per_sec)
    here = min(sec_heads, bh_all - sec * sec_heads)
    m_idx, h = divmod(r, here)
    return sec * sec_heads + h, (num_m - 1 - m_idx) if causal else m_idx


def test_tile_sections_is_an_option():
    assert "-DTILE_SECTIONS=1" in Fa3Config(256, 128, 80, 2, causal=True, tile_sections=1).defines()
    assert "-DTILE_SECTIONS=3" in Fa3Config(256, 128, 80, 2, causal=True, tile_sections=3).defines()
    assert not any("TILE_SECTIONS" in f for f in Fa3Config(256, 128, 80, 2, causal=True).defines())


@pytest.mark.parametrize("num_m, bh_all, sec_heads", [(64, 32, 4), (64, 6, 4), (3, 15, 16), (1, 7, 2), (5, 1, 8),
                                                      (20, 13, 4), (64, 32, 1)])
def test_sectioned_order_is_a_permutation(num_m, bh_all, sec_heads):
    """Every (head, query block) once; inside a section the longest (last) query blocks of all its heads first."""
    tiles = [decode_sections(t, num_m, bh_all, sec_heads) for t in range(num_m * bh_all)]
    assert sorted(tiles) == [(bh, m) for bh in range(bh_all) for m in range(num_m)]
    first = tiles[:min(sec_heads, bh_all)]
    assert first == [(bh, num_m - 1) for bh in range(min(sec_heads, bh_all))]
    if sec_heads == 1:   # one head a section: the default order (head by head, longest first)
        assert tiles == [(t // num_m, num_m - 1 - t % num_m) for t in range(num_m * bh_all)]


@NEEDS_NVCC
def test_tile_sections_spill_free_and_the_step_unchanged(tmp_path):
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        from sass_step_count import fwd_step_counts
    finally:
        sys.path.remove(str(EXPERIMENTS))
    cfgs = {"fru": Fa3Config(256, 128, 80, 2, **FRU), "frul": Fa3Config(256, 128, 80, 2, **FRU, tile_sections=1),
            "frkul": Fa3Config(256, 128, 80, 2, **FRU, k_before_v=True, tile_sections=1),
            "full_frul": Fa3Config(256, 128, 80, 2, **{**FRU, "causal": False}, tile_sections=1),
            "l64": Fa3Config(256, 128, 64, 2, causal=True, tile_sections=1),
            "fru_L": Fa3Config(256, 128, 80, 2, **FRU, tile_sections=1 << 16),
            "frkul3": Fa3Config(256, 128, 80, 2, **FRU, k_before_v=True, tile_sections=3)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(cfgs, pool.map(lambda kc: _build(kc[1].defines(), KERNEL_SOURCE, tmp_path / f"{kc[0]}.cubin"),
                                       cfgs.items())))
    assert {k: _fwd_spill(v) for k, v in logs.items()} == dict.fromkeys(cfgs, 0)
    sass = {k: subprocess.run([*_disassembler(), str(tmp_path / f"{k}.cubin")], capture_output=True, text=True,
                              check=True).stdout for k in ("fru", "frul", "frkul")}
    counts = {k: fwd_step_counts(v[v.find(".text.fa3_sm90_fwd:"):]) for k, v in sass.items()}
    # nvcc 13.0: 468 warp instructions a steady step in all three (the order is decoded once per tile; ptxas
    # picks one IMAD.MOV for a MOV)
    assert counts["frul"]["instructions"] == counts["frkul"]["instructions"] == counts["fru"]["instructions"]
    assert counts["frul"]["opcodes"]["HGMMA"] == counts["fru"]["opcodes"]["HGMMA"] == 21


def _fmuls_before_pv(sass: str) -> list[int]:
    """FMUL between each P V's first HGMMA (64 x 256) and the QK HGMMA (64 x 80) before it."""
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    out, last_qk = [], None
    for i, op in enumerate(ops):
        if "HGMMA.64x80x16" in op:
            last_qk = i
        elif "HGMMA.64x256x16" in op and last_qk is not None:
            out.append(sum(1 for x in ops[last_qk:i] if x.split()[0] == "FMUL"))
            last_qk = None
    return out


@NEEDS_NVCC
def test_v_wait_first_moves_the_rescale_into_the_qk_issue(tmp_path):
    assert "-DV_WAIT_FIRST=1" in Fa3Config(256, 128, 80, 2, **FRU, v_wait_first=True).defines()
    cfgs = {"fru": Fa3Config(256, 128, 80, 2, **FRU), "fruv": Fa3Config(256, 128, 80, 2, **FRU, v_wait_first=True),
            "frkulv": Fa3Config(256, 128, 80, 2, **FRU, k_before_v=True, tile_sections=1, v_wait_first=True),
            "full_fruv": Fa3Config(256, 128, 80, 2, **{**FRU, "causal": False}, v_wait_first=True),
            "d128": Fa3Config(128, 128, 128, 2, causal=True), "d128v": Fa3Config(128, 128, 128, 2, causal=True,
                                                                                 v_wait_first=True)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(cfgs, pool.map(lambda kc: _build(kc[1].defines(), KERNEL_SOURCE, tmp_path / f"{kc[0]}.cubin"),
                                       cfgs.items())))
    assert {k: _fwd_spill(v) for k, v in logs.items() if not k.startswith("d128")} == dict.fromkeys(
        ("fru", "fruv", "frkulv", "full_fruv"), 0)
    assert (tmp_path / "d128v.cubin").read_bytes() == (tmp_path / "d128.cubin").read_bytes(), "D 256 only"
    sass = {k: subprocess.run([*_disassembler(), str(tmp_path / f"{k}.cubin")], capture_output=True, text=True,
                              check=True).stdout for k in ("fru", "fruv", "frkulv")}
    # nvcc 13.0: fru 126 FMUL between the last QK HGMMA and the P V (the rescale, sunk past the V wait); with the
    # V wait first none: they sit between the first three QK HGMMAs
    assert max(_fmuls_before_pv(sass["fru"])) >= 100
    assert max(_fmuls_before_pv(sass["fruv"])) <= 4 and max(_fmuls_before_pv(sass["frkulv"])) <= 4
