"""Interval analysis of a traced mask predicate: which KV tiles are empty, full or partial.

For a query-row range [q_lo, q_hi] and a key range [k_lo, k_hi] (CuIR scalar expressions),
`classify(pred)` returns two scalar CuIR expressions:
    must -- true only if every (q, kv) pair in the tile is attended (the tile is *full*);
    may  -- false only if no pair in the tile is attended (the tile is *empty*).
Both are sound: `must` may be false for a full tile and `may` true for an empty one (then the tile
runs as partial, with the mask), never the other way round. Values the analysis cannot bound
(reads of captured tensors, products of two ranges) are unknown: comparisons of them give
must = False, may = True.

Example:
    >>> from cubridge.transfer.trace import trace_mask
    >>> from cubridge.cuir.printer import expr
    >>> must, may = classify(trace_mask(lambda b, h, q, kv: kv <= q).expr)
    >>> expr(must), expr(may)
    ('k_hi <= q_lo', 'k_lo <= q_hi')
"""
from __future__ import annotations

from cubridge.cuir import nodes as N

Q_LO, Q_HI, K_LO, K_HI = (N.Name(n) for n in ("q_lo", "q_hi", "k_lo", "k_hi"))
TRUE, FALSE = N.Const(True), N.Const(False)


class _Unknown:
    pass


UNKNOWN = _Unknown()


def classify(pred) -> tuple:
    """(must, may) scalar expressions for a boolean predicate over iq, ik, b, h."""
    r = _bool(pred)
    return r


# ------------------------------------------------------------------ folding helpers
def _is(e, v) -> bool:
    return isinstance(e, N.Const) and e.value is v


def _and(a, b):
    if _is(a, False) or _is(b, False):
        return FALSE
    if _is(a, True):
        return b
    if _is(b, True):
        return a
    return N.BoolOp("and", (a, b))


def _or(a, b):
    if _is(a, True) or _is(b, True):
        return TRUE
    if _is(a, False):
        return b
    if _is(b, False):
        return a
    return N.BoolOp("or", (a, b))


def _not(a):
    if _is(a, True):
        return FALSE
    if _is(a, False):
        return TRUE
    return N.UnaryOp("not", a)


def _num_const(e):
    if isinstance(e, N.Const) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool):
        return e.value
    return None


def _arith(op, a, b):
    ca, cb = _num_const(a), _num_const(b)
    if ca is not None and cb is not None:
        if op == "+": return N.Const(ca + cb)
        if op == "-": return N.Const(ca - cb)
        if op == "*": return N.Const(ca * cb)
        if op == "//" and cb: return N.Const(ca // cb)
    if op in ("+", "-") and cb == 0:
        return a
    if op == "+" and ca == 0:
        return b
    if op in ("*", "//") and cb == 1:
        return a
    return N.BinOp(op, a, b)


def _cmp(op, a, b):
    ca, cb = _num_const(a), _num_const(b)
    if ca is not None and cb is not None:
        return N.Const({"<": ca < cb, "<=": ca <= cb, ">": ca > cb, ">=": ca >= cb,
                        "==": ca == cb, "!=": ca != cb}[op])
    return N.Compare(op, a, b)


# ------------------------------------------------------------------ numeric ranges
def _range(e):
    """(lo, hi) CuIR expressions bounding e over the tile, or UNKNOWN."""
    if isinstance(e, N.Name):
        if e.id == "iq":
            return Q_LO, Q_HI
        if e.id == "ik":
            return K_LO, K_HI
        # b, h and every other name a traced predicate holds (scalar inputs such as C0, the
        # sizes NQ / NK) are uniform over a tile: a point range.
        return e, e
    if isinstance(e, N.Const):
        if isinstance(e.value, bool) or not isinstance(e.value, (int, float)):
            return UNKNOWN
        return e, e
    if isinstance(e, N.UnaryOp) and e.op == "-":
        r = _range(e.operand)
        return UNKNOWN if r is UNKNOWN else (_arith("-", N.Const(0), r[1]), _arith("-", N.Const(0), r[0]))
    if isinstance(e, N.BinOp):
        a, b = _range(e.left), _range(e.right)
        if a is UNKNOWN or b is UNKNOWN:
            return UNKNOWN
        if e.op == "+":
            return _arith("+", a[0], b[0]), _arith("+", a[1], b[1])
        if e.op == "-":
            return _arith("-", a[0], b[1]), _arith("-", a[1], b[0])
        c = _num_const(b[0]) if b[0] == b[1] else None
        if e.op == "*" and c is not None:
            return ((_arith("*", a[0], b[0]), _arith("*", a[1], b[0])) if c >= 0
                    else (_arith("*", a[1], b[0]), _arith("*", a[0], b[0])))
        if e.op == "//" and isinstance(c, int) and c > 0:
            return _arith("//", a[0], b[0]), _arith("//", a[1], b[0])
        if e.op == "%" and isinstance(c, int) and c > 0:
            return N.Const(0), N.Const(c - 1)
        return UNKNOWN
    if isinstance(e, N.Call) and e.op in ("maximum", "minimum", "max", "min"):
        a, b = _range(e.args[0]), _range(e.args[1])
        if a is UNKNOWN or b is UNKNOWN:
            return UNKNOWN
        fn = "max" if e.op in ("maximum", "max") else "min"
        return N.Call(fn, (a[0], b[0])), N.Call(fn, (a[1], b[1]))
    if isinstance(e, N.Call) and e.op == "where":
        a, b = _range(e.args[1]), _range(e.args[2])
        if a is UNKNOWN or b is UNKNOWN:
            return UNKNOWN
        return N.Call("min", (a[0], b[0])), N.Call("max", (a[1], b[1]))
    if isinstance(e, N.Call) and e.op == "abs" and len(e.args) == 1:
        return _abs_range(_range(e.args[0]))
    return UNKNOWN       # gathers of captured tensors, products of ranges, ...


def _abs_range(r):
    """|x| for x in [lo, hi]: [max(lo, -hi, 0), max(-lo, hi)] (each case: lo >= 0 gives [lo, hi],
    hi <= 0 gives [-hi, -lo], a range across 0 gives [0, max(-lo, hi)]). Local windows are written
    |q - kv| <= w (ModernBERT, Longformer); without this every tile of them ran masked (session 9,
    H100: 0.18-0.25x FlexAttention, which skips the empty blocks)."""
    if r is UNKNOWN:
        return UNKNOWN
    lo, hi = r
    neg_lo, neg_hi = _arith("-", N.Const(0), lo), _arith("-", N.Const(0), hi)
    return N.Call("max", (N.Call("max", (lo, neg_hi)), N.Const(0))), N.Call("max", (neg_lo, hi))


# ------------------------------------------------------------------ booleans
def _bool(e):
    """(must, may) for a boolean expression."""
    if isinstance(e, N.Const) and isinstance(e.value, bool):
        return (TRUE, TRUE) if e.value else (FALSE, FALSE)
    if isinstance(e, N.BinOp) and e.op in ("&", "|"):
        (ma, ya), (mb, yb) = _bool(e.left), _bool(e.right)
        if e.op == "&":
            return _and(ma, mb), _and(ya, yb)
        return _or(ma, mb), _or(ya, yb)
    if isinstance(e, N.BoolOp):
        parts = [_bool(v) for v in e.values]
        comb = _and if e.op == "and" else _or
        must, may = parts[0]
        for m, y in parts[1:]:
            must, may = comb(must, m), comb(may, y)
        return must, may
    if isinstance(e, N.UnaryOp) and e.op in ("~", "not"):
        must, may = _bool(e.operand)
        return _not(may), _not(must)
    if isinstance(e, N.Compare):
        a, b = _range(e.left), _range(e.right)
        if a is UNKNOWN or b is UNKNOWN:
            return FALSE, TRUE
        (alo, ahi), (blo, bhi) = a, b
        op = e.op
        if op in (">", ">="):       # flip to < / <=
            (alo, ahi), (blo, bhi), op = (blo, bhi), (alo, ahi), "<" if op == ">" else "<="
        if op in ("<", "<="):
            return _cmp(op, ahi, blo), _cmp(op, alo, bhi)
        eq_must = _and(_and(_cmp("==", alo, ahi), _cmp("==", blo, bhi)), _cmp("==", alo, blo))
        eq_may = _and(_cmp("<=", alo, bhi), _cmp("<=", blo, ahi))
        return (eq_must, eq_may) if op == "==" else (_not(eq_may), _not(eq_must))
    if isinstance(e, N.Call) and e.op == "where":
        (mc, yc) = _bool(e.args[0])
        (ma, ya), (mb, yb) = _bool(e.args[1]), _bool(e.args[2])
        return _and(ma, mb), _or(ya, yb)
    return FALSE, TRUE
