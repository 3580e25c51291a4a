"""The backward kernels of ref_kernels/fa2_bwd_sm80, run on the CPU by the emulation harness
(emu/: one fiber per CUDA thread, warp-collective ldmatrix / mma.sync / shfl, cp.async performed
at the issuing thread's wait, shared memory poisoned with NaN bytes, guard zones around outputs).

Checked like the GPU tests: dQ, dK, dV pass the verification rule against torch.autograd of the
reference in float64 (golden) and in the kernel dtype (ref); every output element written; the
deterministic mode bitwise repeatable across thread schedules. Each case runs under two
adversarial schedules (the lowest / highest runnable thread first: one warp runs ahead until a
barrier stops it), which is how a missing barrier shows up here (measured: removing either
barrier of fa2_bwd_dkdv fails these cases; under round-robin one of them did not)."""
from __future__ import annotations

import sys
from pathlib import Path

import hashlib
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from cubridge.rule import compare
from cubridge.runtime.fa2_bwd_sm80 import KERNEL_DIR, Config, default_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from bwd_reference import reference  # noqa: E402

CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None or platform.machine() != "x86_64",
                                reason="the emulation harness needs g++ on x86-64 (its fiber switch is x86-64 asm)")
F16, BF16 = torch.float16, torch.bfloat16
# (D, dtype, causal, deterministic): both head dims, dtypes, masks and dQ modes appear.
BUILDS = [(64, F16, True, False), (64, F16, False, True), (128, BF16, False, False), (128, BF16, True, True)]
SCHEDULES = ("low", "high")


def _source_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(KERNEL_DIR.rglob("*")):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".cpp", ".inc"):
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu")
    digest = _source_digest()

    def build(job):
        d, dtype, causal, det = job
        exe = out / f"emu_{d}_{dtype == BF16:d}_{causal:d}_{det:d}_{digest}"
        cmd = [CXX, "-O1", "-std=c++17", "-w", "-DFA2B_HOST_EMU", "-D__CUDA_ARCH__=900", "-include", "emu/host.h",
               "-I.", *default_config(d).defines(d, dtype, causal, det), "emu/harness.cpp", "-o", str(exe)]
        subprocess.run(cmd, cwd=KERNEL_DIR, check=True, capture_output=True, text=True)
        return job, exe

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, BUILDS))


def run_emulated(exe, tmp, q, k, v, out, dout, lse, scale, det, schedule):
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout)):
        t.contiguous().view(torch.int16).numpy().tofile(tmp / f"{name}.bin")
    lse.float().contiguous().numpy().tofile(tmp / "lse.bin")
    b, hq, nq, _ = q.shape
    proc = subprocess.run([str(exe), str(b), str(hq), str(k.shape[1]), str(nq), str(k.shape[2]), repr(scale),
                           str(int(det)), str(tmp)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "EMU_SCHEDULE": schedule})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [torch.from_numpy(np.fromfile(tmp / f"{n}.bin", dtype=np.int16)).view(q.dtype).reshape(t.shape)
            for n, t in (("dq", q), ("dk", k), ("dv", v))]


# (B, Hq, Hkv, Nq, Nk): ragged both ways, queries end-aligned (row i at position Nk - Nq + i; with
# Nq > Nk the first Nq - Nk causal rows see no key and get dQ = 0), GQA, MQA.
SHAPES = [(1, 4, 2, 77, 300), (2, 3, 1, 200, 77), (1, 2, 1, 300, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-h{}x{}-q{}-k{}".format(*s))
@pytest.mark.parametrize("job", BUILDS, ids=lambda j: f"d{j[0]}-{str(j[1])[6:]}-{'causal' if j[2] else 'full'}-"
                                                         f"{'det' if j[3] else 'atomic'}")
def test_rule_under_emulation(harness, tmp_path, job, shape):
    d, dtype, causal, det = job
    b, hq, hkv, nq, nk = shape
    gen = torch.Generator().manual_seed(nq * 7 + d)
    q, dout = (torch.randn(b, hq, nq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, generator=gen).to(dtype) for _ in range(2))
    scale = d ** -0.5
    out, lse, golden = reference(q.double(), k.double(), v.double(), dout.double(), causal, scale)
    ref = reference(q, k, v, dout, causal, scale)[2]
    runs = [run_emulated(harness[job], tmp_path, q, k, v, out.to(dtype), dout, lse, scale, det, s) for s in SCHEDULES]
    for grads in runs:
        for name, x, g, r in zip(("dq", "dk", "dv"), grads, golden, ref):
            assert not x.isnan().any(), f"{name}: {int(x.isnan().sum())} elements never written (or NaN)"
            verdict = compare(x, g, r)
            assert verdict.passed, f"{name}: {verdict}"
    same = [torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*runs)]
    assert same[1] and same[2], "dK / dV differ between thread schedules (they use no atomics)"
    if det:
        assert same[0], "deterministic dQ differs between thread schedules"


def test_shared_memory_sizes_match_the_runtime(harness):
    """The kernel's SMEM_BYTES / DQ_SMEM_BYTES equal what the launcher passes (Config)."""
    for (d, _, _, det), exe in harness.items():
        smem, dq_smem = map(int, subprocess.run([str(exe), "--smem"], capture_output=True, text=True,
                                                check=True).stdout.split())
        cfg: Config = default_config(d)
        assert (smem, dq_smem) == (cfg.smem_bytes(d, det), cfg.dq_smem_bytes(d))
