"""Session 17's forward option without a GPU (issue 18, D 64): exp2_emu (ref_kernels/fa3_sm90/exp2_emu.cuh, EXP2_EMU)
computes m of every 8 column groups' exponentials with a degree-3 polynomial on the FMA pipe. Off by default; its
polynomial (the header's constants, evaluated in float32 as the kernel does) is within 1.1e-4 of 2^x and gives
exactly +0 for -inf; its builds are spill-free with 8 m fewer MUFU in the steady KV step. tests/gpu/test_fa3_sm90.py
-k s17 runs it under the rule."""
from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cubridge.runtime.fa3_sm90 import KERNEL_DIR, KERNEL_SOURCE, default_config
from test_fa3_sm90_build import NEEDS_SASS_TOOLS as NEEDS_TOOLS, _disassembler   # tests/cpu is on sys.path
from test_fa3_sm90_d256_build import _build, _fwd_spill

ROOT = Path(__file__).resolve().parents[2]


def test_option_off_by_default_and_its_flag():
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (1024, 8192, 16384):
                cfg = default_config(d, causal, True, n)
                assert cfg.exp2_emu == 0 and not any("EXP2_EMU" in f for f in cfg.defines())
    assert "-DEXP2_EMU=3" in replace(default_config(64, False, True, 8192), exp2_emu=3).defines()


def poly_exp2(x: np.ndarray) -> np.ndarray:
    """exp2_emu.cuh's poly_exp2 in float32 with the header's constants (numpy rounds each FMA twice: the bound
    below has room for that)."""
    text = (KERNEL_DIR / "exp2_emu.cuh").read_text()
    c = {k: np.float32(v) for k, v in re.findall(r"\b(kC[123]) = ([0-9.e+-]+)f", text)}
    assert set(c) == {"kC1", "kC2", "kC3"}, c
    f32, rnd = np.float32, np.float32(12582912.0)
    x = np.maximum(x.astype(f32), f32(-127.0))
    j = (x + rnd).astype(f32)
    f = (x - (j - rnd).astype(f32)).astype(f32)
    p = ((c["kC3"] * f + c["kC2"]).astype(f32) * f + c["kC1"]).astype(f32)
    p = (p * f + f32(1.0)).astype(f32)
    bits = (j.view(np.int32).astype(np.int64) << 23) + p.view(np.int32).astype(np.int64)
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(f32)


def test_polynomial_accuracy_and_masked_scores():
    x = np.linspace(-125.0, 1.0, 400_001, dtype=np.float32)
    rel = np.abs(poly_exp2(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < 1.1e-4, rel.max()
    tail = poly_exp2(np.array([-np.inf, -1e30, -200.0, -127.0, -126.5, -126.0], dtype=np.float32))
    assert tail[0] == 0.0 and tail[1] == 0.0 and tail[2] == 0.0 and tail[3] == 0.0   # -inf / far below: exactly +0
    assert np.all(tail >= 0) and np.all(tail < 2.0 ** -125) and not np.signbit(tail).any()
    assert poly_exp2(np.array([0.0, -0.0], dtype=np.float32)).tolist() == [1.0, 1.0]


@NEEDS_TOOLS
def test_exp2_emu_spill_free_and_fewer_mufu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))   # (restored after the test)
    for name in [m for m in sys.modules if m == "expkit" or m.startswith("expkit.")]:
        monkeypatch.delitem(sys.modules, name)                 # (and so is the module table)
    from expkit.sass_stalls_fwd import fwd_step_counts        # the static steady step (sass_step_count_fwd.py's)
    d64f, d64c1k = default_config(64, False, True, 8192), default_config(64, True, True, 1024)
    cfgs = {"d64f": d64f, "d64f_e2": replace(d64f, exp2_emu=2), "d64f_e7": replace(d64f, exp2_emu=7),
            "d64c1k": d64c1k, "d64c1k_e3": replace(d64c1k, exp2_emu=3),
            "d128f_e2": replace(default_config(128, False, True, 8192), exp2_emu=2)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(cfgs, pool.map(lambda kc: _build(kc[1].defines(), KERNEL_SOURCE, tmp_path / f"{kc[0]}.cubin"),
                                       cfgs.items())))
    assert {k: _fwd_spill(v) for k, v in logs.items()} == dict.fromkeys(cfgs, 0)
    mufu = {}
    for k in ("d64f", "d64f_e2", "d64f_e7", "d64c1k", "d64c1k_e3"):
        text = subprocess.run([*_disassembler(), str(tmp_path / f"{k}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        mufu[k] = fwd_step_counts(text[text.find(".text.fa3_sm90_fwd:"):])["opcodes"].get("MUFU", 0)
    # 64 exponentials a row-half pair per step (N 128: 2 x 32 a thread) and the 2 rescale factors: 66 by default
    assert mufu["d64f"] == mufu["d64c1k"] == 66, mufu
    assert mufu["d64f_e2"] == 66 - 16 and mufu["d64f_e7"] == 66 - 56 and mufu["d64c1k_e3"] == 66 - 24, mufu


def test_align_end_default_and_its_flag():
    """On for D 64's dense causal default from 4k (its 192-row blocks; session 17's final call), nowhere else."""
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (1024, 4096, 8192, 16384):
                cfg = default_config(d, causal, True, n)
                on = d == 64 and causal and n >= 4096
                assert cfg.align_end == on and any("ALIGN_END" in f for f in cfg.defines()) == on, (d, causal, n)
    assert not default_config(64, True, True, 8192, variant=True).align_end
    assert "-DALIGN_END=1" in replace(default_config(128, True, True, 4096), align_end=True).defines()


@NEEDS_TOOLS
def test_align_end_spill_free_and_only_causal(tmp_path):
    """ALIGN_END: causal builds spill-free (D 64 192 x 128, D 128 128 x 128, D 256 128 x 80); a full-attention build is
    the same cubin with and without it (kAlignEnd is causal only)."""
    cfgs = {"d64c": replace(default_config(64, True, True, 4096), align_end=True),
            "d128c": replace(default_config(128, True, True, 8192), align_end=True),
            "d256c": replace(default_config(256, True, True, 8192), align_end=True),
            "d64f": default_config(64, False, True, 4096), "d64f_a": replace(default_config(64, False, True, 4096), align_end=True)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(cfgs, pool.map(lambda kc: _build([f for f in kc[1].defines() if "HOST_SMEM" not in f],
                                                         KERNEL_SOURCE, tmp_path / f"{kc[0]}.cubin"), cfgs.items())))
    assert {k: _fwd_spill(v) for k, v in logs.items()} == dict.fromkeys(cfgs, 0)
    assert (tmp_path / "d64f.cubin").read_bytes() == (tmp_path / "d64f_a.cubin").read_bytes()

