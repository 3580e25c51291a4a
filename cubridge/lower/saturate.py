"""Relative-distance saturation of a score_mod: the bounds past which it no longer depends on d.

Position biases are often functions of the relative distance d = kv - q that stop changing far from
the diagonal: T5's buckets (transformers' T5Attention, LongT5) are clamped to the last bucket from
`max_distance` on. `saturation(score)` finds, for a traced score expression that reads the query
and key indices only through d, the bounds (lo, hi) such that the expression is the same function
of the other inputs (s, b, h, tables) for every d >= hi, and for every d <= lo. A KV tile whose
pairs all lie past a bound can then evaluate the score_mod at the bound (kv = q + bound) instead of
at each pair's d: the result is bitwise the same, since every input of every operation is, and the
compiler folds the bucket into a constant (fa3_sm90's kSaturates). Session 10, H100, 8k: T5 encoder
/ decoder bias 96 / 89 TFLOPS with a logf, a division and a gather per score.

The proof is an interval analysis over d in [hi, 2^31 - 1] (or [-(2^31 - 1), lo]): a subexpression
that does not read d, or an integer-valued one whose interval is a single value, is constant; any
other node is constant iff its children are. Float operations are widened outward (1e-5 relative
plus 1e-5 absolute per operation) to cover float32 rounding and the fast intrinsics' error, so a
bucket boundary that falls on a knife edge stays unproven rather than guessed.

Example:
    >>> from cubridge.cuir.parser import parse
    >>> e = parse("x = s + gather(T, minimum(abs(ik - iq), 7), h)\\n").body[0].value
    >>> saturation(e)
    (-7, 7)
"""
from __future__ import annotations

import math

from cubridge.cuir import nodes as N

D_MAX = 2 ** 31 - 1          # |d| of any pair of int32 positions
SEARCH = 2 ** 24             # bounds beyond this are not looked for
_INT_TYPES = {"i8", "i16", "i32", "i64", "int", "u8"}
_MONOTONE = {"exp": math.exp, "exp2": lambda v: 2.0 ** v, "sqrt": math.sqrt, "tanh": math.tanh,
             "log": None, "log2": None, "sigmoid": lambda v: 1.0 / (1.0 + math.exp(-v))}


def _is_d(e) -> int:
    """+1 for ik - iq, -1 for iq - ik, 0 otherwise."""
    if isinstance(e, N.BinOp) and e.op == "-" and isinstance(e.left, N.Name) and isinstance(e.right, N.Name):
        pair = (e.left.id, e.right.id)
        return 1 if pair == ("ik", "iq") else -1 if pair == ("iq", "ik") else 0
    return 0


def _children(e) -> list:
    if isinstance(e, (N.BinOp, N.Compare)):
        return [e.left, e.right]
    if isinstance(e, N.UnaryOp):
        return [e.operand]
    if isinstance(e, N.BoolOp):
        return list(e.values)
    if isinstance(e, N.IfExp):
        return [e.test, e.body, e.orelse]
    if isinstance(e, N.Call):
        return list(e.args) + [v for _, v in e.kwargs]
    return []


def _reads_d(e) -> bool:
    return bool(_is_d(e)) or any(_reads_d(c) for c in _children(e))


def _only_through_d(e) -> bool:
    """True iff every use of iq / ik in e is inside ik - iq or iq - ik."""
    if _is_d(e):
        return True
    if isinstance(e, N.Name):
        return e.id not in ("iq", "ik")
    return all(_only_through_d(c) for c in _children(e))


# ------------------------------------------------------------------ intervals over d
def _widen(lo: float, hi: float):
    return lo - 1e-5 * abs(lo) - 1e-5, hi + 1e-5 * abs(hi) + 1e-5


def _hull(a, b):
    return None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))


def _is_int(e) -> bool:
    """Integer- or bool-valued (the nodes whose interval can be a single exact value)."""
    if isinstance(e, N.Const):
        return isinstance(e.value, (bool, int))
    if _is_d(e) or isinstance(e, (N.Compare, N.BoolOp)):
        return True
    if isinstance(e, N.Call) and e.op == "cast":
        return isinstance(e.args[1], N.Name) and e.args[1].id in _INT_TYPES | {"bool"}
    if isinstance(e, N.BinOp):
        return e.op != "/" and _is_int(e.left) and _is_int(e.right)
    if isinstance(e, N.UnaryOp):
        return _is_int(e.operand)
    if isinstance(e, N.Call) and e.op in ("abs", "minimum", "maximum", "min", "max"):
        return all(_is_int(a) for a in e.args)
    if isinstance(e, N.Call) and e.op == "where":
        return _is_int(e.args[1]) and _is_int(e.args[2])
    return False


def _cmp(op, a, b):
    """{0, 1} interval of a comparison of two intervals."""
    if a is None or b is None:
        return (0, 1)
    if op in (">", ">="):
        a, b, op = b, a, "<" if op == ">" else "<="
    if op == "<":
        return (1, 1) if a[1] < b[0] else (0, 0) if a[0] >= b[1] else (0, 1)
    if op == "<=":
        return (1, 1) if a[1] <= b[0] else (0, 0) if a[0] > b[1] else (0, 1)
    if a[0] == a[1] == b[0] == b[1]:
        return (1, 1) if op == "==" else (0, 0)
    if a[1] < b[0] or b[1] < a[0]:
        return (0, 0) if op == "==" else (1, 1)
    return (0, 1)


def interval(e, d_lo: int, d_hi: int):
    """(lo, hi) bounding e for d in [d_lo, d_hi], or None where unknown (tables, scores)."""
    sign = _is_d(e)
    if sign:
        return (d_lo, d_hi) if sign > 0 else (-d_hi, -d_lo)
    if isinstance(e, N.Const):
        return None if isinstance(e.value, str) or e.value is None else (e.value, e.value)
    if isinstance(e, N.Compare):
        return _cmp(e.op, interval(e.left, d_lo, d_hi), interval(e.right, d_lo, d_hi))
    if isinstance(e, N.UnaryOp):
        a = interval(e.operand, d_lo, d_hi)
        if a is None:
            return None
        if e.op == "-":
            return (-a[1], -a[0])
        return (1 - a[1], 1 - a[0]) if e.op in ("not", "~") and _is_int(e.operand) else None
    if isinstance(e, N.BinOp):
        return _binop(e, interval(e.left, d_lo, d_hi), interval(e.right, d_lo, d_hi))
    if isinstance(e, N.Call):
        return _call(e, d_lo, d_hi)
    return None


def _binop(e, a, b):
    if a is None or b is None:
        return None
    if e.op == "+":
        r = (a[0] + b[0], a[1] + b[1])
    elif e.op == "-":
        r = (a[0] - b[1], a[1] - b[0])
    elif e.op in ("*", "/"):
        if e.op == "/" and b[0] <= 0 <= b[1]:
            return None
        corners = [x * y if e.op == "*" else x / y for x in a for y in b
                   if not (e.op == "*" and (math.isinf(x) or math.isinf(y)) and 0 in (x, y))]
        if len(corners) < 4:
            return None
        r = (min(corners), max(corners))
    elif e.op == "//" and b[0] == b[1] and b[0] > 0:
        return (math.floor(a[0] / b[0]) if math.isfinite(a[0]) else a[0],
                math.floor(a[1] / b[0]) if math.isfinite(a[1]) else a[1])
    elif e.op == "%" and b[0] == b[1] and isinstance(b[0], int) and b[0] > 0:
        return (0, b[0] - 1)
    elif e.op in ("&", "|") and _is_int(e.left) and _is_int(e.right) and 0 <= a[0] and a[1] <= 1 \
            and 0 <= b[0] and b[1] <= 1:
        return (a[0] & b[0], a[1] & b[1]) if e.op == "&" else (a[0] | b[0], a[1] | b[1])
    else:
        return None
    return r if _is_int(e) else _widen(*r)


def _call(e, d_lo, d_hi):
    args = [interval(a, d_lo, d_hi) for a in e.args]
    if e.op == "cast":
        a = args[0]
        if a is None:
            return None
        if _is_int(e):                         # float -> int truncates toward zero: monotone
            trunc = (lambda v: v if math.isinf(v) else int(v))
            return (trunc(a[0]), trunc(a[1]))
        return _widen(*a) if not _is_int(e.args[0]) else a
    if e.op in ("abs",) and args[0] is not None:
        lo, hi = args[0]
        r = (lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0 else (0, max(-lo, hi))
        return r if _is_int(e) else _widen(*r)
    if e.op in ("minimum", "maximum", "min", "max"):
        if any(a is None for a in args):
            return None
        fn = min if e.op in ("minimum", "min") else max
        return (fn(a[0] for a in args), fn(a[1] for a in args))
    if e.op == "where":
        c, a, b = args
        if c is not None and c[0] == c[1]:
            return a if c[0] else b
        return _hull(a, b)
    if e.op in _MONOTONE and len(args) == 1 and args[0] is not None:
        lo, hi = args[0]
        if e.op in ("log", "log2"):
            base = math.log if e.op == "log" else math.log2
            f = (lambda v: -math.inf if v <= 0 else math.inf if math.isinf(v) else base(v))
        elif e.op == "sqrt":
            f = (lambda v: math.nan if v < 0 else math.sqrt(v))
        else:
            g = _MONOTONE[e.op]
            f = (lambda v: _safe(g, v))
        r = (f(lo), f(hi))
        return None if any(math.isnan(v) for v in r) else _widen(*r)
    return None


def _safe(fn, v):
    try:
        return fn(v)
    except OverflowError:
        return math.inf if v > 0 else 0.0


# ------------------------------------------------------------------ constancy and the bounds
def constant_over(e, d_lo: int, d_hi: int) -> bool:
    """True only if e takes one value for every d in [d_lo, d_hi] (the other inputs fixed)."""
    if not _reads_d(e):
        return True
    if _is_int(e):
        r = interval(e, d_lo, d_hi)
        if r is not None and r[0] == r[1] and math.isfinite(r[0]):
            return True
        if _is_d(e):
            return d_lo == d_hi
    return all(constant_over(c, d_lo, d_hi) for c in _children(e))


def saturation(score):
    """(lo, hi): the score expression is constant in d for d <= lo and for d >= hi; None when it
    reads iq / ik otherwise than through d, does not read d, or saturates on neither side (a side
    that does not saturate is +-D_MAX)."""
    if score is None or not _reads_d(score) or not _only_through_d(score):
        return None
    hi = _search(lambda D: constant_over(score, D, D_MAX), 0, SEARCH)
    lo = _search(lambda D: constant_over(score, -D_MAX, -D), 0, SEARCH)
    if hi is None and lo is None:
        return None
    return (-D_MAX if lo is None else -lo, D_MAX if hi is None else hi)


def _search(holds, a: int, b: int):
    """The least D in [a, b] with holds(D), assuming holds is monotone in D (re-checked); None if
    holds(b) fails."""
    if not holds(b):
        return None
    while a < b:
        mid = (a + b) // 2
        if holds(mid):
            b = mid
        else:
            a = mid + 1
    return a if holds(a) else None
