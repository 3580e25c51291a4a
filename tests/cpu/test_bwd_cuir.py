"""The backward's CuIR programs (ref_kernels/fa2_bwd_sm80/{preprocess,dkdv,dq}.cuir, the
deterministic mode of kernel.cu) pass the static checker, and the interpreter's dQ, dK, dV pass the
verification rule against torch.autograd of the reference (float64 golden, kernel-dtype ref);
a wrong mask fails it, and a missing wait is a CuIRRuntimeError at its line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cubridge.cuir.checker import check
from cubridge.cuir.interp import interpret
from cubridge.cuir.parser import parse
from cubridge.errors import CuIRRuntimeError
from cubridge.rule import compare
from cubridge.runtime.fa2_bwd_sm80 import KERNEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from bwd_reference import reference  # noqa: E402

NAMES = ("preprocess", "dkdv", "dq")
TEXTS = {n: (KERNEL_DIR / f"{n}.cuir").read_text() for n in NAMES}
PROGS = {n: parse(t, source=f"{n}.cuir") for n, t in TEXTS.items()}
F16, BF16 = torch.float16, torch.bfloat16
# (B, Hq, Hkv, Nq, Nk, D): one token; ragged GQA with Nq < Nk; MQA with Nq > Nk (causal: the
# first 123 rows see no key); Nq < Nk over several KV tiles (queries end-aligned: row i at Nk - Nq + i).
CASES = [(1, 2, 2, 1, 1, 16), (1, 4, 2, 77, 300, 32), (2, 3, 1, 200, 77, 16), (1, 2, 1, 300, 1000, 16)]


def run_programs(case, dtype, causal, progs=PROGS, program_causal=None):
    """Forward by the float64 reference; preprocess, dkdv, dq by the interpreter. Returns the
    interpreter's (dq, dk, dv), golden and ref gradients."""
    b, hq, hkv, nq, nk, d = case
    gen = torch.Generator().manual_seed(nq * 31 + d)
    q, dout = (torch.randn(b, hq, nq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, generator=gen).to(dtype) for _ in range(2))
    out, lse, golden = reference(q.double(), k.double(), v.double(), dout.double(), causal, d ** -0.5)
    ref = reference(q, k, v, dout, causal, d ** -0.5)[2]
    dvec = interpret(progs["preprocess"], {"O": out.to(dtype), "DO": dout}).outputs["DVEC"]
    x = {"Q": q, "K": k, "V": v, "DO": dout, "LSE": lse.float(), "DVEC": dvec}
    params = {"CAUSAL": int(causal if program_causal is None else program_causal)}
    dkdv = interpret(progs["dkdv"], x, params=params).outputs
    dq = interpret(progs["dq"], x, params=params).outputs["DQ"]
    return (dq, dkdv["DK"], dkdv["DV"]), golden, ref


@pytest.mark.parametrize("name", NAMES)
def test_programs_pass_the_checker(name):
    for d in (64, 128):
        check(PROGS[name], dims={"D": d})


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-h{}x{}-q{}-k{}-d{}".format(*c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradients_pass_the_rule(case, causal):
    dtype = BF16 if case[5] == 32 else F16
    grads, golden, ref = run_programs(case, dtype, causal)
    for name, x, g, r in zip(("dq", "dk", "dv"), grads, golden, ref):
        assert x.dtype == dtype
        verdict = compare(x, g, r)
        assert verdict.passed, f"{name}: {verdict}"


def test_verification_is_not_vacuous():
    """The programs run without the causal mask against a causal reference: dQ and dK fail."""
    grads, golden, ref = run_programs((1, 2, 1, 130, 130, 16), F16, causal=True, program_causal=False)
    assert not compare(grads[0], golden[0], ref[0]).passed
    assert not compare(grads[1], golden[1], ref[1]).passed


@pytest.mark.parametrize("case", [(1, 2, 1, 77, 300, 16), (1, 2, 1, 200, 77, 16)], ids=["q77-k300", "q200-k77"])
def test_top_left_causal_fails_when_lengths_differ(case):
    """The programs with the query shift removed (top-left causal, as before session 8) against the
    end-aligned reference: the rule rejects dQ and dK at Nq != Nk."""
    bad = {n: parse(t.replace("NK - NQ", "0"), source=f"{n}_top_left.cuir") for n, t in TEXTS.items()}
    grads, golden, ref = run_programs(case, F16, causal=True, progs=bad)
    assert not compare(grads[0], golden[0], ref[0]).passed
    assert not compare(grads[1], golden[1], ref[1]).passed


def test_missing_wait_is_a_runtime_error():
    """Drop the wait before the dK/dV GEMMs read the Q / dO tile: the interpreter names the line."""
    text = TEXTS["dkdv"]
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if ln.strip() == "wait_group(0)" and "        " in ln[:16]]
    assert hits, "dkdv.cuir has no inner wait_group(0)"
    del lines[hits[0]]
    bad = dict(PROGS, dkdv=parse("".join(lines), source="bad.cuir"))
    with pytest.raises(CuIRRuntimeError, match="before its cp.async"):
        run_programs((1, 2, 1, 77, 77, 16), F16, True, progs=bad)
