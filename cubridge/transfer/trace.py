"""Symbolic tracing of FlexAttention-style mods into CuIR expressions.

`trace_mask(mask_mod)` and `trace_score(score_mod)` call the user's function with symbolic
stand-ins for b, h, q_idx, kv_idx (and score). Python operators and the torch functions listed in
`_TORCH` build CuIR expression nodes; reading a captured tensor with symbolic indices becomes a
`gather` from a new kernel input. Anything else (Python control flow on a symbolic value, an
unsupported torch function, a method we do not know) is a TraceError naming the line of the
user's function and the construct.

Example:
    >>> from cubridge.cuir.printer import expr
    >>> t = trace_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < 64))
    >>> expr(t.expr)
    '(ik <= iq) | (ik < 64)'
"""
from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field

import torch

from cubridge.cuir import nodes as N
from cubridge.errors import CubridgeError

# The names the traced expressions use (the transfer binds them in the target program).
B_NAME, H_NAME, Q_NAME, KV_NAME, SCORE_NAME = "b", "h", "iq", "ik", "s"


class TraceError(CubridgeError):
    """A hook uses something the rules proposer cannot express in CuIR."""


@dataclass
class Capture:
    """A tensor the hook closes over, read by index: becomes a kernel input named `name`."""
    name: str
    tensor: torch.Tensor


@dataclass
class Traced:
    expr: object                                   # a CuIR expression node
    captures: dict = field(default_factory=dict)   # name -> Capture
    uses: set = field(default_factory=set)         # which of b, h, iq, ik, s appear


class _Ctx:
    def __init__(self, fn):
        self.fn = fn
        self.captures: dict[int, Capture] = {}
        code = getattr(fn, "__code__", None)
        self.file = code.co_filename if code else None
        self.closure_names = {}
        if code is not None and fn.__closure__:
            for name, cell in zip(code.co_freevars, fn.__closure__):
                try:
                    self.closure_names[id(cell.cell_contents)] = name
                except ValueError:
                    pass
        globs = getattr(fn, "__globals__", {})
        for name, v in globs.items():
            if isinstance(v, torch.Tensor):
                self.closure_names.setdefault(id(v), name)

    def fail(self, what: str, hint: str):
        line, text = None, ""
        for fr in reversed(traceback.extract_stack()):
            if fr.filename == self.file:
                line, text = fr.lineno, (fr.line or "").strip()
                break
        where = f"{self.file}:{line}" if line else (self.file or None)
        raise TraceError(f"cannot trace {getattr(self.fn, '__name__', 'hook')}: {what}"
                         + (f" in `{text}`" if text else ""), where=where, hint=hint)

    def capture(self, t: torch.Tensor) -> str:
        c = self.captures.get(id(t))
        if c is None:
            base = self.closure_names.get(id(t), f"table{len(self.captures)}")
            c = Capture(base.upper(), t)
            self.captures[id(t)] = c
        return c.name


def _const(v):
    if isinstance(v, bool):
        return N.Const(v)
    if isinstance(v, int):
        return N.Const(v)
    if isinstance(v, float):
        if math.isinf(v):
            return N.Name("inf") if v > 0 else N.UnaryOp("-", N.Name("inf"))
        return N.Const(v)
    return None


class Sym:
    """A symbolic value inside a traced hook."""
    __slots__ = ("node", "ctx")

    def __init__(self, node, ctx: _Ctx):
        self.node, self.ctx = node, ctx

    # -------------------------------------------------------------- conversions
    def _lift(self, v):
        if isinstance(v, Sym):
            return v.node
        c = _const(v)
        if c is not None:
            return c
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            c = _const(v.item())
            if c is not None:
                return c
        self.ctx.fail(f"a {type(v).__name__} mixed with symbolic indices",
                      "use Python numbers, or index captured tensors with the symbolic indices")

    def _bin(self, op, other, reverse=False):
        a, b = self.node, self._lift(other)
        return Sym(N.BinOp(op, b, a) if reverse else N.BinOp(op, a, b), self.ctx)

    def _cmp(self, op, other):
        return Sym(N.Compare(op, self.node, self._lift(other)), self.ctx)

    def __bool__(self):
        self.ctx.fail("Python control flow (if / and / or / not / min / max) on a symbolic value",
                      "write it with tensor ops: torch.where(c, a, b), &, |, ~, torch.minimum")

    def __index__(self):
        self.ctx.fail("a symbolic value used as a Python index or size", "index captured tensors instead")

    __int__ = __float__ = __index__

    def __iter__(self):
        self.ctx.fail("iteration over a symbolic value", "hooks work elementwise; no loops")

    def __getattr__(self, name):
        if name in ("dtype", "device"):     # read by `.to(score.dtype)`; values do not matter here
            return torch.float32 if name == "dtype" else torch.device("cpu")
        if name in _METHODS:
            return lambda *a, **k: _METHODS[name](self, *a, **k)
        self.ctx.fail(f"attribute or method '.{name}'", f"supported methods: {', '.join(sorted(_METHODS))}")

    def __add__(self, o): return self._bin("+", o)
    def __radd__(self, o): return self._bin("+", o, True)
    def __sub__(self, o): return self._bin("-", o)
    def __rsub__(self, o): return self._bin("-", o, True)
    def __mul__(self, o): return self._bin("*", o)
    def __rmul__(self, o): return self._bin("*", o, True)
    def __truediv__(self, o): return self._bin("/", o)
    def __rtruediv__(self, o): return self._bin("/", o, True)
    def __floordiv__(self, o): return self._bin("//", o)
    def __rfloordiv__(self, o): return self._bin("//", o, True)
    def __mod__(self, o): return self._bin("%", o)
    def __rmod__(self, o): return self._bin("%", o, True)
    def __and__(self, o): return self._bin("&", o)
    def __rand__(self, o): return self._bin("&", o, True)
    def __or__(self, o): return self._bin("|", o)
    def __ror__(self, o): return self._bin("|", o, True)
    def __xor__(self, o): return self._bin("^", o)
    def __rxor__(self, o): return self._bin("^", o, True)
    def __lt__(self, o): return self._cmp("<", o)
    def __le__(self, o): return self._cmp("<=", o)
    def __gt__(self, o): return self._cmp(">", o)
    def __ge__(self, o): return self._cmp(">=", o)
    def __eq__(self, o): return self._cmp("==", o)       # noqa: elementwise, as in torch
    def __ne__(self, o): return self._cmp("!=", o)
    def __neg__(self): return Sym(N.UnaryOp("-", self.node), self.ctx)
    def __invert__(self): return Sym(N.UnaryOp("~", self.node), self.ctx)
    def __abs__(self): return _call("abs", self)
    def __pow__(self, o):
        if o == 2:
            return self * self
        self.ctx.fail("power other than 2", "write x * x, or exp / log")

    __hash__ = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ctx = next(a.ctx for a in _flat(args) if isinstance(a, Sym))
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__":
            return _gather(ctx, args[0], args[1])
        handler = _TORCH.get(name)
        if handler is None:
            ctx.fail(f"torch function {name}", f"supported: {', '.join(sorted(_TORCH))}")
        return handler(ctx, *args, **kwargs)


def _flat(args):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _flat(a)
        else:
            yield a


def _node(ctx, v):
    if isinstance(v, Sym):
        return v.node
    c = _const(v)
    if c is None and isinstance(v, torch.Tensor) and v.dim() == 0:
        c = _const(v.item())
    if c is None:
        ctx.fail(f"a {type(v).__name__} argument", "pass symbolic values or Python numbers")
    return c


def _call(op, *args):
    ctx = next(a.ctx for a in args if isinstance(a, Sym))
    return Sym(N.Call(op, tuple(_node(ctx, a) for a in args)), ctx)


def _gather(ctx, table, index):
    if not isinstance(table, torch.Tensor):
        ctx.fail("indexing a symbolic value", "only captured tensors can be indexed")
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) != table.dim():
        ctx.fail(f"a {table.dim()}-D captured tensor indexed with {len(idx)} indices",
                 "index every dim of a captured tensor")
    name = ctx.capture(table)
    return Sym(N.Call("gather", (N.Name(name),) + tuple(_node(ctx, i) for i in idx)), ctx)


def _where(ctx, c, a, b):
    return Sym(N.Call("where", (_node(ctx, c), _node(ctx, a), _node(ctx, b))), ctx)


def _clamp(ctx, x, min=None, max=None):
    out = x
    if min is not None:
        out = _call("maximum", out, min)
    if max is not None:
        out = _call("minimum", out, max)
    return out


def _unary(op):
    return lambda ctx, x, *a, **k: _call(op, x)


def _binary(op):
    return lambda ctx, a, b, *r, **k: _call(op, a, b)


def _identity(ctx, x, *a, **k):
    return x


def _logical(op):
    def fn(ctx, a, b=None, *r, **k):
        if op == "~":
            return Sym(N.UnaryOp("~", _node(ctx, a)), ctx)
        return Sym(N.BinOp(op, _node(ctx, a), _node(ctx, b)), ctx)
    return fn


def _arith(op, reverse=False):
    def fn(ctx, a, b, *r, **k):
        na, nb = _node(ctx, a), _node(ctx, b)
        return Sym(N.BinOp(op, nb, na) if reverse else N.BinOp(op, na, nb), ctx)
    return fn


_TORCH = {
    "where": _where, "clamp": _clamp, "clip": _clamp,
    "exp": _unary("exp"), "exp2": _unary("exp2"), "log": _unary("log"), "log2": _unary("log2"),
    "tanh": _unary("tanh"), "sigmoid": _unary("sigmoid"), "relu": _unary("relu"), "abs": _unary("abs"),
    "sqrt": _unary("sqrt"), "rsqrt": _unary("rsqrt"),
    "maximum": _binary("maximum"), "minimum": _binary("minimum"), "max": _binary("maximum"),
    "min": _binary("minimum"), "logical_and": _logical("&"), "logical_or": _logical("|"),
    "logical_not": _logical("~"), "bitwise_and": _logical("&"), "bitwise_or": _logical("|"),
    "bitwise_not": _logical("~"), "add": _arith("+"), "sub": _arith("-"), "mul": _arith("*"),
    "div": _arith("/"), "floor_divide": _arith("//"), "remainder": _arith("%"),
    "__add__": _arith("+"), "__radd__": _arith("+", True), "__sub__": _arith("-"),
    "__rsub__": _arith("-", True), "__mul__": _arith("*"), "__rmul__": _arith("*", True),
    "__truediv__": _arith("/"), "__rtruediv__": _arith("/", True), "__floordiv__": _arith("//"),
    "__rfloordiv__": _arith("//", True), "__mod__": _arith("%"), "__rmod__": _arith("%", True),
    "__and__": _logical("&"), "__or__": _logical("|"), "__rand__": _logical("&"),
    "__ror__": _logical("|"), "__lt__": lambda c, a, b: _cmp_t(c, "<", a, b),
    "__le__": lambda c, a, b: _cmp_t(c, "<=", a, b), "__gt__": lambda c, a, b: _cmp_t(c, ">", a, b),
    "__ge__": lambda c, a, b: _cmp_t(c, ">=", a, b), "__eq__": lambda c, a, b: _cmp_t(c, "==", a, b),
    "__ne__": lambda c, a, b: _cmp_t(c, "!=", a, b), "lt": lambda c, a, b: _cmp_t(c, "<", a, b),
    "le": lambda c, a, b: _cmp_t(c, "<=", a, b), "gt": lambda c, a, b: _cmp_t(c, ">", a, b),
    "ge": lambda c, a, b: _cmp_t(c, ">=", a, b), "eq": lambda c, a, b: _cmp_t(c, "==", a, b),
    "ne": lambda c, a, b: _cmp_t(c, "!=", a, b), "neg": lambda c, a: -a,
    "to": _identity, "float": _identity, "type_as": _identity, "contiguous": _identity,
}

_METHODS = {
    "to": lambda s, *a, **k: s, "float": lambda s: s, "type_as": lambda s, o: s,
    "tanh": lambda s: _call("tanh", s), "exp": lambda s: _call("exp", s), "log": lambda s: _call("log", s),
    "sigmoid": lambda s: _call("sigmoid", s), "relu": lambda s: _call("relu", s), "abs": lambda s: _call("abs", s),
    "clamp": lambda s, min=None, max=None: _clamp(s.ctx, s, min, max),
}


def _cmp_t(ctx, op, a, b):
    return Sym(N.Compare(op, _node(ctx, a), _node(ctx, b)), ctx)


def _uses(node) -> set[str]:
    return {e.id for e in N.walk_expr(node) if isinstance(e, N.Name)} & {B_NAME, H_NAME, Q_NAME, KV_NAME, SCORE_NAME}


def _run(fn, args_names):
    ctx = _Ctx(fn)
    syms = [Sym(N.Name(n), ctx) for n in args_names]
    try:
        out = fn(*syms)
    except TraceError:
        raise
    except CubridgeError:
        raise
    except Exception as e:  # the hook raised on a symbolic value: report where
        ctx.fail(f"{type(e).__name__}: {e}", "hooks must be elementwise torch code")
    node = out.node if isinstance(out, Sym) else _const(out if not isinstance(out, torch.Tensor) or out.dim() else out.item())
    if node is None:
        ctx.fail(f"the hook returned a {type(out).__name__}", "return a tensor expression of its arguments")
    return Traced(node, {c.name: c for c in ctx.captures.values()}, _uses(node))


def trace_mask(mask_mod) -> Traced:
    """mask_mod(b, h, q_idx, kv_idx) -> a boolean CuIR expression of b, h, iq, ik."""
    return _run(mask_mod, (B_NAME, H_NAME, Q_NAME, KV_NAME))


def trace_score(score_mod) -> Traced:
    """score_mod(score, b, h, q_idx, kv_idx) -> a CuIR expression of s, b, h, iq, ik."""
    return _run(score_mod, (SCORE_NAME, B_NAME, H_NAME, Q_NAME, KV_NAME))
