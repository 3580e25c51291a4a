"""The gradient verification rule (cubridge.rule.check_backward on a runtime.variant_bwd.GradCase,
as the tuner's backward check and tests/gpu/test_bwd_variants.py run it), on CPU with stand-in
backwards: a correct one passes; one that leaves elements unwritten, is wrong, writes NaN or
changes an input fails, and the reason names the gradient or the input."""
from __future__ import annotations

import re

import pytest
import torch

from cubridge.rule import GradCheck, check_backward
from cubridge.runtime.variant_bwd import GradCase
from cubridge.spec import load_spec

SPEC = load_spec("prefixlm")


@pytest.fixture(scope="module")
def case():
    # GQA, Nq < Nk, ragged: the shape classes of the GPU checks, small enough for float64 on CPU
    return GradCase(SPEC, {}, (1, 4, 2, 37, 53, 16), torch.bfloat16, seed=3, device="cpu")


def backward(case, edit=None):
    """A stand-in backward: the float64 gradients rounded to the kernel dtype, then `edit`."""
    def bwd(dout, q, k, v, out, lse, sm_scale, dq, dk, dv):
        for t, g in zip((dq, dk, dv), case.golden):
            t.copy_(g)
        if edit is not None:
            edit(dict(dq=dq, dk=dk, dv=dv, q=q, k=k, v=v, dout=dout, lse=lse))
    return bwd


def test_the_case_is_not_trivial(case):
    assert all(g.abs().max() > 0.01 for g in case.golden), "zero gradients cannot test the rule"
    assert not torch.equal(case.golden[0].to(case.q.dtype).double(), case.ref[0].double())


def test_a_correct_backward_passes(case):
    verdict = case.check(backward(case))
    assert isinstance(verdict, GradCheck) and verdict.passed, verdict
    assert all(torch.equal(g, w.to(case.q.dtype)) for g, w in zip(verdict.grads, case.golden))


@pytest.mark.parametrize("edit, reason", [
    (lambda t: t["dk"][0, 1, 7:].fill_(float("nan")), r"^dk: .*NaN/Inf element\(s\) where golden is finite"),
    (lambda t: t["dq"][..., 3].mul_(1.05), r"^dq: max err .* exceeds bound"),
    (lambda t: t["dv"].add_(t["dv"].abs().max() * 0.02), r"^dv: max err .* exceeds bound"),
    (lambda t: t["dv"].view(-1)[5].fill_(float("inf")), r"^dv: .*1 NaN/Inf element"),
    (lambda t: t["lse"].add_(1.0), r"^the backward modified its input\(s\) lse$"),
    (lambda t: t["q"].view(-1)[0].add_(1), r"^the backward modified its input\(s\) q$"),
], ids=["unwritten", "wrong_dq", "biased_dv", "inf", "input_lse", "input_q"])
def test_a_wrong_backward_fails_with_its_reason(edit, reason):
    fresh = GradCase(SPEC, {}, (1, 4, 2, 37, 53, 16), torch.bfloat16, seed=3, device="cpu")   # inputs edited
    verdict = fresh.check(backward(fresh, edit))
    assert not verdict.passed
    assert re.search(reason, verdict.reason), verdict.reason


def test_gradients_are_checked_against_the_dtype_reference_bound(case):
    """The bound is 2 * max|ref - golden| + 1e-5: the dtype reference itself passes, and an error of
    three times the reference's fails (the rule is not a fixed tolerance)."""
    ref = check_backward(lambda dq, dk, dv: [t.copy_(r) for t, r in zip((dq, dk, dv), case.ref)],
                         {}, (case.q, case.k, case.v), case.golden, case.ref)
    assert ref.passed, ref
    worse = tuple(g + 3 * (r.double() - g) for g, r in zip(case.golden, case.ref))
    over = check_backward(lambda dq, dk, dv: [t.copy_(w) for t, w in zip((dq, dk, dv), worse)],
                          {}, (case.q.double(), case.k.double(), case.v.double()), case.golden, case.ref)
    assert not over.passed and over.reason.startswith("dq: "), over
