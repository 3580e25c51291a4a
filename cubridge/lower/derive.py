"""Symbolic derivative of a traced score_mod expression with respect to the score `s`.

The backward needs d score_mod / d s per element (dS picks it up on its way back to q and k):
ALiBi and relative biases give 1, a softcap `c * tanh(s / c)` gives `1 - tanh(s / c)^2`.
Rules for the ops a traced score_mod holds (+ - * / neg, tanh exp sigmoid log sqrt, where /
IfExp, max / min of s with a constant); a term without `s` (bias tables, index arithmetic) has
derivative 0. An op involving `s` that has no rule raises LowerError naming it: a wrong
gradient must never be emitted silently.

Example:
    >>> from cubridge.cuir.parser import parse
    >>> from cubridge.cuir.printer import expr
    >>> e = parse("x = 50.0 * tanh(s / 50.0)\\n").body[0].value
    >>> expr(derivative(e))
    '50.0 * ((1.0 - tanh(s / 50.0) * tanh(s / 50.0)) * (1.0 / 50.0))'
"""
from __future__ import annotations

from cubridge.cuir import nodes as N
from cubridge.lower.cexpr import LowerError

ZERO, ONE = N.Const(0.0), N.Const(1.0)


def mentions(e, name: str) -> bool:
    """Does expression e read the name?"""
    return any(isinstance(x, N.Name) and x.id == name for x in N.walk_expr(e))


def _is(e, v: float) -> bool:
    return isinstance(e, N.Const) and not isinstance(e.value, bool) and e.value == v


def _add(a, b):
    return b if _is(a, 0) else a if _is(b, 0) else N.BinOp("+", a, b)


def _sub(a, b):
    return a if _is(b, 0) else N.UnaryOp("-", b) if _is(a, 0) else N.BinOp("-", a, b)


def _mul(a, b):
    if _is(a, 0) or _is(b, 0):
        return ZERO
    return b if _is(a, 1) else a if _is(b, 1) else N.BinOp("*", a, b)


def _div(a, b):
    return ZERO if _is(a, 0) else N.BinOp("/", a, b)


def derivative(e, var: str = "s"):
    """d e / d var as a CuIR expression (simplified where a factor is 0 or 1)."""
    if not mentions(e, var):
        return ZERO
    if isinstance(e, N.Name):
        return ONE
    if isinstance(e, N.UnaryOp) and e.op == "-":
        return _sub(ZERO, derivative(e.operand, var))
    if isinstance(e, N.BinOp) and e.op in "+-*/":
        return _binop(e, var)
    if isinstance(e, N.IfExp):
        if mentions(e.test, var):
            raise LowerError("score_mod branches on the score itself; its derivative is not generated",
                             hint="write the branch as maximum / minimum or a where on index terms")
        return N.IfExp(e.test, derivative(e.body, var), derivative(e.orelse, var))
    if isinstance(e, N.Call):
        return _call(e, var)
    raise LowerError(f"score_mod uses {type(e).__name__} {getattr(e, 'op', '')!s} on the score; "
                     "no derivative rule for it", hint="add a rule to cubridge/lower/derive.py")


def _binop(e, var):
    a, b = e.left, e.right
    da, db = derivative(a, var), derivative(b, var)
    if e.op == "+":
        return _add(da, db)
    if e.op == "-":
        return _sub(da, db)
    if e.op == "*":
        return _add(_mul(da, b), _mul(a, db))
    if mentions(b, var):     # quotient rule
        return _div(_sub(_mul(da, b), _mul(a, db)), N.BinOp("*", b, b))
    return _mul(da, _div(ONE, b))


def _call(e, var):
    if e.op == "where":
        cond, a, b = e.args
        if mentions(cond, var):
            raise LowerError("score_mod's where() tests the score itself; its derivative is not generated")
        return N.Call("where", (cond, derivative(a, var), derivative(b, var)))
    if len(e.args) != 1 and e.op not in ("maximum", "minimum"):
        raise LowerError(f"score_mod calls {e.op}() on the score; no derivative rule for it",
                         hint="add a rule to cubridge/lower/derive.py")
    x = e.args[0]
    if e.op in ("maximum", "minimum"):
        a, b = e.args
        if mentions(a, var) and mentions(b, var):
            raise LowerError(f"score_mod's {e.op}() has the score on both sides; no derivative rule")
        take_a = N.Compare(">=" if e.op == "maximum" else "<=", a, b)
        return N.Call("where", (take_a, derivative(a, var), derivative(b, var)))
    inner = {
        "tanh": lambda: _sub(ONE, N.BinOp("*", e, e)),
        "exp": lambda: e,
        "sigmoid": lambda: N.BinOp("*", e, N.BinOp("-", ONE, e)),
        "log": lambda: _div(ONE, x),
        "sqrt": lambda: _div(N.Const(0.5), e),
    }.get(e.op)
    if inner is None:
        raise LowerError(f"score_mod calls {e.op}() on the score; no derivative rule for it",
                         hint="add a rule to cubridge/lower/derive.py")
    return _mul(inner(), derivative(x, var))
