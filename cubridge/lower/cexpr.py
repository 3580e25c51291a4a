"""CuIR expressions -> CUDA C++ expressions (scalar code: one element, one tile bound).

Types are inferred (int, float, bool) so that integer division and modulo floor like Python's
(`cuir_floordiv`, `cuir_floormod`, defined in PRELUDE), float literals carry an `f`, and
`maximum` picks fmaxf or max. Names are mapped by the caller (iq -> q_idx, NK -> seqlen_k, C0 ->
va.C0, ...); `gather(TABLE, i, ...)` reads a variant-argument table with every index clamped into
range, as the interpreter defines it.

Example:
    >>> from cubridge.cuir.parser import parse
    >>> e = parse("x = (ik <= iq) | (ik < C0)\\n").body[0].value
    >>> to_c(e, {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int"), "C0": ("va.C0", "int")})
    '((kv_idx <= q_idx) | (kv_idx < va.C0))'
"""
from __future__ import annotations

import math

from cubridge.cuir import nodes as N
from cubridge.errors import CubridgeError

PRELUDE = """\
__device__ __forceinline__ int cuir_floordiv(int a, int b) { int q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
__device__ __forceinline__ int cuir_floormod(int a, int b) { int r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
__device__ __forceinline__ int cuir_clamp(int i, int n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }
// tanh.approx (sm_75+): one MUFU op, relative error about 2^-11, far under a 16-bit P's rounding.
__device__ __forceinline__ float cuir_tanh(float x) { float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float cuir_sigmoid(float x) { return __fmaf_rn(0.5f, cuir_tanh(0.5f * x), 0.5f); }
// sigmoid(2 h), for a caller that has folded the halving into the FFMA computing h.
__device__ __forceinline__ float cuir_sigmoid_half(float h) { return __fmaf_rn(0.5f, cuir_tanh(h), 0.5f); }
"""
NEG_INF = "__int_as_float(0xff800000)"
POS_INF = "__int_as_float(0x7f800000)"

_FLOAT_FN = {"exp": "__expf", "exp2": "exp2f", "log": "__logf", "log2": "__log2f", "tanh": "cuir_tanh",
             "sqrt": "sqrtf", "rsqrt": "rsqrtf", "abs": "fabsf", "sigmoid": "cuir_sigmoid",
             "erf": "erff"}


# Under a cast to an integer the value picks a table entry or a bucket (T5's log-spaced buckets):
# an approximate log or divide could land on the other side of an integer, so there the
# accurate CUDA functions and IEEE division are used (what torch computes in fp32).
_PRECISE_FN = {**_FLOAT_FN, "exp": "expf", "log": "logf", "log2": "log2f", "tanh": "tanhf",
               "sigmoid": None}      # written out: 1 / (1 + expf(-x))


def to_c_typed(e, names: dict, tables: dict | None = None) -> tuple[str, str]:
    """(C++ text, its type: "int", "float" or "bool") of expression e; as to_c."""
    return _Lower(names, tables or {}).expr(e)


class LowerError(CubridgeError):
    """A CuIR construct has no CUDA lowering here."""


def to_c(e, names: dict, tables: dict | None = None) -> str:
    """C++ text of expression e. names: CuIR name -> (C text, type); tables: gather table name ->
    (C pointer expr, [C size exprs per dim], element type)."""
    return _Lower(names, tables or {}).expr(e)[0]


class _Lower:
    def __init__(self, names, tables):
        self.names, self.tables = names, tables
        self.precise = False             # inside a cast to an integer

    def expr(self, e) -> tuple[str, str]:
        if isinstance(e, N.Const):
            v = e.value
            if isinstance(v, bool):
                return ("true" if v else "false"), "bool"
            if isinstance(v, int):
                return str(v), "int"
            if isinstance(v, float):
                if math.isinf(v):
                    return (POS_INF if v > 0 else NEG_INF), "float"
                text = repr(v)
                return (text if ("." in text or "e" in text) else text + ".0") + "f", "float"
            raise LowerError(f"constant {v!r} has no CUDA form")
        if isinstance(e, N.Name):
            if e.id == "inf":
                return POS_INF, "float"
            if e.id not in self.names:
                raise LowerError(f"name {e.id!r} has no CUDA binding in this region",
                                 hint=f"bound names: {', '.join(sorted(self.names))}")
            return self.names[e.id]
        if isinstance(e, N.UnaryOp):
            x, t = self.expr(e.operand)
            if e.op == "-":
                if x == POS_INF:
                    return NEG_INF, "float"
                return f"(-{x})", t
            return f"(!{x})", "bool"
        if isinstance(e, N.BinOp):
            return self.binop(e)
        if isinstance(e, N.Compare):
            (a, _), (b, _) = self.expr(e.left), self.expr(e.right)
            return f"({a} {e.op} {b})", "bool"
        if isinstance(e, N.BoolOp):
            # Non-short-circuit & and | on bools: the operands are side-effect free (tables are
            # read clamped), and per-element masks then compile to predicate logic (PLOP3)
            # instead of a branch per element.
            parts = [self.expr(v)[0] for v in e.values]
            return "(" + (" & " if e.op == "and" else " | ").join(parts) + ")", "bool"
        if isinstance(e, N.IfExp):
            (c, _), (a, ta), (b, tb) = self.expr(e.test), self.expr(e.body), self.expr(e.orelse)
            return f"({c} ? {a} : {b})", _join(ta, tb)
        if isinstance(e, N.Call):
            return self.call(e)
        raise LowerError(f"{type(e).__name__} has no CUDA lowering in a scalar expression")

    def binop(self, e):
        (a, ta), (b, tb) = self.expr(e.left), self.expr(e.right)
        if e.op in ("&", "|", "^") and ta == tb == "bool":
            op = {"&": "&", "|": "|", "^": "!="}[e.op]
            return f"({a} {op} {b})", "bool"
        if e.op in ("&", "|", "^"):
            return f"({a} {e.op} {b})", "int"
        t = _join(ta, tb)
        k = _pow2_exponent(e.right) if t == "int" else None
        if k is not None and e.op in ("//", "%"):
            # Floor division / modulo by 2^k of a two's-complement int are exactly an arithmetic
            # shift and a mask, for negative values too; cuir_floordiv / cuir_floormod's sign fix-up
            # cost about 20 more instructions per element (sm_90a SASS: ag_natten's // 128 and % 128,
            # the dilated window's % 4 run in every partial tile's mask).
            return (f"({a} >> {k})", "int") if e.op == "//" else (f"({a} & {(1 << k) - 1})", "int")
        if e.op == "//":
            if t == "int":
                return f"cuir_floordiv({a}, {b})", "int"
            return f"floorf({_f(a, ta)} / {_f(b, tb)})", "float"
        if e.op == "%":
            if t == "int":
                return f"cuir_floormod({a}, {b})", "int"
            return f"({_f(a, ta)} - {_f(b, tb)} * floorf({_f(a, ta)} / {_f(b, tb)}))", "float"
        if e.op == "/" and self.precise:
            return f"({_f(a, ta)} / {_f(b, tb)})", "float"
        if e.op == "/":
            c = _float_const(e.right)
            if c:                # by a constant: a multiply by its reciprocal (no MUFU.RCP per element)
                return f"({_f(a, ta)} * {c_literal(1.0 / c)})", "float"
            # approximate division (2 ulp): an IEEE divide per score element is slow
            return f"__fdividef({_f(a, ta)}, {_f(b, tb)})", "float"
        return f"({a} {e.op} {b})", t

    def call(self, e):
        if e.op == "cast":
            return self.cast(e)
        args = [self.expr(a) for a in e.args] if e.op != "gather" else []
        if e.op in _FLOAT_FN:
            x, t = args[0]
            if e.op == "abs" and t == "int":
                return f"abs({x})", "int"
            if e.op == "sigmoid" and self.precise:
                return f"(1.f / (1.f + expf(-{_f(x, t)})))", "float"
            return f"{(_PRECISE_FN if self.precise else _FLOAT_FN)[e.op]}({_f(x, t)})", "float"
        if e.op == "relu":
            x, t = args[0]
            return f"fmaxf({_f(x, t)}, 0.f)", "float"
        if e.op in ("maximum", "minimum", "max", "min"):
            (a, ta), (b, tb) = args
            big = e.op in ("maximum", "max")
            if _join(ta, tb) == "int":
                return f"{'max' if big else 'min'}({a}, {b})", "int"
            return f"{'fmaxf' if big else 'fminf'}({_f(a, ta)}, {_f(b, tb)})", "float"
        if e.op == "where":
            (c, _), (a, ta), (b, tb) = args
            t = _join(ta, tb)
            if t == "float":
                a, b = _f(a, ta), _f(b, tb)
            return f"({c} ? {a} : {b})", t
        if e.op == "cdiv":
            (a, _), (b, _) = args
            return f"cuir_floordiv({a} + {b} - 1, {b})", "int"
        if e.op == "gather":
            return self.gather(e)
        raise LowerError(f"op {e.op}() has no CUDA lowering in a scalar expression")

    def cast(self, e):
        to = e.args[1].id if len(e.args) > 1 and isinstance(e.args[1], N.Name) else "f32"
        outer, self.precise = self.precise, self.precise or to == "i32"
        try:
            x, t = self.expr(e.args[0])
        finally:
            self.precise = outer
        if to == "i32":                  # C's float -> int conversion truncates toward zero, as torch's
            return (x, t) if t == "int" else (f"int({x})", "int")
        return (f"float({x})", "float") if t != "float" else (x, t)

    def gather(self, e):
        table = e.args[0]
        if not isinstance(table, N.Name) or table.id not in self.tables:
            raise LowerError(f"gather from {getattr(table, 'id', table)!r}: not a variant table")
        ptr, sizes, etype = self.tables[table.id]
        idx = [self.expr(a)[0] for a in e.args[1:]]
        if len(idx) != len(sizes):
            raise LowerError(f"gather({table.id}) with {len(idx)} indices, table has {len(sizes)} dims")
        flat = None
        for i, n in zip(idx, sizes):
            term = f"cuir_clamp({i}, {n})"
            flat = term if flat is None else f"({flat}) * {n} + {term}"
        return f"{ptr}[{flat}]", etype


def _pow2_exponent(e) -> int | None:
    """k where `e` is the int constant 2^k (k in 0..30), else None."""
    if isinstance(e, N.Const) and type(e.value) is int and 0 < e.value < (1 << 31) and e.value & (e.value - 1) == 0:
        return e.value.bit_length() - 1
    return None


def _float_const(e):
    if isinstance(e, N.Const) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool) \
            and e.value != 0 and math.isfinite(e.value):
        return float(e.value)
    return None


def c_literal(v: float) -> str:
    """A float constant as CUDA source: `c_literal(2) == "2.0f"`, `c_literal(0.5) == "0.5f"`."""
    text = repr(float(v))
    return (text if ("." in text or "e" in text) else text + ".0") + "f"


def _join(a: str, b: str) -> str:
    if "float" in (a, b):
        return "float"
    if a == b:
        return a
    return "int"


def _f(x: str, t: str) -> str:
    return x if t == "float" else f"float({x})"
