"""The name tables of the tracer: torch functions (torch.*, torch.nn.functional.*, Tensor dunders),
tensor methods, custom ops of a known meaning, and the nearest supported form of what is refused."""
from __future__ import annotations

import difflib

import torch

from cubridge.cuir import nodes as N
from cubridge.transfer import trace_ops as T
from cubridge.transfer.trace import BOOL, FLOAT, INT, Sym, register_ops

_SQRT1_2 = 0.7071067811865476          # 1 / sqrt(2), gelu's erf argument
_SQRT_2_PI = 0.7978845608028654        # sqrt(2 / pi), gelu's tanh form


def _fn(op):
    """A float function CuIR has as an op (exp, log, tanh, erf, ...)."""
    return lambda ctx, x, *a, **k: T.sym(ctx, N.Call(op, (T.val(ctx, x)[0],)), FLOAT)


def _bin(op):
    return lambda ctx, a, b, *r, **k: T.binary(ctx, op, a, b)


def _cmp(op):
    return lambda ctx, a, b, *r, **k: T.binary(ctx, op, a, b)


def _logical(op):
    def fn(ctx, a, b=None, *r, **k):
        a = T.sym(ctx, *T.as_bool(*T.val(ctx, a)))
        if op == "~":
            return T.invert(ctx, a)
        return T.binary(ctx, op, a, T.sym(ctx, *T.as_bool(*T.val(ctx, b))))
    return fn


def _minmax(op, reduction_name=None):
    def fn(ctx, a, b=None, *r, **k):
        if reduction_name and not isinstance(b, (Sym, torch.Tensor)):   # torch.max(x) / torch.max(x, dim)
            ctx.fail(f"torch.{reduction_name} of one value (a reduction)",
                     f"hooks are elementwise: torch.{op}(a, b)")
        (na, ka), (nb, kb) = T.as_int(*T.val(ctx, a)), T.as_int(*T.val(ctx, b))
        return T.sym(ctx, N.Call(op, (na, nb)), T.join_kinds(ka, kb))
    return fn


def clamp(ctx, x, min=None, max=None, **_):
    out = x
    if min is not None:
        out = _minmax("maximum")(ctx, out, min)
    if max is not None:
        out = _minmax("minimum")(ctx, out, max)
    return out


def _abs(ctx, x, *a, **k):
    n, kind = T.val(ctx, x)
    return x if kind == BOOL else T.sym(ctx, N.Call("abs", (n,)), kind)


def _relu(ctx, x, *a, **k):
    n, kind = T.val(ctx, x)
    if kind == INT:
        return T.sym(ctx, N.Call("maximum", (n, N.Const(0))), INT)
    return T.sym(ctx, N.Call("relu", (n,)), FLOAT)


def _sign(ctx, x, *a, **k):
    n, kind = T.val(ctx, x)
    if kind == BOOL:
        return x
    one, zero = (1, 0) if kind == INT else (1.0, 0.0)
    return T.where(ctx, T.binary(ctx, ">", x, 0), one, T.where(ctx, T.binary(ctx, "<", x, 0), -one, zero))


def _floor(ctx, x, *a, **k):
    n, kind = T.val(ctx, x)
    return x if kind != FLOAT else T.binary(ctx, "//", x, 1.0)     # float // 1 is floor, in both kernels


def _ceil(ctx, x, *a, **k):
    n, kind = T.val(ctx, x)
    return x if kind != FLOAT else T.negate(ctx, T.binary(ctx, "//", T.negate(ctx, x), 1.0))


def _trunc(ctx, x, *a, **k):
    n, kind = T.val(ctx, x)
    return x if kind != FLOAT else T.where(ctx, T.binary(ctx, ">=", x, 0.0), _floor(ctx, x), _ceil(ctx, x))


def _div(ctx, a, b, *r, rounding_mode=None, **k):
    if rounding_mode is None:
        return T.binary(ctx, "/", a, b)
    if rounding_mode == "floor":
        return T.binary(ctx, "//", a, b)
    if T.join_kinds(T.val(ctx, a)[1], T.val(ctx, b)[1]) == FLOAT:
        return _trunc(ctx, T.binary(ctx, "/", a, b))
    return _trunc_div_int(ctx, a, b)


def _trunc_div_int(ctx, a, b):
    """Integer division rounding toward zero: the floor quotient, plus one where the remainder is
    nonzero and the signs differ."""
    q = T.binary(ctx, "//", a, b)
    fix = T.binary(ctx, "&", T.binary(ctx, "!=", T.binary(ctx, "%", a, b), 0),
                   T.binary(ctx, "!=", T.binary(ctx, "<", a, 0), T.binary(ctx, "<", b, 0)))
    return T.where(ctx, fix, T.binary(ctx, "+", q, 1), q)


def _fmod(ctx, a, b, *r, **k):
    """C-style remainder (sign of the dividend): a - b * trunc(a / b)."""
    return T.binary(ctx, "-", a, T.binary(ctx, "*", b, _div(ctx, a, b, rounding_mode="trunc")))


def _log1p(ctx, x, *a, **k):
    return _fn("log")(ctx, T.binary(ctx, "+", 1.0, x))


def _expm1(ctx, x, *a, **k):
    return T.binary(ctx, "-", _fn("exp")(ctx, x), 1.0)


def _gelu(ctx, x, approximate="none", **k):
    if approximate == "tanh":       # traced as written: the tanh form, not the erf form
        inner = T.binary(ctx, "*", _SQRT_2_PI, T.binary(ctx, "+", x, T.binary(ctx, "*", 0.044715, x ** 3)))
        return T.binary(ctx, "*", T.binary(ctx, "*", 0.5, x), T.binary(ctx, "+", 1.0, _fn("tanh")(ctx, inner)))
    return T.binary(ctx, "*", T.binary(ctx, "*", 0.5, x),
                    T.binary(ctx, "+", 1.0, _fn("erf")(ctx, T.binary(ctx, "*", x, _SQRT1_2))))


def _silu(ctx, x, *a, **k):
    return T.binary(ctx, "*", x, _fn("sigmoid")(ctx, x))


def _softplus(ctx, x, beta=1.0, threshold=20.0, **k):
    bx = T.binary(ctx, "*", x, beta)
    soft = T.binary(ctx, "/", _log1p(ctx, _fn("exp")(ctx, bx)), beta)
    return T.where(ctx, T.binary(ctx, ">", bx, threshold), x, soft)


def _leaky_relu(ctx, x, negative_slope=0.01, *a, **k):
    return T.where(ctx, T.binary(ctx, ">=", x, 0), x, T.binary(ctx, "*", x, negative_slope))


def _to(ctx, x, *args, **kwargs):
    dt = T.dtype_of(args, kwargs)
    return x if dt is None else T.cast(ctx, x, dt)


def _cast_to(dtype):
    return lambda ctx, x, *a, **k: T.cast(ctx, x, dtype)


def _identity(ctx, x, *a, **k):
    return x


TORCH = {
    "where": lambda ctx, c, a, b: T.where(ctx, c, a, b),
    "clamp": clamp, "clip": clamp, "clamp_min": lambda ctx, x, m: clamp(ctx, x, min=m),
    "clamp_max": lambda ctx, x, m: clamp(ctx, x, max=m),
    "hardtanh": lambda ctx, x, min_val=-1.0, max_val=1.0, *a, **k: clamp(ctx, x, min_val, max_val),
    "relu6": lambda ctx, x, *a, **k: clamp(ctx, x, 0.0, 6.0),
    **{op: _fn(op) for op in ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "erf")},
    "abs": _abs, "absolute": _abs, "relu": _relu, "sign": _sign, "sgn": _sign, "floor": _floor, "ceil": _ceil,
    "trunc": _trunc, "fix": _trunc, "log1p": _log1p, "expm1": _expm1, "gelu": _gelu, "silu": _silu,
    "softplus": _softplus, "leaky_relu": _leaky_relu, "square": lambda ctx, x: T.binary(ctx, "*", x, x),
    "reciprocal": lambda ctx, x: T.binary(ctx, "/", 1.0, x),
    "log10": lambda ctx, x: T.binary(ctx, "*", _fn("log2")(ctx, x), 0.30102999566398120),
    "maximum": _minmax("maximum"), "minimum": _minmax("minimum"), "max": _minmax("maximum", "max"),
    "min": _minmax("minimum", "min"), "fmax": _minmax("maximum"), "fmin": _minmax("minimum"),
    "logical_and": _logical("&"), "logical_or": _logical("|"), "logical_xor": _logical("^"),
    "logical_not": _logical("~"), "bitwise_and": _bin("&"), "bitwise_or": _bin("|"), "bitwise_xor": _bin("^"),
    "bitwise_not": lambda ctx, x: T.invert(ctx, x), "bitwise_left_shift": _bin("<<"),
    "bitwise_right_shift": _bin(">>"), "add": _bin("+"), "sub": _bin("-"), "subtract": _bin("-"),
    "mul": _bin("*"), "multiply": _bin("*"), "div": _div, "divide": _div, "true_divide": _bin("/"),
    "floor_divide": _bin("//"), "remainder": _bin("%"), "fmod": _fmod, "pow": _bin("**"),
    "neg": lambda ctx, x: T.negate(ctx, x), "negative": lambda ctx, x: T.negate(ctx, x),
    "eq": _cmp("=="), "ne": _cmp("!="), "lt": _cmp("<"), "le": _cmp("<="), "gt": _cmp(">"), "ge": _cmp(">="),
    "not_equal": _cmp("!="), "less": _cmp("<"), "less_equal": _cmp("<="), "greater": _cmp(">"),
    "greater_equal": _cmp(">="), "zeros_like": T.like(0), "ones_like": T.like(1), "full_like": T.full_like,
    "new_ones": T.new(1), "new_zeros": T.new(0), "new_full": T.new_full,
    "to": _to, "type_as": lambda ctx, x, o: T.cast(ctx, x, o.dtype), "long": _cast_to(torch.int64),
    "int": _cast_to(torch.int32), "float": _cast_to(torch.float32), "double": _cast_to(torch.float64),
    "bool": _cast_to(torch.bool), "half": _cast_to(torch.float16), "bfloat16": _cast_to(torch.bfloat16),
    "contiguous": _identity, "detach": _identity, "clone": _identity, "squeeze": _identity,
}
METHOD_NAMES = sorted(TORCH)

_DUNDER = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
           "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>", "lt": "<", "le": "<=",
           "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}

# Custom ops whose meaning is a function above, traced as that function with a note: attention-gym's
# `approx::tanh` is torch.tanh in eager mode and tanh.approx.f32 when compiled; cubridge's kernels
# evaluate every tanh with tanh.approx.f32 (relative error about 2^-11) and verify against exact tanh.
_CUSTOM = {"tanh": "tanh", "exp": "exp", "exp2": "exp2", "sigmoid": "sigmoid", "log": "log"}

# Functions with no traced form, and what to write instead.
_INSTEAD = {
    "round": "torch.floor(x + 0.5) (ties round up there; torch.round rounds them to even)",
    "erfc": "1 - torch.erf(x)", "cos": "a captured table of cos values indexed by q_idx / kv_idx",
    "sin": "a captured table of sin values indexed by q_idx / kv_idx", "atan": "a captured table",
    "isin": "a comparison chain (x == a) | (x == b), or a captured boolean table indexed by x",
    "arange": "q_idx / kv_idx themselves (hooks are elementwise)",
    "tensor": "a Python number, or a captured tensor indexed by the symbolic indices",
}


def nearest(name, names, what="functions"):
    if name in _INSTEAD:
        return f"write {_INSTEAD[name]}"
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return (f"nearest supported: {', '.join(close)}; " if close else "") + \
        f"supported {what}: {', '.join(names)}"


def call_torch(ctx, name, args, kwargs):
    handler = TORCH.get(name)
    if handler is None:
        ctx.fail(f"torch function {name}", nearest(name, METHOD_NAMES))
    return handler(ctx, *args, **kwargs)


def method(name):
    handler = TORCH.get(name)
    return None if handler is None else handler


def torch_function(ctx, func, args, kwargs):
    name = getattr(func, "__name__", str(func))
    if name == "__getitem__":
        items = args[1] if isinstance(args[1], tuple) else (args[1],)
        return T.index(ctx, args[0], items)
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _custom_op(ctx, func, args, kwargs)
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        reverse = core.startswith("r") and core[1:] in _DUNDER
        op = _DUNDER.get(core[1:] if reverse else core)
        if op is not None:
            a, b = args[0], args[1]
            return T.binary(ctx, op, b, a) if reverse else T.binary(ctx, op, a, b)
        if core in ("neg", "invert", "abs"):
            return {"neg": T.negate, "invert": T.invert, "abs": _abs}[core](ctx, args[0])
    return call_torch(ctx, name, args, kwargs)


def _custom_op(ctx, func, args, kwargs):
    full = str(func)                                  # e.g. approx.tanh.default
    ns, base = full.split(".")[0], full.split(".")[1]
    if ns == "aten":
        return call_torch(ctx, base, args, kwargs)
    if base in _CUSTOM:
        ctx.note(f"custom op {ns}::{base} traced as exact {_CUSTOM[base]} (the kernels evaluate tanh with "
                 "tanh.approx.f32 and verify against exact tanh)")
        return call_torch(ctx, _CUSTOM[base], args, kwargs)
    ctx.fail(f"custom op {ns}::{base}", "write it with torch functions the tracer takes: "
             + ", ".join(METHOD_NAMES))


register_ops(binary=T.binary, negate=T.negate, invert=T.invert, call_torch=call_torch, method=method,
             nearest=nearest, method_names=tuple(METHOD_NAMES), torch_function=torch_function, partial=T.Partial)
