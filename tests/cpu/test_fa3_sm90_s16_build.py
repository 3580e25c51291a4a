"""Session 16's forward options at D 128 / 64 without a GPU (issue 18): producer_sleep (kernel.cu PRODUCER_SLEEP:
the producer's mbarrier waits take the suspend-time hint, the consumers' do not) and uniform_q at three consumers
(D 64 192 x 128: the Q descriptors in uniform registers) build spill-free on the D 128 / 64 defaults, change the
code where they act, and are off by default. tests/gpu/test_fa3_sm90.py -k s16 runs them under the rule."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from cubridge.runtime.fa3_sm90 import KERNEL_SOURCE, default_config
from test_fa3_sm90_build import _disassembler, _nvcc   # tests/cpu is on sys.path (no __init__.py)
from test_fa3_sm90_d256_build import _build, _fwd_spill

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
NEEDS_TOOLS = pytest.mark.skipif(_nvcc() is None or _disassembler() is None,
                                 reason="nvcc and a SASS disassembler not found (needs the CUDA toolkit, no GPU)")


def test_options_off_by_default_and_their_flags():
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 8192):
                cfg = default_config(d, causal, True, n)
                assert not cfg.producer_sleep and not cfg.uniform_q
                assert not any("PRODUCER_SLEEP" in f or "UNIFORM_Q" in f for f in cfg.defines())
    cfg = default_config(64, True, True, 8192)
    assert "-DPRODUCER_SLEEP=1" in replace(cfg, producer_sleep=True).defines()
    assert "-DUNIFORM_Q=1" in replace(cfg, uniform_q=True).defines()


def _sass(cubin: Path) -> str:
    return subprocess.run([*_disassembler(), str(cubin)], capture_output=True, text=True, check=True).stdout


@NEEDS_TOOLS
def test_s16_options_spill_free_and_where_they_act(tmp_path):
    """producer_sleep: NANOSLEEP.SYNCS on the producer's retry paths only (fewer sites than mbar_sleep, which puts
    every wait to sleep), at D 128 full (128 x 176 + tail_split) and causal and at D 64; uniform_q + desc_once at
    D 64 192 x 128, causal (the 32-register producer spilled 4 bytes before it recomputed the causal bound per tile)
    and full: spill-free, no R2UR left in the steady KV step."""
    d128f, d128c = default_config(128, False, True, 8192), default_config(128, True, True, 8192)
    d64c, d64f = default_config(64, True, True, 8192), default_config(64, False, True, 8192)
    du = dict(desc_once=True, uniform_q=True)
    cfgs = {"d128f_p": replace(d128f, producer_sleep=True), "d128c_p": replace(d128c, producer_sleep=True),
            "d128c_z": replace(d128c, mbar_sleep=True), "d64c": d64c, "d64c_p": replace(d64c, producer_sleep=True),
            "d64c_du": replace(d64c, **du), "d64f_du": replace(d64f, **du),
            "d64c_dup": replace(d64c, **du, producer_sleep=True)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(cfgs, pool.map(lambda kc: _build(kc[1].defines(), KERNEL_SOURCE, tmp_path / f"{kc[0]}.cubin"),
                                       cfgs.items())))
    assert {k: _fwd_spill(v) for k, v in logs.items()} == dict.fromkeys(cfgs, 0)
    sass = {k: _sass(tmp_path / f"{k}.cubin") for k in cfgs}
    sleeps = {k: s.count("NANOSLEEP.SYNCS") for k, s in sass.items()}
    assert sleeps["d64c"] == 0 and sleeps["d64c_du"] == 0
    for k in ("d128f_p", "d128c_p", "d64c_p", "d64c_dup"):
        assert sleeps[k] > 0, f"producer_sleep: no NANOSLEEP.SYNCS in {k}"
    assert 0 < sleeps["d128c_p"] < sleeps["d128c_z"], "producer_sleep put more than the producer's waits to sleep"
    before = list(sys.path)
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        from sass_step_count_fwd import counts, steady_loop
    finally:
        sys.path[:] = before
    steps = {k: counts(steady_loop(sass[k])) for k in ("d64c", "d64c_du", "d64f_du", "d64c_dup")}
    assert steps["d64c"]["opcodes"].get("R2UR", 0) > 0
    for k in ("d64c_du", "d64f_du", "d64c_dup"):
        assert steps[k]["opcodes"].get("R2UR", 0) == 0, f"{k}: R2UR left in the steady step"
        assert steps[k]["instructions"] < steps["d64c"]["instructions"]
    assert steps["d64c_dup"]["instructions"] == steps["d64c_du"]["instructions"], "producer_sleep changed the step"
