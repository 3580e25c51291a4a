"""The torch functions, tensor methods and operators the tracer takes, each as CuIR with exact
element kinds (see trace.py). Forms with no CuIR op of their own are written with the ops there
are: sign and floor with `where` and `//`, a constant shift as `*` / `//` by a power of two (an
arithmetic shift floors, as `//` does), gelu with erf (exact) or its tanh form (as written),
log1p as log(1 + x) (within fp32 rounding of 1 + x, far below a 16-bit P's).
"""
from __future__ import annotations

import torch

from cubridge.cuir import nodes as N
from cubridge.transfer.trace import BOOL, FLOAT, INT, OPS, Sym, const

_NUM_OPS = {"+", "-", "*", "/", "//", "%", "**"}
_BIT_OPS = {"&", "|", "^"}
_CMP_OPS = {"<", "<=", ">", ">=", "==", "!="}
_SHIFT_OPS = {"<<", ">>"}


# ------------------------------------------------------------------ values
def val(ctx, v):
    """(node, kind) of a symbolic value or a number; anything else is refused."""
    if isinstance(v, Sym):
        return v.node, v.kind
    if isinstance(v, Partial):
        v.incomplete()
    c = const(v)
    if c is None:
        what = f"a {tuple(v.shape)} tensor" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
        ctx.fail(f"{what} mixed with symbolic values",
                 "use Python numbers, or index captured tensors with the symbolic indices (table[q_idx])")
    return c


def sym(ctx, node, kind):
    return Sym(node, ctx, kind)


def _num(v):
    return v.value if isinstance(v, N.Const) and not isinstance(v.value, bool) else None


def as_int(node, kind):
    """A boolean used as a number is 0 / 1 (torch promotes it so)."""
    return (N.Call("cast", (node, N.Name("i32"))), INT) if kind == BOOL else (node, kind)


def as_bool(node, kind):
    return (node, BOOL) if kind == BOOL else (N.Compare("!=", node, N.Const(0)), BOOL)


def join_kinds(*kinds):
    return FLOAT if FLOAT in kinds else BOOL if all(k == BOOL for k in kinds) else INT


def _fold(op, a, b):
    """Fold an operation on two constants the way torch computes it (None: leave it)."""
    if not (isinstance(a, N.Const) and isinstance(b, N.Const)):
        return None
    x, y = a.value, b.value
    try:
        v = {"+": lambda: x + y, "-": lambda: x - y, "*": lambda: x * y, "/": lambda: x / y,
             "//": lambda: x // y, "%": lambda: x % y, "&": lambda: x & y, "|": lambda: x | y,
             "^": lambda: x ^ y, "<": lambda: x < y, "<=": lambda: x <= y, ">": lambda: x > y,
             ">=": lambda: x >= y, "==": lambda: x == y, "!=": lambda: x != y}[op]()
    except (ZeroDivisionError, TypeError, KeyError):
        return None
    return N.Const(v)


# ------------------------------------------------------------------ operators
def binary(ctx, op, a, b):
    (na, ka), (nb, kb) = val(ctx, a), val(ctx, b)
    if op in _CMP_OPS:
        return sym(ctx, _fold(op, na, nb) or N.Compare(op, na, nb), BOOL)
    if op in _BIT_OPS:
        return _bitwise(ctx, op, na, ka, nb, kb)
    if op in _SHIFT_OPS:
        return _shift(ctx, op, na, ka, nb, kb)
    if op == "**":
        return _power(ctx, a, b, nb)
    (na, ka), (nb, kb) = as_int(na, ka), as_int(nb, kb)
    kind = FLOAT if op == "/" else join_kinds(ka, kb)
    folded = _fold(op, na, nb)
    if folded is not None and not (op == "/" and isinstance(folded.value, int)):
        return sym(ctx, folded, kind)
    return sym(ctx, N.BinOp(op, na, nb), kind)


def _bitwise(ctx, op, na, ka, nb, kb):
    if FLOAT in (ka, kb):
        ctx.fail(f"bitwise '{op}' on a float value", "compare first (x > 0) or cast to an integer (x.long())")
    if ka == kb == BOOL:
        for x, y in ((na, nb), (nb, na)):       # identities of and_masks / or_masks' seeds
            if isinstance(x, N.Const) and x.value is (op == "&") and op in ("&", "|"):
                return sym(ctx, y, BOOL)
            if isinstance(x, N.Const) and x.value is False and op == "^":
                return sym(ctx, y, BOOL)
        return sym(ctx, _fold(op, na, nb) or N.BinOp(op, na, nb), BOOL)
    (na, _), (nb, _) = as_int(na, ka), as_int(nb, kb)
    return sym(ctx, _fold(op, na, nb) or N.BinOp(op, na, nb), INT)


def _shift(ctx, op, na, ka, nb, kb):
    """A constant shift is a multiply / floor division by a power of two (which the interval
    analysis reads); a shift by a symbolic amount stays a shift (arithmetic, as torch's)."""
    if FLOAT in (ka, kb):
        ctx.fail(f"shift '{op}' of a float value", "shift integers; cast first with .long()")
    (na, _), (nb, _) = as_int(na, ka), as_int(nb, kb)
    k = _num(nb)
    if k is None:
        return sym(ctx, _fold(op, na, nb) or N.BinOp(op, na, nb), INT)
    if not 0 <= k < 31:
        ctx.fail(f"shift '{op}' by {k}", "shift 32-bit integers by 0..30")
    mul = "*" if op == "<<" else "//"
    return sym(ctx, _fold(mul, na, N.Const(1 << k)) or N.BinOp(mul, na, N.Const(1 << k)), INT)


def _power(ctx, a, b, nb):
    e = _num(nb)
    if isinstance(e, (int, float)) and float(e).is_integer() and 1 <= e <= 4:
        out = a
        for _ in range(int(e) - 1):
            out = binary(ctx, "*", out, a)
        return out
    if e == 0.5:
        return OPS.call_torch(ctx, "sqrt", (a,), {})
    if e == -0.5:
        return OPS.call_torch(ctx, "rsqrt", (a,), {})
    if e == -1:
        return binary(ctx, "/", 1.0, a)
    ctx.fail(f"power {('x ** ' + repr(e)) if e is not None else 'with a symbolic exponent'}",
             "integer powers 1..4, 0.5, -0.5 and -1 are traced; otherwise torch.exp(y * torch.log(x)) for x > 0")


def negate(ctx, x):
    n, k = val(ctx, x)
    if k == BOOL:
        ctx.fail("negation of a boolean", "use ~ (logical not)")
    if isinstance(n, N.Const):
        return sym(ctx, N.Const(-n.value), k)
    return sym(ctx, N.UnaryOp("-", n), k)


def invert(ctx, x):
    n, k = val(ctx, x)
    if k == BOOL:
        if isinstance(n, N.Const):
            return sym(ctx, N.Const(not n.value), BOOL)
        return sym(ctx, N.UnaryOp("~", n), BOOL)
    if k == INT:                         # two's complement: ~x == -x - 1
        return binary(ctx, "-", negate(ctx, x), 1)
    ctx.fail("~ of a float value", "~ is logical not on booleans and bitwise not on integers")


def where(ctx, c, a, b):
    nc, _ = as_bool(*val(ctx, c))
    (na, ka), (nb, kb) = val(ctx, a), val(ctx, b)
    if isinstance(nc, N.Const):
        return sym(ctx, na if nc.value else nb, ka if nc.value else kb)
    if ka == kb == BOOL:                 # boolean select as logic (what the mask code expects)
        c_, a_, b_ = (sym(ctx, n, BOOL) for n in (nc, na, nb))
        return binary(ctx, "|", binary(ctx, "&", c_, a_), binary(ctx, "&", invert(ctx, c_), b_))
    (na, ka), (nb, kb) = as_int(na, ka), as_int(nb, kb)
    return sym(ctx, N.Call("where", (nc, na, nb)), join_kinds(ka, kb))


# ------------------------------------------------------------------ captured tensors
class Partial:
    """A captured tensor indexed with fewer indices than it has dims (`table[b]` of `table[b][q]`)."""

    def __init__(self, ctx, table: torch.Tensor, index: tuple):
        self.ctx, self.table, self.index = ctx, table, index

    def __getitem__(self, more):
        return index(self.ctx, self.table, self.index + (more if isinstance(more, tuple) else (more,)))

    def incomplete(self):
        self.ctx.fail(f"a {self.table.dim()}-D captured tensor used after {len(self.index)} of its "
                      f"{self.table.dim()} indices", "index every dim before computing with it: "
                      "table[b, h, q_idx] or table[b][h][q_idx]")

    def __getattr__(self, name):
        self.incomplete()

    def __bool__(self):
        self.incomplete()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        p = next(a for a in args if isinstance(a, Partial))
        p.incomplete()


def index(ctx, table, items: tuple):
    """table[items...]: a gather once every dim is indexed, a Partial before."""
    if not isinstance(table, torch.Tensor):
        ctx.fail("indexing a symbolic value", "only captured tensors can be indexed")
    if len(items) > table.dim():
        ctx.fail(f"a {table.dim()}-D captured tensor indexed with {len(items)} indices",
                 "index each dim once")
    nodes = []
    for d, i in enumerate(items):
        if isinstance(i, (slice, type(None), type(Ellipsis))) or isinstance(i, Partial):
            ctx.fail(f"index {d} of a captured tensor is a {type(i).__name__}",
                     "index captured tensors with integers or integer expressions of b, h, q_idx, kv_idx")
        n, k = val(ctx, i)
        if k == FLOAT:
            ctx.fail(f"index {d} of a captured tensor is a float expression",
                     "cast it to an integer first: idx.long() (truncates, as torch does)")
        if isinstance(n, N.Const) and isinstance(n.value, int) and n.value < 0:
            n = N.Const(n.value + table.shape[d])       # a constant negative index counts from the end
        nodes.append(as_int(n, k)[0])
    if len(items) < table.dim():
        return Partial(ctx, table, tuple(items))
    name = ctx.capture(table)
    g = N.Call("gather", (N.Name(name),) + tuple(nodes))
    if table.dtype == torch.bool:        # bound as 0 / 1 integers: read back as a boolean
        return sym(ctx, N.Compare("!=", g, N.Const(0)), BOOL)
    return sym(ctx, g, FLOAT if table.is_floating_point() else INT)


# ------------------------------------------------------------------ casts and constants
_INT_DT = {torch.int32, torch.int64}
_NARROW_DT = {torch.int8, torch.uint8, torch.int16}
_FLOAT_DT = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def cast(ctx, x, dtype):
    n, k = val(ctx, x)
    if dtype == torch.bool:
        return sym(ctx, *as_bool(n, k))
    if dtype in _INT_DT:
        if k == INT:
            return sym(ctx, n, INT)
        if isinstance(n, N.Const):
            return sym(ctx, N.Const(int(n.value)), INT)
        return sym(ctx, N.Call("cast", (n, N.Name("i32"))), INT)    # truncates toward zero
    if dtype in _FLOAT_DT:
        if dtype in (torch.float16, torch.bfloat16):
            ctx.note(f"the cast to {dtype} is traced without its rounding (scores stay fp32 in registers)")
        if k == FLOAT:
            return sym(ctx, n, FLOAT)
        if isinstance(n, N.Const):
            return sym(ctx, N.Const(float(n.value)), FLOAT)
        return sym(ctx, N.Call("cast", (n, N.Name("f32"))), FLOAT)
    if dtype in _NARROW_DT:
        ctx.fail(f"a cast to {dtype} (it wraps around)", "cast to torch.int32 / torch.int64 (.int() / .long())")
    ctx.fail(f"a cast to {dtype}", "cast to torch.bool, torch.int64 or torch.float32")


def dtype_of(args, kwargs):
    """The dtype a .to(...) call asks for (None: only a device or copy flags)."""
    for a in list(args) + [kwargs.get("dtype")]:
        if isinstance(a, torch.dtype):
            return a
        if isinstance(a, (Sym, torch.Tensor)):
            return a.dtype
    return None


def _scalar_size(ctx, size, what):
    if size in ((), [], torch.Size([]), None):
        return
    ctx.fail(f"{what} with shape {tuple(size) if isinstance(size, (tuple, list)) else size}",
             "hooks are elementwise: create scalars, e.g. b.new_ones((), dtype=torch.bool)")


def _filled(ctx, like, value, dtype):
    kind = {torch.bool: BOOL}.get(dtype, INT if dtype in _INT_DT else FLOAT if dtype in _FLOAT_DT
                                  else (like.kind if isinstance(like, Sym) else FLOAT))
    v = bool(value) if kind == BOOL else int(value) if kind == INT else float(value)
    return sym(ctx, const(v)[0], kind)


def new_full(ctx, self, size=(), fill_value=0, *, dtype=None, **_):
    _scalar_size(ctx, size, "new_full")
    return _filled(ctx, self, fill_value, dtype)


def full_like(ctx, x, fill_value, *, dtype=None, **_):
    return _filled(ctx, x, fill_value, dtype)


def new(fill):
    def fn(ctx, self, *size, dtype=None, size_kw=None, **kw):
        size = kw.pop("size", size[0] if len(size) == 1 else tuple(size))
        _scalar_size(ctx, size, "new_ones" if fill else "new_zeros")
        return _filled(ctx, self, fill, dtype)
    return fn


def like(fill):
    return lambda ctx, x, *, dtype=None, **_: _filled(ctx, x, fill, dtype)

