"""experiments/expkit/sass_stalls_fwd.py and experiments/ncu_stalls_fwd.py's reduction (issue 19, D 256) on a
hand-made ncu source page: the forward's phases (the two wgmma waits told apart by their wait_group,
the mbarrier retry branch, O's rescale as a run of FMUL), executed instructions per KV step by class,
and the tile model of a causal launch (KV steps, greedy longest-first makespan)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
HEAD = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_long_sb"\n'
RESCALE = 16


@pytest.fixture(scope="module")
def mods():
    before = list(sys.path)
    added = [m for m in ("expkit", "expkit.sass_stalls", "expkit.sass_stalls_fwd", "ncu_stalls", "ncu_stalls_fwd")
             if m not in sys.modules]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        from expkit import sass_stalls, sass_stalls_fwd
        import ncu_stalls_fwd
        yield sass_stalls, sass_stalls_fwd, ncu_stalls_fwd
    finally:
        sys.path[:] = before
        for m in added:
            sys.modules.pop(m, None)


ROWS = [("HGMMA.64x80x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;", 5, 100),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x1 ;", 50, 100),
        ("FMNMX R3, R24, R25, !PT ;", 4, 400),
        ("FMUL R1, R2, R3 ;", 3, 10),
        ("MUFU.EX2 R3, R3 ;", 10, 4000),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR16+0x38060], R2 ;", 30, 200),
        ("@!P0 BRA 0x40 ;", 7, 200),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", 20, 100),
        ("F2FP.BF16.F32.PACK_AB R40, R25, R24 ;", 2, 300)] + \
       [(f"FMUL R{i}, R{i}, R9 ;", 1, 64) for i in range(RESCALE)]


def page():
    body = "".join(f'"0x{16 * i:x}","{s}","{n}","{e}","{n // 2}","0"\n' for i, (s, n, e) in enumerate(ROWS))
    return "==PROF== Connected\n" + HEAD + body


def test_forward_phases(mods):
    _, _, ncu = mods
    r = ncu.reduce(page(), "", steps=10)
    assert r["samples"] == sum(n for _, n, _ in ROWS)
    assert r["phases"]["wgmma wait 1 (QK)"] == 50 and r["phases"]["wgmma wait 0 (P V / all)"] == 20
    assert r["phases"]["mbarrier wait (K/V/Q full, slot empty, tile)"] == 37       # try-wait and its retry
    assert r["phases"]["O rescale (FMUL run)"] == RESCALE                          # the run, not the lone FMUL
    assert r["phases"]["FMUL / FFMA (scale, rescale)"] == 3
    assert r["phases"]["row max (FMNMX / SHFL)"] == 4 and r["phases"]["convert P / O (F2FP)"] == 2
    assert sum(r["phases"].values()) == r["samples"]
    assert r["top"][0]["phase"] == "wgmma wait 1 (QK)"
    # warp instructions per KV step per consumer warp: executed / (steps * 8 warps)
    assert r["per_step_per_warp"]["mufu"] == 4000 / 80 and r["per_step_per_warp"]["hgmma"] == round(100 / 80, 1)
    assert r["per_step_per_warp"]["all"] == round(sum(e for _, _, e in ROWS) / 80, 1)
    assert len(r["pcs"]) == len(ROWS) and r["pcs"][1][1].startswith("WARPGROUP.DEPBAR")


def test_op_classes(mods):
    _, fwd, _ = mods
    assert [fwd.op_class(op) for op in ("HGMMA.64x80x16.F32.BF16", "MUFU.EX2", "FFMA", "R2UR", "UIADD3", "UTMALDG.4D",
                                        "SYNCS.ARRIVE.TRANS64", "F2FP.BF16.F32.PACK_AB", "SHFL.BFLY", "XYZ")] == \
        ["hgmma", "mufu", "fp32", "uniform", "uniform", "memory", "sync", "convert", "shuffle", "other"]


def test_tile_model_of_d256_causal_8k(mods):
    """128 x 80 over 8k causal, 32 heads: 64 query blocks of 2..103 KV steps (sum 3354 a head). Both
    launches are greedy longest-first list schedules: the tail costs 0.2% of 132 SMs' time."""
    _, fwd, _ = mods
    steps = fwd.causal_steps(8192, 128, 80)
    assert len(steps) == 64 and steps[0] == 2 and steps[-1] == 103 and sum(steps) == 3354
    m = fwd.tile_model(8192, 128, 80, heads=32)
    assert m["tiles"] == 2048 and m["steps"] == 32 * 3354 and m["steps_per_tile_max"] == 103
    assert 0.99 < m["efficiency"] <= 1 and m["makespan_steps"] >= m["steps"] / 132
    worse = fwd.tile_model(8192, 128, 80, heads=32, tile_cost=2.0)
    assert worse["steps_per_cta"] == pytest.approx((m["steps"] + 2 * 2048) / 132, abs=0.1)
    assert fwd.tile_model(256, 128, 80, heads=1, sms=4)["efficiency"] < 0.7      # 2 tiles on 4 SMs


def test_tile_model_orders_of_d256_causal_8k(mods):
    """Session 16: our dense kernel hands tiles out head by head (decode_tile), not longest first overall: the last
    head's longest tiles start when only its own are left, and a greedy schedule ends 48 steps (5.6%) late, as
    session 15's ncu showed (SMs active 94.3% of the elapsed cycles, FA4 98.6%). In sections of 4 heads (8 MB of
    K and V each in 50 MB of L2: TILE_SECTIONS) 0.4%."""
    _, fwd, _ = mods
    assert [fwd.section_heads(n) for n in (1000, 3000, 8192, 9000, 16384, 1 << 20)] == [32, 16, 4, 4, 2, 1]
    assert fwd.tile_order([1, 3, 2], 3, "heads") == [3, 2, 1] * 3
    assert fwd.tile_order([1, 3, 2], 3, "sections", 2) == [3, 3, 2, 2, 1, 1, 3, 2, 1]
    assert fwd.tile_order([1, 3, 2], 2, "lpt") == [3, 3, 2, 2, 1, 1]
    heads = fwd.tile_model(8192, 128, 80, heads=32, order="heads")
    sections = fwd.tile_model(8192, 128, 80, heads=32, order="sections")
    assert heads["steps"] == sections["steps"] == 32 * 3354
    assert 0.94 < heads["efficiency"] < 0.95 and heads["makespan_steps"] - heads["steps_per_cta"] > 45
    assert sections["efficiency"] > 0.995


def test_tiles_steps_and_per_step_of_other_shapes(mods):
    """Session 15 (D 128 / 64, full attention): FA4's tile read from its profile (the QK HGMMA's width, the
    block size's consumer warpgroups), KV steps of a full launch, and the per-step numbers of each own tile
    (per 128 keys where tile widths differ; cycles per step per SM from gpc__cycles_elapsed.max)."""
    _, _, ncu = mods
    pcs = [[0, "HGMMA.64x64x16.F32.BF16 R88, R148, gdesc[UR24].tnspB, R88 ;"],
           [1, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR48], RZ, !UPT ;"]]
    assert ncu.sass_tile({"pcs": pcs, "launch__block_size": 512.0}, (0, 0)) == (192, 128)
    assert ncu.sass_tile({"pcs": [], "launch__block_size": None}, (128, 128)) == (128, 128)
    assert ncu.kv_steps(8192, 128, 176, 32, causal=False) == 64 * 47 * 32
    assert ncu.kv_steps(8192, 128, 80, 32, causal=True) == 32 * 3354
    out = {"executed_by_class": {"mufu": 6600, "fp32": 27000}, "raw": {"gpc__cycles_elapsed.max": 1000.0}}
    ncu.per_step(out, steps=100, warps=1, bn=176)
    assert out["per_step_per_warp"]["all"] == 336.0 and out["per_128_keys_per_warp"] == round(33600 / 137.5, 1)
    assert out["cycles_per_step_per_sm"] == 1320.0 and out["cycles_per_128_keys_per_sm"] == 960.0
    assert ncu.our_config("dfltd", 64, True, 8192).desc_once and ncu.our_config("dflt", 128, False, 8192).tail_split


def test_steady_loop_of_a_listing():
    """experiments/sass_step_count_fwd.py: the innermost loop with a QK (shared A) and a P V (register A) HGMMA,
    its mask pass (a forward span of >= 16 FSEL) left out, a retry stub's return branch (BRA right after BRA) not
    taken for a loop; sass_step_count.py's fwd_step_counts is the same function."""
    before = list(sys.path)
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import sass_step_count_fwd as ssc
        import sass_step_count
    finally:
        sys.path[:] = before
        for m in ("sass_step_count_fwd", "sass_step_count"):
            sys.modules.pop(m, None)
    assert sass_step_count.fwd_step_counts is ssc.fwd_step_counts
    ops = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;", "HGMMA.64x64x16.F32.BF16 R88, R148, gdesc[UR12].tnspB, R88 ;",
           "@P0 BRA 0x%x ;"] + ["FSEL R1, R2, R3, P0 ;"] * 16 \
        + ["MUFU.EX2 R3, R3 ;"] * 30 + ["@P1 BRA 0x0 ;", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;",
                                         "@!P0 BRA 0x%x ;", "BRA 0x10 ;"]
    lines = []
    for i, op in enumerate(ops):
        if "%x" in op:
            op = op % (16 * (i + 17) if i == 2 else 16 * i)
        lines.append(f"        /*{16 * i:04x}*/                   {op}")
    counts = ssc.counts(ssc.steady_loop("\n".join(lines)))
    assert counts["classes"]["hgmma"] == 2 and counts["classes"]["mufu"] == 30 and "FSEL" not in counts["opcodes"]
    assert counts["instructions"] == 2 + 1 + 30 + 1
