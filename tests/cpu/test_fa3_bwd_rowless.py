"""CPU checks of session 17's row-term switch for the Hopper variant backward (cubridge.lower.fa3_bwd_sm90,
CUBRIDGE_BWD_ROWLESS): sigmoid and relu read neither LSE nor D = rowsum(dO * O), so with the switch on their
softmax_bwd region says kRowTerms = false, and the kernel then skips the preprocess's O / dO reads and the
producer's LSE / Dvec row loads. Off (the default) every source keeps kRowTerms = true; softmax variants and the
dense reference never change. The rowless builds compile spill-free on VARIANT_OPTION and its DESC64 twin.
CUBRIDGE_BWD_DS_FACTOR=1: the same regions say kDsFactor = kDsFromP32 (the P pass leaves dS / dP in the f32 P^T);
composite and relu then build the split passes, spill-free."""
from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from cubridge.lower.cexpr import LowerError
from cubridge.lower.fa3_bwd_sm90 import DS_FACTOR_ENV, ROWLESS_ENV, SOFTCAP_SPLIT_ENV, lower_source
from cubridge.runtime import fa3_bwd_sm90 as hb
from cubridge.runtime.variant_bwd import VariantBackward

NON_SOFTMAX = ("sigmoid", "relu", "composite")
U64 = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_u64"


def _source(name: str) -> str:
    return lower_source(hb.KERNEL_SOURCE.read_text(), VariantBackward(name).ir)


def test_dense_reference_reads_row_terms():
    src = hb.KERNEL_SOURCE.read_text()
    assert src.count("constexpr bool kRowTerms = true;") == 1
    # every use is a compile-time test: with kRowTerms true the dense kernel is what it was
    assert "if (kRowTerms && real)" in src and "kLseSmem && kRowTerms" in src


def test_rowless_knob(monkeypatch):
    monkeypatch.delenv(ROWLESS_ENV, raising=False)                       # on by default since session 17
    assert all("constexpr bool kRowTerms = false;" in _source(n) for n in NON_SOFTMAX)
    monkeypatch.setenv(ROWLESS_ENV, "0")
    off = {n: _source(n) for n in (*NON_SOFTMAX, "prefixlm")}
    for n in NON_SOFTMAX:
        assert off[n].count("constexpr bool kRowTerms = true;") == 1, n
    monkeypatch.setenv(ROWLESS_ENV, "1")
    for n in NON_SOFTMAX:
        on = _source(n)
        assert on.count("constexpr bool kRowTerms = false;") == 1 and "kRowTerms = true" not in on, n
        # only that line differs
        assert on.replace("kRowTerms = false;", "kRowTerms = true;") == off[n], n
    assert _source("prefixlm") == off["prefixlm"], "a softmax variant needs its row terms"
    monkeypatch.setenv(ROWLESS_ENV, "yes")
    with pytest.raises(LowerError, match=ROWLESS_ENV):
        _source("sigmoid")


def test_ds_factor_knob(monkeypatch):
    monkeypatch.delenv(DS_FACTOR_ENV, raising=False)                     # on by default since session 17
    monkeypatch.delenv(SOFTCAP_SPLIT_ENV, raising=False)
    assert all("kDsFactor = kDsFromP32;" in _source(n) for n in NON_SOFTMAX)
    monkeypatch.setenv(DS_FACTOR_ENV, "0")
    off = {n: _source(n) for n in (*NON_SOFTMAX, "prefixlm")}
    for n in NON_SOFTMAX:
        assert off[n].count("constexpr bool kDsFactor = false;") == 1, n
    monkeypatch.setenv(DS_FACTOR_ENV, "1")
    for n in NON_SOFTMAX:
        on = _source(n)
        assert on.replace("kDsFactor = kDsFromP32;", "kDsFactor = false;") == off[n], n
    assert "return fmaf(-p, p, p);" in _source("sigmoid") and "return p != 0.f ? va_arg : 0.f;" in _source("relu")
    assert _source("prefixlm") == off["prefixlm"]
    monkeypatch.setenv(SOFTCAP_SPLIT_ENV, "1")   # composite's factor then comes from softmax_ds (softcap_split)
    assert "constexpr bool kDsFactor = false;" in _source("composite")
    monkeypatch.setenv(DS_FACTOR_ENV, "on")
    with pytest.raises(LowerError, match=DS_FACTOR_ENV):
        _source("sigmoid")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_ds_factor_compiles_spill_free(monkeypatch, tmp_path):
    """composite and relu on the split passes with the factor (and rowless), D 128 bf16 / fp16 and D 64 bf16 / fp16 on
    VARIANT_OPTION, D 128 bf16 on _u64; the P pass's wait is the split one (S^T only: DEPBAR 1 before the first MUFU /
    FMNMX is not checked here, the GPU A/B times it)."""
    monkeypatch.setenv(ROWLESS_ENV, "1")
    monkeypatch.setenv(DS_FACTOR_ENV, "1")
    sources = {n: _source(n) for n in ("composite", "relu")}
    jobs = [(f"{n}_dsf", sources[n], d, bf16, hb.VARIANT_OPTION) for n in sources
            for d, bf16 in ((128, True), (128, False), (64, True), (64, False))]
    jobs += [(f"{n}_dsf", sources[n], 128, True, U64) for n in sources]
    _check_builds(jobs, tmp_path)


def test_u64_is_a_variant_option():
    assert U64 in hb.VARIANT_OPTIONS
    assert hb.OPTIONS[U64] == hb.OPTIONS[hb.VARIANT_OPTION]._replace(desc64=1)


def _compile(job, tmp_path):
    name, src, d, bf16, option = job
    cu = tmp_path / f"{name}_d{d}b{int(bf16)}_{option}.cu"   # one per job: the pool's two threads never share one
    cu.write_text(src)
    out = cu.with_suffix(".cubin")
    proc = subprocess.run([shutil.which("nvcc"), "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                           *hb.options(d, False, bf16, option), "-Xptxas", "-v", "-o", str(out), str(cu)],
                          capture_output=True, text=True)
    return job[0], job[2:], proc


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_rowless_compiles_spill_free(monkeypatch, tmp_path):
    """sigmoid (split passes) and relu (one pass), rowless, at D 128 bf16 on VARIANT_OPTION and _u64, relu also D 64
    fp16: every entry spill-free, no stack frame, no ptxas serialisation warning."""
    monkeypatch.setenv(ROWLESS_ENV, "1")
    sources = {n: _source(n) for n in ("sigmoid", "relu")}
    jobs = [(f"{n}_rl", sources[n], 128, True, o) for n in sources for o in (hb.VARIANT_OPTION, U64)]
    jobs.append(("relu_rl64", sources["relu"], 64, False, hb.VARIANT_OPTION))
    _check_builds(jobs, tmp_path)


def _check_builds(jobs, tmp_path) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(j, tmp_path), jobs))
    for name, spec, proc in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{name} {spec}: nvcc failed\n{log[-3000:]}"
        reports = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert len(reports) in (2, 3) and all(r == ("0", "0") for r in reports), f"{name} {spec}: spills\n{log}"
        assert log.count("bytes stack frame") == log.count("0 bytes stack frame"), f"{name} {spec}: stack\n{log}"
        for warning in ("C7508", "C7510", "C7515", "C7517", "serializ"):
            assert warning not in log, f"{name} {spec}: ptxas warning {warning}\n{log}"
