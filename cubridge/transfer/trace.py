"""Symbolic tracing of FlexAttention-style mods into CuIR expressions.

`trace_mask(mask_mod)` and `trace_score(score_mod)` call the user's function with symbolic
stand-ins for b, h, q_idx, kv_idx (and score). Each stand-in carries its element kind exactly as
torch would type it (b, h, q_idx, kv_idx: int; score: float; comparisons: bool), so integer
arithmetic stays integer (`//` and `%` floor as torch defines them for negatives), a cast to an
integer truncates, and a boolean stays boolean. Python operators and the torch functions of
`trace_ops` build CuIR expression nodes; reading a captured tensor with symbolic indices (all at
once, `t[b, q_idx]`, or step by step, `t[b][q_idx]`) becomes a `gather` from a new kernel input.
Anything else (Python control flow on a symbolic value, an unsupported torch function, a method we
do not know) is a TraceError naming the line of the user's function, the construct and the
nearest supported form. Where a form is traced as something not bit-identical to what the author
wrote (a custom `approx::tanh` op traced as exact tanh), `Traced.notes` says so.

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
BOOL, INT, FLOAT = "bool", "int", "float"


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
    kind: str = FLOAT                              # bool, int or float
    notes: list = field(default_factory=list)      # forms traced as something not bit-identical


class _Ctx:
    def __init__(self, fn):
        self.fn = fn
        self.captures: dict[int, Capture] = {}
        self.notes: list[str] = []
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

    def where(self) -> tuple[str | None, str]:
        """The innermost frame of user code (the hook's file, or any file but torch's and ours)."""
        frames = [fr for fr in traceback.extract_stack() if not _internal(fr.filename)]
        for fr in reversed(frames):
            if fr.filename == self.file:
                return f"{fr.filename}:{fr.lineno}", (fr.line or "").strip()
        if frames:
            fr = frames[-1]
            return f"{fr.filename}:{fr.lineno}", (fr.line or "").strip()
        return self.file, ""

    def fail(self, what: str, hint: str):
        where, text = self.where()
        raise TraceError(f"cannot trace {getattr(self.fn, '__name__', 'hook')}: {what}"
                         + (f" in `{text}`" if text else ""), where=where, hint=hint)

    def note(self, what: str):
        where, text = self.where()
        msg = f"{where}: {what}" + (f" (`{text}`)" if text else "")
        if msg not in self.notes:
            self.notes.append(msg)

    def capture(self, t: torch.Tensor) -> str:
        c = self.captures.get(id(t))
        if c is None:
            base = self.closure_names.get(id(t), f"table{len(self.captures)}")
            c = Capture(base.upper(), t)
            self.captures[id(t)] = c
        return c.name


def _internal(filename: str) -> bool:
    return ("/torch/" in filename or filename.endswith(("/transfer/trace.py", "/transfer/trace_ops.py"))
            or filename.startswith("<frozen"))


class OpTable:
    """The tracer's operators (trace_ops, trace_table), which build Syms: those modules register
    them here when cubridge.transfer is imported, so Sym dispatches through this table and
    trace.py imports neither (no import cycle)."""
    binary = negate = invert = call_torch = method = nearest = torch_function = None
    method_names: tuple = ()
    partial: type = type(None)         # trace_ops.Partial: a captured tensor not indexed fully yet


OPS = OpTable()


def register_ops(**ops) -> None:
    """Set the operator table (trace_table does, once, at import)."""
    for name, fn in ops.items():
        if not hasattr(OpTable, name):
            raise TypeError(f"the tracer has no operator slot {name!r}")
        setattr(OPS, name, fn)


def const(v):
    """(CuIR constant node, kind) of a Python or 0-d tensor value, or None."""
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        v = v.item()
    if isinstance(v, bool):
        return N.Const(v), BOOL
    if isinstance(v, int):
        return N.Const(v), INT
    if isinstance(v, float):
        if math.isinf(v):
            return (N.Name("inf") if v > 0 else N.UnaryOp("-", N.Name("inf"))), FLOAT
        return N.Const(v), FLOAT
    return None


class Sym:
    """A symbolic value inside a traced hook: a CuIR node and its element kind."""
    __slots__ = ("node", "ctx", "kind")

    def __init__(self, node, ctx: _Ctx, kind: str):
        self.node, self.ctx, self.kind = node, ctx, kind

    def __bool__(self):
        self.ctx.fail("Python control flow (if / and / or / not / min / max) on a symbolic value",
                      "write it with tensor ops: torch.where(c, a, b), &, |, ~, torch.minimum")

    def __index__(self):
        self.ctx.fail("a symbolic value used as a Python index or size",
                      "index captured tensors with it (table[q_idx]), or compute with torch ops")

    __int__ = __float__ = __index__

    def __iter__(self):
        self.ctx.fail("iteration over a symbolic value", "hooks work elementwise; no loops")

    def __len__(self):
        self.ctx.fail("len() of a symbolic value", "hooks work elementwise on scalars")

    def __getitem__(self, index):
        self.ctx.fail("indexing a symbolic value", "only captured tensors can be indexed")

    def __getattr__(self, name):
        if name == "dtype":
            return {BOOL: torch.bool, INT: torch.int64, FLOAT: torch.float32}[self.kind]
        if name == "device":
            return torch.device("cpu")
        if name in ("shape",):
            return torch.Size([])
        method = OPS.method(name)
        if method is not None:
            return lambda *a, **k: method(self.ctx, self, *a, **k)
        self.ctx.fail(f"attribute or method '.{name}'", OPS.nearest(name, OPS.method_names, "methods"))

    def size(self, *a):
        return torch.Size([])

    def dim(self):
        return 0

    def _op(self, name, other, reverse=False):
        a, b = (other, self) if reverse else (self, other)
        return OPS.binary(self.ctx, name, a, b)

    def __add__(self, o): return self._op("+", o)
    def __radd__(self, o): return self._op("+", o, True)
    def __sub__(self, o): return self._op("-", o)
    def __rsub__(self, o): return self._op("-", o, True)
    def __mul__(self, o): return self._op("*", o)
    def __rmul__(self, o): return self._op("*", o, True)
    def __truediv__(self, o): return self._op("/", o)
    def __rtruediv__(self, o): return self._op("/", o, True)
    def __floordiv__(self, o): return self._op("//", o)
    def __rfloordiv__(self, o): return self._op("//", o, True)
    def __mod__(self, o): return self._op("%", o)
    def __rmod__(self, o): return self._op("%", o, True)
    def __and__(self, o): return self._op("&", o)
    def __rand__(self, o): return self._op("&", o, True)
    def __or__(self, o): return self._op("|", o)
    def __ror__(self, o): return self._op("|", o, True)
    def __xor__(self, o): return self._op("^", o)
    def __rxor__(self, o): return self._op("^", o, True)
    def __lshift__(self, o): return self._op("<<", o)
    def __rlshift__(self, o): return self._op("<<", o, True)
    def __rshift__(self, o): return self._op(">>", o)
    def __rrshift__(self, o): return self._op(">>", o, True)
    def __lt__(self, o): return self._op("<", o)
    def __le__(self, o): return self._op("<=", o)
    def __gt__(self, o): return self._op(">", o)
    def __ge__(self, o): return self._op(">=", o)
    def __eq__(self, o): return self._op("==", o)       # noqa: elementwise, as in torch
    def __ne__(self, o): return self._op("!=", o)
    def __pow__(self, o): return self._op("**", o)
    def __rpow__(self, o): return self._op("**", o, True)

    def __neg__(self):
        return OPS.negate(self.ctx, self)

    def __pos__(self):
        return self

    def __invert__(self):
        return OPS.invert(self.ctx, self)

    def __abs__(self):
        return OPS.call_torch(self.ctx, "abs", (self,), {})

    __hash__ = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        ctx = next(a.ctx for a in _flat(args, kwargs) if isinstance(a, (Sym, OPS.partial)))
        return OPS.torch_function(ctx, func, args, kwargs or {})


def _flat(args, kwargs=None):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (tuple, list)):
            yield from _flat(a)
        else:
            yield a


def _uses(node) -> set[str]:
    return {e.id for e in N.walk_expr(node) if isinstance(e, N.Name)} & {B_NAME, H_NAME, Q_NAME, KV_NAME, SCORE_NAME}


def _run(fn, args, want: str):
    ctx = _Ctx(fn)
    syms = [Sym(N.Name(n), ctx, k) for n, k in args]
    try:
        out = fn(*syms)
    except CubridgeError:
        raise
    except Exception as e:  # the hook raised on a symbolic value: report where
        ctx.fail(f"{type(e).__name__}: {e}", "hooks must be elementwise torch code")
    if isinstance(out, OPS.partial):
        out.incomplete()
    if isinstance(out, Sym):
        node, kind = out.node, out.kind
    else:
        c = const(out) if isinstance(out, (bool, int, float, torch.Tensor)) else None
        if c is None:
            ctx.fail(f"the hook returned a {type(out).__name__}", "return a tensor expression of its arguments")
        node, kind = c
    if want == BOOL and kind != BOOL:
        ctx.fail(f"the mask_mod returned a{'n' if kind == INT else ''} {kind} value",
                 "a mask_mod returns a boolean: compare it, e.g. `x != 0`")
    if want == FLOAT and kind == BOOL:
        ctx.fail("the score_mod returned a boolean", "a score_mod returns the (modified) score")
    return Traced(node, {c.name: c for c in ctx.captures.values()}, _uses(node), kind, list(ctx.notes))


def trace_mask(mask_mod) -> Traced:
    """mask_mod(b, h, q_idx, kv_idx) -> a boolean CuIR expression of b, h, iq, ik."""
    return _run(mask_mod, ((B_NAME, INT), (H_NAME, INT), (Q_NAME, INT), (KV_NAME, INT)), BOOL)


def trace_score(score_mod) -> Traced:
    """score_mod(score, b, h, q_idx, kv_idx) -> a CuIR expression of s, b, h, iq, ik."""
    return _run(score_mod, ((SCORE_NAME, FLOAT), (B_NAME, INT), (H_NAME, INT), (Q_NAME, INT), (KV_NAME, INT)),
                FLOAT)
