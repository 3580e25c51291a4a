"""Backward of mask / score / normalisation variants, lowered into fa2_bwd_sm80 by
cubridge.lower.fa2_bwd_sm80 and run on the CPU by the emulation harness (emu/), checked by the
verification rule: dQ, dK, dV against torch.autograd of the spec's reference in float64 (golden)
and in the kernel dtype (ref), outputs poisoned (NaN) first and every element written, guard
zones intact, under two adversarial thread schedules. Plus the lowering's own unit checks: the
transposed iteration space (q_range) never skips a query tile holding an attended pair, and
nvcc compiles every variant's backward."""
from __future__ import annotations

import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch

from cubridge.rule import compare_grads
from cubridge.runtime.fa2_bwd_sm80 import KERNEL_DIR, default_config
from cubridge.runtime.variant_bwd import GradCase, VariantBackward

CXX, NVCC = shutil.which("g++"), shutil.which("nvcc")
EMU = CXX is not None and platform.machine() == "x86_64"
F16, BF16 = torch.float16, torch.bfloat16
# (spec, D, dtype, deterministic, (B, Hq, Hkv, Nq, Nk), spec params): lengths past the masks'
# constants (blocks / window 256, global 64, prefix Nk / 2) so full, partial and empty tiles all
# occur; ragged; GQA. composite's softcap 2 (not 50): scores of unit variance then reach the
# tanh's curve, so a wrong derivative fails (with 50 the factor is within 1e-3 of 1; measured: a
# score_grad of 1 passed the rule there).
CASES = [
    ("prefixlm", 64, F16, False, (1, 2, 1, 300, 300), {}),
    ("share_question", 64, BF16, False, (1, 2, 1, 400, 400), {}),
    # fewer queries than keys (row i at position Nk - Nq + i): every built-in variant but document
    # (runtime inputs: refused for training), ragged, GQA in some
    ("causal", 64, BF16, True, (1, 4, 2, 77, 300), {}),
    ("full", 64, F16, False, (1, 2, 1, 100, 230), {}),
    ("prefixlm", 64, F16, False, (1, 2, 1, 200, 330), {}),
    ("causal_blockwise", 64, BF16, True, (1, 2, 2, 300, 600), {}),
    ("global_sliding_window", 64, F16, False, (1, 2, 1, 250, 650), {}),
    ("share_question", 64, BF16, False, (1, 2, 1, 150, 400), {}),
    ("relative_pos", 64, F16, False, (1, 4, 2, 120, 200), {}),
    ("sigmoid", 64, BF16, False, (1, 2, 1, 130, 200), {}),
    ("relu", 64, F16, True, (1, 2, 1, 77, 200), {}),
    ("composite", 64, BF16, False, (1, 2, 1, 200, 300), {"softcap": 2.0}),
]
SCHEDULES = ("low", "high")


def _build(bwd: VariantBackward, tmp, d, dtype, det):
    src = tmp / "src"
    shutil.copytree(KERNEL_DIR, src)
    (src / "kernel.cu").write_text(bwd.source)
    exe = tmp / "emu"
    cmd = [CXX, "-O1", "-std=c++17", "-w", "-DFA2B_HOST_EMU", "-D__CUDA_ARCH__=900", "-include", "emu/host.h",
           "-I.", *default_config(d).defines(d, dtype, False, det), "emu/harness.cpp", "-o", str(exe)]
    proc = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def _run(exe, tmp, bwd, q, k, v, out, dout, lse, det, schedule):
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout)):
        t.contiguous().view(torch.int16).numpy().tofile(tmp / f"{name}.bin")
    lse.float().contiguous().numpy().tofile(tmp / "lse.bin")
    b, hq, nq, d = q.shape
    va = bwd.launchable(b, hq, k.shape[1], nq, k.shape[2], d, "cpu")
    (tmp / "va.bin").write_bytes(bytes(va.args))
    for i, (name, _, _) in enumerate(bwd.ir.tables):
        (tmp / f"table{i}.bin").write_bytes(va.keep_alive[i].numpy().tobytes())
    proc = subprocess.run([str(exe), str(b), str(hq), str(k.shape[1]), str(nq), str(k.shape[2]), repr(d ** -0.5),
                           str(int(det)), str(tmp)], capture_output=True, text=True, timeout=600,
                          env={"EMU_SCHEDULE": schedule, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [torch.from_numpy(np.fromfile(tmp / f"{n}.bin", dtype=np.int16)).view(q.dtype).reshape(t.shape)
            for n, t in (("dq", q), ("dk", k), ("dv", v))]


@pytest.mark.skipif(not EMU, reason="the emulation harness needs g++ on x86-64 (its fiber switch is x86-64 asm)")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{str(c[2])[6:]}-{'det' if c[3] else 'atomic'}")
def test_variant_gradients_under_emulation(tmp_path, case):
    name, d, dtype, det, (b, hq, hkv, nq, nk), params = case
    bwd = VariantBackward(name, **params)
    data = GradCase(bwd.spec, params, (b, hq, hkv, nq, nk, d), dtype, seed=nq * 31 + d, device="cpu")
    q, k, v, dout = data.q, data.k, data.v, data.dout
    inputs = [t.clone() for t in (q, k, v, dout)]
    exe = _build(bwd, tmp_path, d, dtype, det)
    runs = [_run(exe, tmp_path, bwd, q, k, v, data.out, dout, data.lse, det, s) for s in SCHEDULES]
    for grads in runs:
        reason = compare_grads(grads, data.golden, data.ref)
        assert reason is None, f"{name} {reason}"
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v, dout))), "inputs changed"
    if det:
        assert all(torch.equal(a.view(torch.int16), c.view(torch.int16)) for a, c in zip(*runs)), \
            "deterministic mode differs between thread schedules"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("name, det", [("share_question", False), ("composite", True), ("relu", False)])
def test_variant_backward_compiles_for_sm90(tmp_path, name, det):
    """The lowered backward builds with nvcc (block table, softcap derivative + sigmoid, relu)."""
    bwd = VariantBackward(name)
    src = tmp_path / "src"
    shutil.copytree(KERNEL_DIR, src)
    (src / "kernel.cu").write_text(bwd.source)
    cmd = [NVCC, "-cubin", "-arch=sm_90a", "-O3", "-std=c++17", "-I.", "-o", str(tmp_path / "k.cubin"),
           *default_config(128).defines(128, BF16, False, det), "kernel.cu"]
    proc = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "k.cubin").stat().st_size > 0


HEAD_MASK_SPEC = """\
'''Head-dependent sliding window: even heads causal, odd heads causal within 100 tokens.'''
import math

import torch

from cubridge.spec import Hooks

PARAMS = {}


def headmask_mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & ((h % 2 == 0) | (q_idx - kv_idx < 100))


def hooks(Nq, Nk, Hq, Hkv, device):
    return Hooks(mask_mod=headmask_mask)


def reference(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    h = torch.arange(q.shape[1], device=q.device)[:, None, None]
    qi = torch.arange(q.shape[2], device=q.device)[:, None]
    ki = torch.arange(k.shape[2], device=q.device)[None, :]
    m = (ki <= qi) & ((h % 2 == 0) | (qi - ki < 100))
    p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1)
    return p.masked_fill(~m, 0.0) @ v
"""


@pytest.mark.skipif(not EMU, reason="the emulation harness needs g++ on x86-64 (its fiber switch is x86-64 asm)")
def test_head_dependent_mask_under_emulation(tmp_path):
    """A mask reading the head: one dK/dV CTA sums a GQA group whose heads mask differently, so the
    transposed range must hold for every head of the group and mask_pred must see the query head."""
    path = tmp_path / "headmask.py"
    path.write_text(HEAD_MASK_SPEC)
    (tmp_path / "run").mkdir()
    test_variant_gradients_under_emulation(tmp_path / "run", (str(path), 64, F16, False, (1, 4, 2, 300, 300), {}))
