"""The verification rule of docs/DESIGN.md, as one pure function used by every check (CPU and GPU).

    golden = reference in float64; ref = the same reference in the kernel's dtype
    pass  iff  max|out - golden| <= 2 * max|ref - golden| + 1e-5
          and  out has no NaN / Inf where golden has none

`check_run` adds the parts that need the run itself (poisoned outputs, unchanged inputs, bitwise
determinism) for a kernel called as `call(*inputs, out)`; the CPU interpreter's check (verify.py)
does the same for its own runs. `check_backward` is the same rule for a backward's dQ, dK, dV (the
tuner's gradient check, cubridge/search/measure_bwd.py, and the GPU tests use it).

Example:
    >>> import torch
    >>> g = torch.randn(4, 8, dtype=torch.float64)
    >>> compare(g.float(), g, g.bfloat16()).passed
    True
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ABS_SLACK = 1e-5
REF_FACTOR = 2.0


@dataclass(frozen=True)
class Verdict:
    passed: bool
    max_err: float        # max |out - golden|
    bound: float          # 2 * max |ref - golden| + 1e-5
    reason: str = ""      # why it failed; empty when it passed

    def __str__(self) -> str:
        status = "pass" if self.passed else f"FAIL ({self.reason})"
        return f"max err {self.max_err:.3e} <= bound {self.bound:.3e}: {status}"


def compare(out: torch.Tensor, golden: torch.Tensor, ref: torch.Tensor) -> Verdict:
    """Apply the rule to one output tensor. All three must have the same shape."""
    if out.shape != golden.shape or ref.shape != golden.shape:
        return Verdict(False, float("inf"), float("nan"),
                       f"shape mismatch: out {tuple(out.shape)}, golden {tuple(golden.shape)}, "
                       f"ref {tuple(ref.shape)}")
    g = golden.detach().to("cpu", torch.float64)
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    g_finite = torch.isfinite(g)
    bad = ~torch.isfinite(o) & g_finite
    if bool(bad.any()):
        n = int(bad.sum())
        idx = tuple(int(i) for i in bad.nonzero()[0])
        return Verdict(False, float("inf"), float("nan"),
                       f"{n} NaN/Inf element(s) where golden is finite, first at index {idx}")
    # Where golden itself is not finite, out must match it exactly (same inf sign / NaN).
    if not bool(g_finite.all()):
        same = (o == g) | (torch.isnan(o) & torch.isnan(g))
        if not bool(same[~g_finite].all()):
            return Verdict(False, float("inf"), float("nan"),
                           "out differs from golden where golden is not finite")
    err = (o - g).abs()[g_finite]
    ref_err = (r - g).abs()[g_finite & torch.isfinite(r)]
    max_err = float(err.max()) if err.numel() else 0.0
    bound = REF_FACTOR * (float(ref_err.max()) if ref_err.numel() else 0.0) + ABS_SLACK
    if max_err <= bound:
        return Verdict(True, max_err, bound)
    return Verdict(False, max_err, bound, f"max err {max_err:.3e} exceeds bound {bound:.3e}")


def check_run(call, inputs: tuple, golden: torch.Tensor, ref: torch.Tensor) -> str | None:
    """The whole rule for a kernel run `call(*inputs, out)`: None when it holds, else the reason.
    The output is poisoned (NaN) before each of two runs, so an element never written fails
    compare(); the inputs must be unchanged and the second run bitwise identical to the first.

    >>> g = torch.randn(2, 3, dtype=torch.float64)
    >>> check_run(lambda x, out: out.copy_(x), (g.float(),), g, g.bfloat16()) is None
    True
    >>> check_run(lambda x, out: out[0].copy_(x[0]), (g.float(),), g, g.bfloat16())[:9]
    '3 NaN/Inf'
    """
    before = [t.clone() for t in inputs]
    outs = []
    for _ in range(2):
        out = torch.full_like(inputs[0], float("nan"))
        call(*inputs, out)
        if out.is_cuda:
            torch.cuda.synchronize()
        outs.append(out)
    if any(not torch.equal(a, b) for a, b in zip(before, inputs)):
        return "inputs changed by the run"
    if not torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0)):
        return "two runs differ (race or uninitialised read)"
    verdict = compare(outs[0], golden, ref)
    return None if verdict.passed else verdict.reason


GRAD_NAMES = ("dq", "dk", "dv")


@dataclass(frozen=True)
class GradCheck:
    """The rule's verdict on one backward run: `reason` None when it holds; `grads` what the run
    wrote (NaN where it wrote nothing), for the callers' repeatability checks."""
    reason: str | None
    grads: tuple

    @property
    def passed(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        return "pass" if self.passed else self.reason


def compare_grads(grads, golden, ref) -> str | None:
    """compare() on dQ, dK, dV in turn: None when all three hold, else the first failure, named."""
    for name, out, g, r in zip(GRAD_NAMES, grads, golden, ref):
        verdict = compare(out, g, r)
        if not verdict.passed:
            return f"{name}: {verdict}"
    return None


def check_backward(call, inputs: dict, like: tuple, golden: tuple, ref: tuple) -> GradCheck:
    """The rule for a backward: `call(dq, dk, dv)` writes the gradients into the tensors it is
    given, NaN-poisoned first and shaped as `like` (q, k, v), so an element never written fails;
    each gradient under compare() against golden / ref; the named `inputs` must be unchanged.
    Bitwise repeatability is the caller's (a reduce-add dQ is not repeatable by design).

    >>> g = tuple(torch.randn(2, 3, dtype=torch.float64) for _ in range(3))
    >>> ref = tuple(x.float() for x in g)
    >>> def bwd(dq, dk, dv): [t.copy_(x) for t, x in zip((dq, dk, dv), g)]
    >>> check_backward(bwd, {}, g, g, ref).passed
    True
    >>> def half(dq, dk, dv): bwd(dq, dk, dv); dv[1].fill_(float("nan"))     # a row never written
    >>> check_backward(half, {}, g, g, ref).reason.split("FAIL ")[1]
    '(3 NaN/Inf element(s) where golden is finite, first at index (1, 0))'
    """
    saved = {name: t.clone() for name, t in inputs.items()}
    grads = tuple(torch.full_like(t, float("nan")) for t in like)
    call(*grads)
    if any(t.is_cuda for t in grads):
        torch.cuda.synchronize()
    reason = compare_grads(grads, golden, ref)
    changed = [name for name, t in inputs.items() if not torch.equal(t, saved[name])]
    if reason is None and changed:
        reason = f"the backward modified its input(s) {', '.join(changed)}"
    return GradCheck(reason, grads)
