"""Softcap fused into a sigmoid normalisation: one MUFU op per score instead of two.

A score_mod of the softcap form y = A * tanh(B * s) (A, B positive constants; A = B^-1 = 50 in the
paper's composite) followed by p = sigmoid(y + bias) costs two transcendentals per score, and on
Hopper the MUFU unit is then the bottleneck under the tensor cores (lower/NOTES.md v16). The
sigmoid saturates, so the softcap only needs to be exact where p is not already 0 or 1; there a
small odd polynomial is enough:

    P(u) = u (A0 + A1 u^2 + A2 u^4),  |P(u) - tanh(u)| <= EPS on |u| <= U = 1/2,

a minimax fit, increasing on all of R (9 A1^2 < 20 A0 A2: P'(u) = A0 + 3 A1 u^2 + 5 A2 u^4 has no
real root) with a u^2-polynomial that is positive everywhere (A1^2 < 4 A0 A2). The bound on the fused p~ = sigmoid(A P(u) + b)
against p = sigmoid(A tanh(u) + b), u = B s:
  * |u| <= U:  |p~ - p| <= A EPS / 4 (sigmoid' <= 1/4);
  * u > U:     P and tanh increase, so A P(u) >= A (tanh U - EPS) and A tanh(u) >= A tanh U: both
               p~ and p lie in [sigmoid(A (tanh U - EPS) - |b|), 1]; u < -U mirrors it;
so max |p~ - p| <= TOL = 2^-12 holds when A EPS / 4 <= TOL and
|b| <= bias_max(A) = A (tanh U - EPS) - ln(1 / TOL - 1)   (14.79 for A = 50).
The kernel tests the bias (a uniform value) once per tile and keeps the two-MUFU form otherwise.
For comparison, tanh.approx itself is within 2^-11 relative: up to A * 2^-11 = 0.024 in y at A = 50,
where the polynomial is within A * EPS = 3e-4.

Folded form (x the raw q.k, k = score_scale * B, so u = x k, w = x^2):
    h = (A P(u) + b) / 2 = x * (c0 + c1 w + c2 w^2) + b / 2,
    c0 = A A0 k / 2,  c1 = A A1 k^3 / 2,  c2 = A A2 k^5 / 2,
then p = 0.5 tanh(h) + 0.5: FMUL + 3 FFMA + MUFU + FFMA per score. A masked x = -inf gives
w = +inf, the polynomial +inf, h = -inf and p = 0 exactly; k is kept in [1e-7, 1e7] so that no
coefficient underflows or overflows in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cubridge.cuir import nodes as N

COEFFS = (0.999924857, -0.330855612, 0.112543594)   # A0, A1, A2: minimax of tanh on [0, 1/2]
U = 0.5
EPS = 6e-6          # the fit's 5.31e-6 plus float32 evaluation, checked in tests/cpu/test_fusion.py
TOL = 2.0 ** -12
K_RANGE = (1e-7, 1e7)


@dataclass(frozen=True)
class SoftcapSigmoid:
    amp: float       # A
    rate: float      # B
    bias_max: float  # the fused form is used when |bias| <= bias_max

    def coeffs(self) -> tuple[float, float, float]:
        """c0, c1, c2 of the folded form divided by k, k^3, k^5."""
        a0, a1, a2 = COEFFS
        return 0.5 * self.amp * a0, 0.5 * self.amp * a1, 0.5 * self.amp * a2


def bias_max(amp: float) -> float:
    return amp * (math.tanh(U) - EPS) - math.log(1.0 / TOL - 1.0)


def positive_const(e) -> float | None:
    if isinstance(e, N.Const) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool) \
            and math.isfinite(e.value) and e.value > 0:
        return float(e.value)
    return None


def split_factor(e) -> tuple[float, object]:
    """score = factor * rest, factor a positive constant taken off the top of the expression
    (c * g, g * c, g / c, nested); (1.0, e) when there is none. A positive factor commutes with
    every normalisation's use of the score: the row max, the -inf of a masked pair, relu."""
    if isinstance(e, N.BinOp) and e.op == "*":
        for c, rest in ((e.left, e.right), (e.right, e.left)):
            v = positive_const(c)
            if v is not None:
                f, inner = split_factor(rest)
                return v * f, inner
    if isinstance(e, N.BinOp) and e.op == "/":
        v = positive_const(e.right)
        if v is not None:
            f, inner = split_factor(e.left)
            return f / v, inner
    return 1.0, e


def softcap_form(score) -> tuple[float, float] | None:
    """(A, B) when score is A * tanh(B * s) up to constant placement, else None."""
    if score is None:
        return None
    amp, inner = split_factor(score)
    if not (isinstance(inner, N.Call) and inner.op == "tanh" and len(inner.args) == 1):
        return None
    rate, arg = split_factor(inner.args[0])
    if isinstance(arg, N.Name) and arg.id == "s":
        return amp, rate
    return None


def softcap_sigmoid(ir) -> SoftcapSigmoid | None:
    """The fusion for a lowered variant (VariantIR), or None where it does not apply: no sigmoid,
    no softcap-form score_mod, or an amplitude whose bound above leaves no bias at all."""
    if ir.norm != "sigmoid":
        return None
    form = softcap_form(ir.score)
    if form is None:
        return None
    amp, rate = form
    room = bias_max(amp)
    if amp * EPS / 4.0 > TOL or room <= 0.0:
        return None
    return SoftcapSigmoid(amp, rate, room)
