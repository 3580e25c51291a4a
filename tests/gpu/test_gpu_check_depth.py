"""The tuner's GPU check (search.measure.run_checks over search.gpu_cases.check_cases) on the
causal variant of each reference kernel: every case passes (O and LSE, Nq < Nk, GQA / MQA, past
the KV ring), and the real kernel's call made wrong in LSE only, or right only at Nq == Nk, is
rejected (tests/cpu/test_gpu_check_depth.py runs the same with stand-in kernels on CPU)."""
from __future__ import annotations

import pytest
import torch

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.runtime.build import compile_cubin, default_compiler
from cubridge.runtime.kernels import reference_kernel
from cubridge.search.gpu_cases import check_cases
from cubridge.search.measure import run_checks
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP < (8, 0), reason="needs an sm_80+ GPU")
ARCH = "sm_90a" if CAP == (9, 0) else f"sm_{CAP[0]}{CAP[1]}"
D, HQ, HKV = 128, 8, 8
CAUSAL = load_spec("causal")


@pytest.fixture(scope="module", params=["fa3_sm90", "fa2_sm80"])
def call_at(request):
    if request.param == "fa3_sm90" and CAP != (9, 0):
        pytest.skip("fa3_sm90 needs an sm_90 GPU (H100 / H200)")
    kernel = reference_kernel(request.param)
    cand = transfer(parse_file(kernel.cuir_path()), CAUSAL)
    lowered = lower(cand.program, kernel.name)
    point = next(p for p in kernel.space.best_known(D) if not kernel.space.problems(p, D, kernel.arch))
    cubin = compile_cubin(lowered.source, arch=ARCH, options=kernel.compile_options(point, D, "bf16"),
                          compiler=default_compiler()).cubin
    prepare = kernel.launcher(lowered, cubin, point)
    cuir = kernel.space.to_cuir(point)

    def make(wrap=None):
        def at(c):
            extra = cand.bind(Nq=c.Nq or c.Nk, Nk=c.Nk, Hq=c.Hq, Hkv=c.Hkv, B=c.B, params=cuir, device="cuda")
            call = prepare(extra, "cuda")
            return call if wrap is None else wrap(call)
        return at
    return make, cuir


def checks(call_at, cuir):
    done: list = []
    return run_checks(call_at, CAUSAL, {}, check_cases(HQ, HKV, cuir, []), D, torch.bfloat16, done), done


def test_every_case_passes(call_at):
    make, cuir = call_at
    failed, done = checks(make(), cuir)
    assert failed is None and len(done) == 6, done


def test_a_wrong_lse_is_rejected(call_at):
    def plus_5(call):
        def run(q, k, v, out, lse=None):
            out, lse = call(q, k, v, out, lse)
            lse += 5.0
            return out, lse
        return run
    make, cuir = call_at
    failed, _ = checks(make(plus_5), cuir)
    assert failed is not None and ": LSE: " in failed


def test_a_kernel_right_only_at_nq_equal_nk_is_rejected(call_at):
    def top_aligned(call):
        def run(q, k, v, out, lse=None):
            n = q.shape[2]
            return call(q, k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), out, lse)
        return run
    make, cuir = call_at
    failed, done = checks(make(top_aligned), cuir)
    assert failed is not None and done[-1]["result"] != "pass"
    nq, nk = (int(done[-1]["shape"].split(f" {x}=")[1].split()[0]) for x in ("Nq", "Nk"))
    assert nq < nk
