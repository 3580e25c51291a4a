"""CPU checks of the Hopper backward's caller-layout path (cubridge.runtime.fa3_bwd_layout, kernel.cu
BNHD): when it is taken (environment, option, strides), clear errors where it cannot be, the temporaries
for a caller's buffer in another layout, the op's fake strides, and BNHD builds (dense, with the GQA
split, a lowered variant) compiling spill-free for sm_90a. The numbers are tests/gpu/test_bwd_layout.py's."""
from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from types import SimpleNamespace

import pytest
import torch

from cubridge.errors import LaunchError
from cubridge.runtime import fa3_bwd_layout as lay
from cubridge.runtime import fa3_bwd_sm90 as hb


def bnhd(t):
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _tensors(model_layout: bool):
    q, dout, out = (torch.randn(2, 8, 64, 128, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(2, 2, 64, 128, dtype=torch.bfloat16) for _ in range(2))
    ts = (dout, q, k, v, out)
    return tuple(bnhd(t) for t in ts) if model_layout else ts


def test_enabled_reads_the_environment(monkeypatch):
    monkeypatch.delenv(lay.ENV, raising=False)
    assert lay.enabled()          # on by default since session 15
    monkeypatch.setenv(lay.ENV, "0")
    assert not lay.enabled()
    monkeypatch.setenv(lay.ENV, "1")
    assert lay.enabled()
    monkeypatch.setenv(lay.ENV, "yes")
    with pytest.raises(LaunchError, match="CUBRIDGE_BWD_BNHD='yes' is neither 0 nor 1"):
        lay.enabled()


def test_choose_auto_explicit_and_off(monkeypatch):
    modes = hb.OPTIONS[hb.DEFAULT_OPTION]
    model, contiguous = _tensors(True), _tensors(False)
    monkeypatch.delenv(lay.ENV, raising=False)
    assert lay.choose(None, modes, *model)                           # on by default (session 15)
    monkeypatch.setenv(lay.ENV, "0")
    assert not lay.choose(None, modes, *model)                       # switched off
    assert lay.choose("bnhd", modes, *model)                         # asked for
    monkeypatch.setenv(lay.ENV, "1")
    assert lay.choose("auto", modes, *model) and not lay.choose("auto", modes, *contiguous)
    assert not lay.choose("bhnd", modes, *model)
    assert not lay.choose("auto", hb.OPTIONS["bulk_overlap_lse"], *model)   # no LEAN / EPILOGUE: keeps bhnd
    with pytest.raises(LaunchError, match="layout='bnhd' with an option without LEAN and EPILOGUE"):
        lay.choose("bnhd", hb.OPTIONS["base"], *model)
    with pytest.raises(LaunchError, match=r"dout: layout='bnhd' needs \[B, N, H, D\] memory"):
        lay.choose("bnhd", modes, *contiguous)
    with pytest.raises(LaunchError, match="layout='nhwc'"):
        lay.choose("nhwc", modes, *model)


def test_fits_needs_map_addressable_q_k_v():
    dout, q, k, v, out = _tensors(True)
    assert lay.fits(dout, q, k, v, out)
    odd = torch.randn(2, 8, 64, 130, dtype=torch.bfloat16)[..., :128]   # 260-byte rows: not 16-byte strides
    assert not lay.fits(dout, odd, k, v, out)
    assert not lay.fits(dout.contiguous(), q, k, v, out)


def test_targets_and_finish():
    mine = bnhd(torch.zeros(1, 4, 8, 64, dtype=torch.float16))
    assert lay.target(mine) is mine
    other = torch.zeros(1, 4, 8, 64, dtype=torch.float16)
    tmp = lay.target(other)
    assert tmp is not other and lay.is_bnhd(tmp) and tmp.shape == other.shape
    tmp.fill_(3.0)
    lay.finish([(tmp, other), (mine, mine)])
    assert bool((other == 3.0).all()) and bool((mine == 0).all())


def test_build_macro_and_cache_key():
    base = hb.options(128, True, True)
    assert "-DBNHD=1" not in base and hb.options(128, True, True, bnhd=False) == base
    assert "-DBNHD=1" in hb.options(128, True, True, bnhd=True)


def test_op_fake_strides_follow_the_path(monkeypatch):
    """backward_fake: contiguous gradients unless the traced decision is in place, then like q, k, v."""
    from cubridge.op import autograd
    dout, q, k, v, out = _tensors(True)
    fake = autograd.backward_fake(dout, q, k, v)
    assert all(g.is_contiguous() and g.shape == t.shape for g, t in zip(fake, (q, k, v)))
    monkeypatch.setenv(lay.ENV, "0")
    assert not autograd.reads_in_place(object(), dout, q, k, v, out)   # off: nothing else asked
    fake = autograd.backward_fake(dout, q, k, v, True)
    assert all(g.stride() == t.stride() for g, t in zip(fake, (q, k, v)))


def _kernel_stub(monkeypatch, seen):
    """run_backward's kernel replaced: records the strides it was handed, returns contiguous gradients
    (as the kernel's copying path does) whose values depend on the inputs."""
    from cubridge.op import autograd

    def vb(dout, q, k, v, out, lse, sm_scale):
        seen.append(tuple(t.is_contiguous() for t in (dout, q, k, v, out)))
        return tuple((t.float() * (i + 2)).to(t.dtype).contiguous() for i, t in enumerate((q, k, v)))
    monkeypatch.setattr(autograd, "variant_backward", lambda op, config: vb)
    monkeypatch.setattr(autograd, "tuned_config", lambda op, nq: None)
    monkeypatch.setattr(autograd, "check_trainable", lambda op, rt: None)


@pytest.mark.parametrize("traced_in_place", [False, True])
def test_op_backward_keeps_the_traced_layout_whatever_the_environment(monkeypatch, traced_in_place):
    """Session 14's failing compiled case: the fake (traced with CUBRIDGE_BWD_BNHD=1, or taken from
    inductor's cache of a graph traced so) promised q's strides, the real op decided again from the
    environment and returned contiguous gradients: inductor's stride assert failed. The decision is
    now an argument of the op: the real op keeps it, copying into q / k / v's layout where the in-place
    path is not available at run time."""
    from cubridge.op import autograd
    seen = []
    _kernel_stub(monkeypatch, seen)
    monkeypatch.setenv(lay.ENV, "0")   # at run time the in-place path is off
    dout, q, k, v, out = _tensors(True)
    lse = torch.zeros(2, 8, 64)
    op = SimpleNamespace()
    grads = autograd.run_backward(op, dout, q, k, v, out, lse, 0.1, [], traced_in_place)
    fake = autograd.backward_fake(dout, q, k, v, traced_in_place)
    assert [g.stride() for g in grads] == [f.stride() for f in fake]
    assert seen == [(True,) * 5]   # the kernel was handed contiguous copies (its default path)
    for i, (g, t) in enumerate(zip(grads, (q, k, v))):
        assert torch.equal(g, (t.float() * (i + 2)).to(t.dtype))


def _compile(job, tmp_path):
    label, source, d, causal, bf16, option, split = job
    cu = tmp_path / f"{label}.cu"
    cu.write_text(source)
    proc = subprocess.run([shutil.which("nvcc"), "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                           *hb.options(d, causal, bf16, option, split, bnhd=True), "-Xptxas", "-v",
                           "-o", str(tmp_path / f"{label}.cubin"), str(cu)], capture_output=True, text=True)
    return label, proc


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_bnhd_builds_compile_spill_free(tmp_path):
    from cubridge.runtime.variant_bwd import VariantBackward
    dense = hb.KERNEL_SOURCE.read_text()
    prefix = VariantBackward("prefixlm").hopper.source
    jobs = [("dense_d128c", dense, 128, True, True, hb.DEFAULT_OPTION, 1),
            ("dense_d64f", dense, 64, False, False, hb.DEFAULT_OPTION, 1),
            ("dense_d128f_s4", dense, 128, False, True, hb.DEFAULT_OPTION, 4),
            ("prefixlm_d128", prefix, 128, False, True, hb.VARIANT_OPTION, 1),
            ("prefixlm_d64_s2", prefix, 64, False, False, hb.VARIANT_OPTION, 2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(j, tmp_path), jobs))
    for label, proc in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{label}: nvcc failed\n{log[-3000:]}"
        reports = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert len(reports) in (3, 4) and all(r == ("0", "0") for r in reports), f"{label}: spills\n{log}"
        assert log.count("bytes stack frame") == log.count("0 bytes stack frame"), f"{label}: stack frame\n{log}"
        for warning in ("C7508", "C7510", "C7515", "C7517", "serializ"):
            assert warning not in log, f"{label}: ptxas warning {warning}\n{log}"
