"""Session 15's D 256 option without a GPU (issue 19 bar 3): uniform_q (kernel.cu UNIFORM_Q, off by default)
makes the consumer index warp-uniform in the consumers' branch, so that the Q descriptors of the QK GEMM live
in uniform registers. Its builds are spill-free, its steady KV step has no R2UR left (experiments/
sass_step_count.py --fwd, the count the mid-call A/B is read against) and fewer at full attention, and it
changes nothing where it does not apply (D 128). tests/gpu/test_fa3_sm90_d256.py (s15) runs it under the rule."""
from __future__ import annotations

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


@pytest.fixture(scope="module")
def step_counts():
    """experiments/sass_step_count.py's fwd_step_counts, imported without leaving sys.path or modules changed."""
    before = list(sys.path)
    added = [m for m in ("expkit", "sass_step_count") if m not in sys.modules]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import sass_step_count
        yield sass_step_count.fwd_step_counts
    finally:
        sys.path[:] = before
        for m in added:
            sys.modules.pop(m, None)


def test_uniform_q_is_an_option():
    assert "-DUNIFORM_Q=1" in Fa3Config(256, 128, 80, 2, causal=True, uniform_q=True).defines()
    assert not any("UNIFORM_Q" in f for f in Fa3Config(256, 128, 80, 2, causal=True).defines())


@NEEDS_NVCC
def test_uniform_q_spill_free_fewer_r2ur_and_only_at_256(tmp_path, step_counts):
    fr = dict(causal=True, wg_turns=False, rescale_before_pv=True)
    cfgs = {"fr": Fa3Config(256, 128, 80, 2, **fr), "fru": Fa3Config(256, 128, 80, 2, **fr, uniform_q=True),
            "frkzu": Fa3Config(256, 128, 80, 2, **fr, k_before_v=True, mbar_sleep=True, uniform_q=True),
            "u": Fa3Config(256, 128, 80, 2, causal=True, uniform_q=True),
            "full_fr": Fa3Config(256, 128, 80, 2, **{**fr, "causal": False}),
            "full_fru": Fa3Config(256, 128, 80, 2, **{**fr, "causal": False}, uniform_q=True),
            "d128": Fa3Config(128, 128, 128, 2, causal=True),
            "d128u": Fa3Config(128, 128, 128, 2, causal=True, uniform_q=True)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(cfgs, pool.map(lambda kc: _build(kc[1].defines(), KERNEL_SOURCE, tmp_path / f"{kc[0]}.cubin"),
                                       cfgs.items())))
    d256 = ("fr", "fru", "frkzu", "u", "full_fr", "full_fru")
    assert {k: _fwd_spill(logs[k]) for k in d256} == dict.fromkeys(d256, 0)
    cubin = {k: (tmp_path / f"{k}.cubin").read_bytes() for k in cfgs}
    assert cubin["d128u"] == cubin["d128"], "uniform_q changed a D 128 build (D 256 only)"
    sass = {k: subprocess.run([*_disassembler(), str(tmp_path / f"{k}.cubin")], capture_output=True, text=True,
                              check=True).stdout for k in ("fr", "fru", "frkzu", "full_fr", "full_fru")}
    counts = {k: step_counts(v[v.find(".text.fa3_sm90_fwd:"):]) for k, v in sass.items()}
    r2ur = {k: c["opcodes"].get("R2UR", 0) for k, c in counts.items()}
    # nvcc 13.0: causal fr 537 instructions a step with 32 R2UR (the Q descriptor, a pair per QK HGMMA), fru 468
    # with none; full 515 (32) -> 499 (10)
    assert r2ur["fr"] >= 16 and r2ur["full_fr"] >= 16, r2ur
    assert r2ur["fru"] == r2ur["frkzu"] == 0 and r2ur["full_fru"] <= r2ur["full_fr"] - 16, r2ur
    for k, base in (("fru", "fr"), ("frkzu", "fr"), ("full_fru", "full_fr")):
        assert counts[k]["instructions"] <= counts[base]["instructions"] - 12, (k, counts[k], counts[base])
        assert counts[k]["opcodes"]["HGMMA"] == counts[base]["opcodes"]["HGMMA"] == 21
