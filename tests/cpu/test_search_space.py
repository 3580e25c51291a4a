"""Search spaces: declared once per reference kernel, their constraints agree with the kernels'
runtime glue and with the CuIR checker, every problem names its reason, warm starts are valid."""
from __future__ import annotations

import itertools

import pytest
import torch

from cubridge.cuir.checker import check
from cubridge.cuir.parser import parse_file
from cubridge.paths import ref_kernel_dir
from cubridge.runtime import fa2_sm80, fa3_sm90
from cubridge.runtime.kernels.fa2_sm80 import smem_limit
from cubridge.runtime.kernels.fa3_sm90 import FA3_ACC_REG_BUDGET, fa3_acc_regs
from cubridge.search.space import SPACES

CASES = [(name, d, arch) for name, s in SPACES.items() for d in s.head_dims for arch in s.arches]


def grid(space):
    names = [p.name for p in space.params]
    return [dict(zip(names, v)) for v in itertools.product(*(p.choices for p in space.params))]


def test_one_space_per_reference_kernel():
    assert set(SPACES) == {"fa2_sm80", "fa3_sm90"}
    assert SPACES["fa3_sm90"].arches == ("sm_90a",)
    assert SPACES["fa3_sm90"].head_dims == fa3_sm90.SUPPORTED_HEAD_DIMS
    assert SPACES["fa2_sm80"].head_dims == fa2_sm80.HEAD_DIMS
    assert "block_n=[64, 80" in repr(SPACES["fa3_sm90"])


@pytest.mark.parametrize("name, d, arch", CASES)
def test_valid_points_are_the_grid_minus_the_problems(name, d, arch):
    s = SPACES[name]
    pts = s.points(d, arch)
    # D = 256 leaves two tiles (128 x 64 / 80, 2 stages) x grid mode: shared memory and registers
    assert (len(pts) == 4 if d == 256 else 10 < len(pts)) and len(pts) < len(grid(s))
    assert all(not s.problems(p, d, arch) for p in pts)
    assert len({s.label(p) for p in pts}) == len(pts)


@pytest.mark.parametrize("d, arch", [(64, "sm_80"), (128, "sm_80"), (128, "sm_90a")])
def test_fa2_constraint_is_the_runtime_config_check(d, arch):
    s = SPACES["fa2_sm80"]
    for p in grid(s):
        cfg = fa2_sm80.Config(p["block_m"], p["block_n"], p["stages"], p["warps"], spill_free=p["spill_free"])
        expected = cfg.problems(d, smem_limit(arch))
        if p["spill_free"]:      # only where the tile without it would spill (D 128, 160+ accumulator registers)
            plain = fa2_sm80.Config(p["block_m"], p["block_n"], p["stages"], p["warps"])
            expected = expected or (d != 128 or plain.acc_regs(d) < 160)
        assert bool(s.problems(p, d, arch)) == bool(expected), p


def test_fa2_spill_free_point():
    """Session 17 (issue 19 item 7): spill_free is a point of the D 128 space, labelled "f", its flags the kernel's
    KV_SPLIT=2 + QK_ROLLED=1; a point from a run tuned before it (no key) is the plain config."""
    from cubridge.runtime.kernels.fa2_sm80 import config
    s = SPACES["fa2_sm80"]
    pt = {"block_m": 128, "block_n": 64, "stages": 2, "warps": 4, "spill_free": True}
    assert pt in s.points(128, "sm_80") and s.label(pt) == "128x64s2w4f"
    assert not any(p["spill_free"] for p in s.points(64, "sm_80"))
    flags = config(pt).defines(128, torch.bfloat16, causal=False)
    assert "-DKV_SPLIT=2" in flags and "-DQK_ROLLED=1" in flags
    assert "-DKV_SPLIT=2" not in config({**pt, "spill_free": False}).defines(128, torch.bfloat16, causal=False)
    old = {k: v for k, v in pt.items() if k != "spill_free"}
    assert config(old) == fa2_sm80.Config(128, 64, 2, 4)
    assert fa2_sm80.Config.parse("128x64s2w4f") == config(pt) and str(config(pt)) == "128x64s2w4f"
    assert fa2_sm80.Config.parse("128x64s2w4") == config(old)


def test_fa2_smem_limit_follows_the_arch():
    p = {"block_m": 64, "block_n": 128, "stages": 3, "warps": 4}      # 208 KB: over sm_80, under sm_90
    assert fa2_sm80.Config(64, 128, 3, 4).smem_bytes(128) > smem_limit("sm_80")
    assert SPACES["fa2_sm80"].problems(p, 128, "sm_80") and not SPACES["fa2_sm80"].problems(p, 128, "sm_90a")


def test_fa3_problems_name_their_reason():
    s = SPACES["fa3_sm90"]
    smem = s.problems({"block_m": 128, "block_n": 192, "stages": 4, "persistent": False}, 128, "sm_90a")
    assert any(p.startswith("shared memory:") for p in smem)
    regs = s.problems({"block_m": 192, "block_n": 144, "stages": 2, "persistent": False}, 64, "sm_90a")
    assert regs and regs[0].startswith("registers:") and "3 consumers" in regs[0]
    assert s.problems({"block_m": 128, "block_n": 72, "stages": 2, "persistent": False}, 128, "sm_90a")[0] \
        .startswith("divisibility:")
    assert s.problems({"block_m": 128, "block_n": 128, "stages": 2, "persistent": True}, 96, "sm_90a")[0] \
        .startswith("head dim:")


def test_fa3_smem_is_the_runtime_arithmetic():
    s = SPACES["fa3_sm90"]
    for p in grid(s):
        for d in (64, 128):
            cfg = fa3_sm90.Fa3Config(head_dim=d, block_m=p["block_m"], block_n=p["block_n"], stages=p["stages"])
            over = cfg.smem_bytes > fa3_sm90.SMEM_LIMIT
            assert over == any(x.startswith("shared memory:") for x in s.problems(p, d, "sm_90a"))


def test_fa3_register_model_reproduces_the_measurements():
    # ref_kernels/fa3_sm90 README/NOTES: D=64 with 3 consumers spills at BLOCK_N >= 144, not at 128;
    # 2 consumers compile spill-free at D=128 BLOCK_N=176 and spill at BLOCK_N=256.
    assert fa3_acc_regs(128, 64) <= FA3_ACC_REG_BUDGET[3] < fa3_acc_regs(144, 64)
    assert fa3_acc_regs(176, 128) <= FA3_ACC_REG_BUDGET[2] < fa3_acc_regs(256, 64)


@pytest.mark.parametrize("name, d, arch", CASES)
def test_valid_points_pass_the_cuir_checker(name, d, arch):
    """The reference program, at every valid point, fits the arch by the CuIR checker's count too."""
    s = SPACES[name]
    prog = parse_file(ref_kernel_dir(name) / "kernel.cuir")
    points = s.points(d, arch)[::3]
    assert points
    for p in points:
        r = check(prog, params=s.to_cuir(p), dims={"D": d}, arch=arch)     # raises past the arch's limit
        assert 0 < r.smem_bytes


@pytest.mark.parametrize("name, d, arch", CASES)
def test_best_known_points_are_valid_warm_starts(name, d, arch):
    s = SPACES[name]
    known = s.best_known(d)
    assert known and all(not s.problems(p, d, arch) for p in known)
    assert set(known[0]) == {p.name for p in s.params}


def test_to_cuir_uses_the_program_params():
    fa3 = SPACES["fa3_sm90"].to_cuir({"block_m": 192, "block_n": 64, "stages": 3, "persistent": True})
    assert fa3 == {"BLOCK_M": 192, "BLOCK_N": 64, "STAGES": 3, "CONSUMERS": 3}
    prog = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
    assert set(fa3) <= set(prog.params())
    fa2 = SPACES["fa2_sm80"].to_cuir({"block_m": 128, "block_n": 64, "stages": 2, "warps": 4})
    assert set(fa2) <= set(parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir").params())


def test_labels():
    assert SPACES["fa3_sm90"].label({"block_m": 128, "block_n": 176, "stages": 2, "persistent": True}) == "128x176s2p"
    assert SPACES["fa2_sm80"].label({"block_m": 128, "block_n": 64, "stages": 2, "warps": 4}) == "128x64s2w4"
