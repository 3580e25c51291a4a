"""Session 15's forward options at D 128 / 64 without a GPU (issue 18): mbar_sleep (hopper_ptx.cuh MBAR_SLEEP,
every head dim now) and desc_once (kernel.cu DESC_ONCE, three consumers) build spill-free on the default
D 128 / 64 configs, change the code where they act and nowhere else, and are off by default.
tests/gpu/test_fa3_sm90.py -k s15 runs them."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from cubridge.runtime.fa3_sm90 import KERNEL_SOURCE, default_config
from test_fa3_sm90_build import _disassembler, _nvcc   # tests/cpu is on sys.path (no __init__.py)
from test_fa3_sm90_d256_build import _build, _fwd_spill

NEEDS_NVCC = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")


def test_options_off_by_default_and_their_flags():
    for d in (64, 128, 256):
        for causal in (False, True):
            cfg = default_config(d, causal, True, 8192)
            assert not cfg.mbar_sleep and not cfg.desc_once
            assert not any("MBAR_SLEEP" in f or "DESC_ONCE" in f for f in cfg.defines())
    cfg = default_config(64, False, True, 8192)
    assert "-DMBAR_SLEEP=1" in replace(cfg, mbar_sleep=True).defines()
    assert "-DDESC_ONCE=1" in replace(cfg, desc_once=True).defines()


@NEEDS_NVCC
def test_s15_options_build_spill_free_where_they_act(tmp_path):
    """mbar_sleep: the mbarrier retry paths sleep (NANOSLEEP.SYNCS) at D 128 full (128 x 176 + tail_split) and
    causal (128 x 128) and D 64 (192 x 128); desc_once changes D 64's three-consumer build (fewer uniform
    descriptor instructions: the descriptors built once per GEMM) and not D 128's (two consumers do so already)."""
    d128f, d128c, d64 = (default_config(128, False, True, 8192), default_config(128, True, True, 8192),
                         default_config(64, True, True, 8192))
    cfgs = [replace(d128f, mbar_sleep=True), replace(d128c, mbar_sleep=True), d64, replace(d64, desc_once=True),
            replace(d64, desc_once=True, mbar_sleep=True), d128c, replace(d128c, desc_once=True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = list(pool.map(lambda ic: _build(ic[1].defines(), KERNEL_SOURCE, tmp_path / f"{ic[0]}.cubin"),
                             enumerate(cfgs)))
    assert [_fwd_spill(log) for log in logs] == [0] * len(cfgs)
    cubins = [(tmp_path / f"{i}.cubin").read_bytes() for i in range(len(cfgs))]
    assert cubins[2] != cubins[3], "desc_once built D 64 192 x 128 as without it"
    tool = _disassembler()
    if tool is None:
        return
    sass = [subprocess.run([*tool, str(tmp_path / f"{i}.cubin")], capture_output=True, text=True, check=True).stdout
            for i in range(len(cfgs))]
    for i in (0, 1, 4):
        assert "NANOSLEEP.SYNCS" in sass[i], f"mbar_sleep: no NANOSLEEP.SYNCS in {cfgs[i].defines()}"
    assert "NANOSLEEP" not in sass[2] and "NANOSLEEP" not in sass[5]
    assert sass[3].count("ULOP3") < sass[2].count("ULOP3"), "desc_once: the descriptors are still rebuilt per k-step"
    assert sass[5] == sass[6], "DESC_ONCE changed a two-consumer build"
