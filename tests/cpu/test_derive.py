"""cubridge.lower.derive: the symbolic derivative of a score_mod, checked against torch.autograd
of the same expression on random scores, and refused (LowerError) where no rule exists."""
from __future__ import annotations

import pytest
import torch

from cubridge.cuir import nodes as N
from cubridge.cuir.parser import parse
from cubridge.lower.cexpr import LowerError
from cubridge.lower.derive import derivative

_FN = {"tanh": torch.tanh, "exp": torch.exp, "sigmoid": torch.sigmoid, "log": torch.log, "sqrt": torch.sqrt}
_BIN = {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div}
_CMP = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge}


def _eval(e, env):
    """A small evaluator of score expressions in torch (float64), for the check."""
    if isinstance(e, N.Const):
        return torch.tensor(float(e.value), dtype=torch.float64)
    if isinstance(e, N.Name):
        return env[e.id]
    if isinstance(e, N.UnaryOp):
        return -_eval(e.operand, env)
    if isinstance(e, N.BinOp):
        return _BIN[e.op](_eval(e.left, env), _eval(e.right, env))
    if isinstance(e, N.Compare):
        return _CMP[e.op](_eval(e.left, env), _eval(e.right, env))
    if isinstance(e, N.IfExp):
        return torch.where(_eval(e.test, env), _eval(e.body, env), _eval(e.orelse, env))
    args = [_eval(a, env) for a in e.args]
    if e.op == "where":
        return torch.where(*args)
    if e.op in ("maximum", "minimum"):
        return (torch.maximum if e.op == "maximum" else torch.minimum)(*args)
    return _FN[e.op](*args)


@pytest.mark.parametrize("text", [
    "50.0 * tanh(s / 50.0)",                 # softcap: 1 - tanh^2
    "s - 0.25 * (iq - ik)",                  # ALiBi / relative bias: 1
    "2.0 * tanh(s / 2.0) + 0.5 * iq",
    "s * s / (1.0 + exp(-s))",
    "where(iq >= ik, s * 3.0, s - 1.0)",
    "maximum(s, -1.0) + sigmoid(s) * log(s * s + 2.0) + sqrt(s * s + 1.0)",
])
def test_derivative_matches_autograd(text):
    e = parse(f"x = {text}\n").body[0].value
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(200, generator=g, dtype=torch.float64) * 3).requires_grad_()
    env = {"s": s, "iq": torch.arange(200.0, dtype=torch.float64), "ik": torch.full((200,), 50.0, dtype=torch.float64)}
    (want,) = torch.autograd.grad(_eval(e, env).sum(), s)
    got = _eval(derivative(e), {**env, "s": s.detach()}).expand(200)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_score_gives_zero_and_identity_one():
    assert derivative(parse("x = iq - ik\n").body[0].value) == N.Const(0.0)
    assert derivative(parse("x = s\n").body[0].value) == N.Const(1.0)


@pytest.mark.parametrize("text, match", [
    ("where(s > 0.0, s, 0.0)", "tests the score itself"),
    ("erf(s)", r"erf\(\) on the score"),
])
def test_refuses_what_it_cannot_differentiate(text, match):
    with pytest.raises(LowerError, match=match):
        derivative(parse(f"x = {text}\n").body[0].value)


def test_floor_division_by_a_power_of_two_is_a_shift_and_a_mask():
    """// and % by 2^k lower to >> k and & (2^k - 1): the same values as floor division for
    negative operands too (two's complement; Python's >> and & on ints are those of int32 here),
    other divisors keep cuir_floordiv / cuir_floormod."""
    from cubridge.cuir.parser import parse
    from cubridge.lower.cexpr import to_c
    names = {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int")}

    def c(text):
        return to_c(parse(f"x = {text}\n").body[0].value, names)
    assert c("iq // 128") == "(q_idx >> 7)" and c("(iq - ik) % 4") == "((q_idx - kv_idx) & 3)"
    assert c("ik % 1") == "(kv_idx & 0)" and c("iq // 1") == "(q_idx >> 0)"
    assert c("iq // 3").startswith("cuir_floordiv(") and c("iq % 6").startswith("cuir_floormod(")
    assert c("iq // -4").startswith("cuir_floordiv(")
    for k in (0, 1, 2, 7, 13, 30):
        for a in (-(1 << 31), -(1 << 30) - 3, -129, -128, -127, -5, -1, 0, 1, 5, 127, 128, (1 << 31) - 1):
            assert a >> k == a // (1 << k) and a & ((1 << k) - 1) == a % (1 << k), (a, k)
