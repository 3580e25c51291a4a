"""Session 16's forward option at D 128 / 64 without a GPU (issue 18): producer_sleep (kernel.cu PRODUCER_SLEEP:
the producer's mbarrier waits take the suspend-time hint, the consumers' do not) builds spill-free on the D 128 /
64 defaults, puts only the producer's retry paths to sleep, leaves the consumers' steady step alone, and is off by
default; experiments/patches/three_consumer_uniform_q.patch (measured slower, session 16 mid) still applies.
tests/gpu/test_fa3_sm90.py -k s16 runs the option under the rule."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from cubridge.runtime.fa3_sm90 import KERNEL_SOURCE, default_config
from test_fa3_sm90_build import NEEDS_SASS_TOOLS as NEEDS_TOOLS, _disassembler   # tests/cpu is on sys.path
from test_fa3_sm90_d256_build import _build, _fwd_spill

ROOT = Path(__file__).resolve().parents[2]


def test_option_off_by_default_and_its_flag():
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (1024, 8192):
                cfg = default_config(d, causal, True, n)
                assert not cfg.producer_sleep and not any("PRODUCER_SLEEP" in f for f in cfg.defines())
    assert "-DPRODUCER_SLEEP=1" in replace(default_config(64, True, True, 8192), producer_sleep=True).defines()


def test_three_consumer_uniform_q_patch_applies():
    patch = ROOT / "experiments" / "patches" / "three_consumer_uniform_q.patch"
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, check=True, capture_output=True)


def _sass(cubin: Path) -> str:
    return subprocess.run([*_disassembler(), str(cubin)], capture_output=True, text=True, check=True).stdout


@NEEDS_TOOLS
def test_producer_sleep_spill_free_and_producer_only(tmp_path):
    """NANOSLEEP.SYNCS on the producer's retry paths only (fewer sites than mbar_sleep, which puts every wait to
    sleep) at D 128 full (128 x 176 + tail_split) and causal and at D 64; 0 spills; D 64's steady KV step (the
    consumers') the same instructions as without it."""
    d128f, d128c, d64c = (default_config(128, False, True, 8192), default_config(128, True, True, 8192),
                          default_config(64, True, True, 8192))
    cfgs = {"d128f_p": replace(d128f, producer_sleep=True), "d128c_p": replace(d128c, producer_sleep=True),
            "d128c_z": replace(d128c, mbar_sleep=True), "d64c": d64c, "d64c_p": replace(d64c, producer_sleep=True)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(cfgs, pool.map(lambda kc: _build(kc[1].defines(), KERNEL_SOURCE, tmp_path / f"{kc[0]}.cubin"),
                                       cfgs.items())))
    assert {k: _fwd_spill(v) for k, v in logs.items()} == dict.fromkeys(cfgs, 0)
    sass = {k: _sass(tmp_path / f"{k}.cubin") for k in cfgs}
    sleeps = {k: s.count("NANOSLEEP.SYNCS") for k, s in sass.items()}
    assert sleeps["d64c"] == 0
    for k in ("d128f_p", "d128c_p", "d64c_p"):
        assert sleeps[k] > 0, f"producer_sleep: no NANOSLEEP.SYNCS in {k}"
    assert sleeps["d128c_p"] < sleeps["d128c_z"], "producer_sleep put more than the producer's waits to sleep"
    before = list(sys.path)
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        from sass_step_count_fwd import steady_loop
    finally:
        sys.path[:] = before
    assert len(steady_loop(sass["d64c_p"])) == len(steady_loop(sass["d64c"])), "producer_sleep changed the step"


def test_tile_sections_rule_of_the_dense_defaults():
    """Session 17: dense causal D 128 / 64 take tile_sections from 4k on (16k's 128 x 176 too), never at 1k, never
    full attention, never a lowered variant (their host order has its own switch, CUBRIDGE_LPT_SECTIONS)."""
    for d in (64, 128):
        assert [default_config(d, True, True, n).tile_sections for n in (1024, 2048, 4096, 8192, 16384, 32768)] \
            == [0, 0, 1, 1, 1, 1]
        assert not any(default_config(d, False, True, n).tile_sections for n in (1024, 4096, 8192, 16384))
        assert not default_config(d, True, True, 8192, variant=True).tile_sections
    assert default_config(128, True, True, 16384).block_n == 176


@NEEDS_TOOLS
def test_tile_sections_at_the_wide_causal_tile_spill_free(tmp_path):
    cfg = default_config(128, True, True, 16384)
    assert _fwd_spill(_build(cfg.defines(), KERNEL_SOURCE, tmp_path / "c176s.cubin")) == 0
