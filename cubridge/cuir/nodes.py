"""CuIR node types: a small enumerated op set and typed, frozen nodes.

A CuIR program is a restricted-Python text (see `parser.py`); these are the nodes it parses into.
Every node carries the source line it came from (`line`, excluded from equality so that a printed
and re-parsed program compares equal to the original).

Nothing here has behaviour: the interpreter (`interp.py`) defines what each op means.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Union


class Kind(Enum):
    DECL = "declaration"        # kernel header, params, global tensors, grid, smem, barriers
    MEMORY = "memory"           # copies between global, shared and registers
    SYNC = "synchronisation"    # barrier wait / arrive, async-copy groups
    COMPUTE = "compute"         # matrix multiply-accumulate
    ELEMENTWISE = "elementwise"
    REDUCE = "reduction"
    TILE = "tile"               # tile constructors and views
    SCALAR = "scalar"           # index arithmetic helpers


@dataclass(frozen=True)
class OpSpec:
    """Signature of one op: positional parameter names (a trailing '?' marks optional ones) and
    the keyword arguments it accepts. `stmt` ops return nothing and stand alone as statements."""
    kind: Kind
    params: tuple[str, ...]
    kwargs: tuple[str, ...] = ()
    stmt: bool = False
    doc: str = ""

    @property
    def min_args(self) -> int:
        return sum(1 for p in self.params if not p.endswith("?") and not p.startswith("*"))

    @property
    def max_args(self) -> int | None:
        return None if any(p.startswith("*") for p in self.params) else len(self.params)


def _op(kind, params, kwargs=(), stmt=False, doc=""):
    return OpSpec(kind, tuple(params.split()) if params else (), tuple(kwargs), stmt, doc)


# The whole op set. Adding an op means: an entry here, its meaning in interp.py, its rule in
# checker.py. Keep it small.
OPS: dict[str, OpSpec] = {
    # declarations
    "kernel": _op(Kind.DECL, "name", ("arch",), True, "program header"),
    "param": _op(Kind.DECL, "", (), True, "compile-time parameters with defaults: param(BLOCK_M=128)"),
    "global_input": _op(Kind.DECL, "dtype shape", (), False, "a kernel input in global memory"),
    "global_output": _op(Kind.DECL, "dtype shape", (), False, "a kernel output in global memory"),
    "scalar_input": _op(Kind.DECL, "dtype", (), False, "a scalar kernel argument (e.g. a variant's shape-dependent constant)"),
    "grid": _op(Kind.DECL, "*extents", (), False, "block indices: m, h, b = grid(M, H, B)"),
    "smem": _op(Kind.DECL, "dtype shape", (), False, "a shared-memory buffer"),
    "mbarrier": _op(Kind.DECL, "", ("count", "n"), False, "shared-memory barrier(s): count arrivals per phase"),
    # tiles in registers
    "zeros": _op(Kind.TILE, "dtype shape", (), False, "register tile of zeros"),
    "full": _op(Kind.TILE, "dtype shape value", (), False, "register tile filled with value"),
    "row_index": _op(Kind.TILE, "start n", (), False, "[n, 1] int tile start + arange(n)"),
    "col_index": _op(Kind.TILE, "start n", (), False, "[1, n] int tile start + arange(n)"),
    "transpose": _op(Kind.TILE, "x", (), False, "view of a 2-D tile with its dims swapped"),
    "cast": _op(Kind.ELEMENTWISE, "x dtype", (), False, "round to dtype"),
    # memory movement
    "load": _op(Kind.MEMORY, "src", (), False, "synchronous load of a global or shared tile into registers"),
    "store": _op(Kind.MEMORY, "dst value", (), True, "synchronous store of a register tile"),
    "copy_async": _op(Kind.MEMORY, "dst src", (), True, "cp.async global -> shared, completes at wait_group"),
    "commit_group": _op(Kind.SYNC, "", (), True, "close the current cp.async group"),
    "wait_group": _op(Kind.SYNC, "n", (), True, "wait until at most n cp.async groups are pending"),
    "tma_load": _op(Kind.MEMORY, "dst src barrier", (), True, "bulk tensor copy; one arrival on barrier when it lands"),
    "gather": _op(Kind.MEMORY, "table *indices", (), False,
                  "elementwise read of a global tensor at index tiles, each index clamped into range"),
    # synchronisation
    "arrive": _op(Kind.SYNC, "barrier", (), True, "arrive on an mbarrier"),
    "wait": _op(Kind.SYNC, "barrier parity", (), True, "wait until the phase of that parity completed"),
    "bar_sync": _op(Kind.SYNC, "barrier", (), True,
                    "arrive and wait for that phase to complete (a named barrier: bar.sync)"),
    "sync": _op(Kind.SYNC, "", (), True, "barrier among the warps of this role"),
    # compute
    "mma": _op(Kind.COMPUTE, "a b acc?", (), False, "a @ b (+ acc), operands in 16 bits, fp32 accumulate"),
    "mma_async": _op(Kind.COMPUTE, "a b acc?", (), False, "asynchronous mma (wgmma); result usable after mma_wait"),
    "mma_wait": _op(Kind.SYNC, "n", (), True, "wait until at most n mma_async are pending"),
    # elementwise math (fp32 in registers)
    "exp": _op(Kind.ELEMENTWISE, "x"), "exp2": _op(Kind.ELEMENTWISE, "x"),
    "log": _op(Kind.ELEMENTWISE, "x"), "log2": _op(Kind.ELEMENTWISE, "x"),
    "tanh": _op(Kind.ELEMENTWISE, "x"), "sigmoid": _op(Kind.ELEMENTWISE, "x"),
    "relu": _op(Kind.ELEMENTWISE, "x"), "abs": _op(Kind.ELEMENTWISE, "x"),
    "sqrt": _op(Kind.ELEMENTWISE, "x"), "rsqrt": _op(Kind.ELEMENTWISE, "x"),
    "erf": _op(Kind.ELEMENTWISE, "x"),
    "maximum": _op(Kind.ELEMENTWISE, "a b"), "minimum": _op(Kind.ELEMENTWISE, "a b"),
    "where": _op(Kind.ELEMENTWISE, "cond a b"),
    # row reductions: [M, N] -> [M, 1]
    "row_max": _op(Kind.REDUCE, "x"), "row_sum": _op(Kind.REDUCE, "x"),
    # scalar helpers (uniform integers)
    "cdiv": _op(Kind.SCALAR, "a b"), "min": _op(Kind.SCALAR, "a b"), "max": _op(Kind.SCALAR, "a b"),
}

# Names with a fixed meaning in every program.
DTYPES = ("f32", "f16", "bf16", "i32", "T")      # T: the kernel's 16-bit dtype, bound at run time
CONSTANTS = {"inf": float("inf"), "LOG2E": 1.4426950408889634, "LN2": 0.6931471805599453}
CONTEXTS = ("role", "region")                     # the two `with` forms
REGIONS = ("head_map", "kv_range", "load_q", "load_kv", "qk", "score", "mask", "softmax", "pv",
           "epilogue")
# Regions of a CUDA kernel that CuIR expresses without a `with region(...)` block: extra_io is the
# program header's extra declarations (global_input / scalar_input beyond Q, K, V).
CUDA_ONLY_REGIONS = ("extra_io",)
# Regions of the backward programs (ref_kernels/fa2_bwd_sm80/*.cuir): the query tiles per KV tile,
# the normalisation's backward (P from LSE, dS), and the three gradient GEMMs. Kept apart from
# REGIONS, which is the forward lifting vocabulary the LLM prompts list.
BACKWARD_REGIONS = ("q_range", "softmax_bwd", "dv", "dk", "dq")
ALL_REGIONS = REGIONS + BACKWARD_REGIONS


# ---------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Name:
    id: str
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Const:
    value: Union[int, float, bool, str, None]
    line: int = field(default=0, compare=False)

    # 1, 1.0 and True are == in Python but mean different things in CuIR (int / float / bool
    # scalars): compare and hash the value's type too, so equal programs mean the same.
    def __eq__(self, other):
        return isinstance(other, Const) and type(self.value) is type(other.value) and self.value == other.value

    def __hash__(self):
        return hash((type(self.value), self.value))


@dataclass(frozen=True)
class BinOp:
    op: str             # + - * / // % & | ^
    left: "Expr"
    right: "Expr"
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class UnaryOp:
    op: str             # - not ~
    operand: "Expr"
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Compare:
    op: str             # < <= > >= == !=
    left: "Expr"
    right: "Expr"
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class BoolOp:
    op: str             # and or
    values: tuple["Expr", ...]
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class IfExp:
    test: "Expr"
    body: "Expr"
    orelse: "Expr"
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Call:
    op: str                                   # a key of OPS
    args: tuple["Expr", ...] = ()
    kwargs: tuple[tuple[str, "Expr"], ...] = ()
    line: int = field(default=0, compare=False)

    def kwarg(self, name: str, default=None):
        return next((v for k, v in self.kwargs if k == name), default)


@dataclass(frozen=True)
class Slice:
    lower: "Expr | None"
    upper: "Expr | None"
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Subscript:
    value: Name
    index: tuple["Expr | Slice", ...]
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Seq:
    items: tuple["Expr", ...]                 # a list literal: shapes, [BLOCK_M, D]
    line: int = field(default=0, compare=False)


Expr = Union[Name, Const, BinOp, UnaryOp, Compare, BoolOp, IfExp, Call, Subscript, Seq]


# ---------------------------------------------------------------- statements
@dataclass(frozen=True)
class Assign:
    targets: tuple[str, ...]                  # one name, or several for `m, h, b = grid(...)`
    value: Expr
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class AugAssign:
    target: str
    op: str
    value: Expr
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class ExprStmt:
    value: Call
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class For:
    var: str
    start: Expr
    stop: Expr
    step: Expr
    body: tuple["Stmt", ...]
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class If:
    test: Expr
    body: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...] = ()
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Role:
    """`with role("consumer", warps=4, count=2) as wg:` -- `count` instances of a role, each with
    `warps` warps; `as_name` binds the instance index (0..count-1)."""
    name: str
    warps: Expr
    count: Expr
    as_name: str | None
    body: tuple["Stmt", ...]
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Region:
    """`with region("softmax"):` -- names the CUDA region of the reference kernel these statements
    correspond to (the lifting map)."""
    name: str
    body: tuple["Stmt", ...]
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Doc:
    text: str
    line: int = field(default=0, compare=False)


Stmt = Union[Assign, AugAssign, ExprStmt, For, If, Role, Region, Doc]


@dataclass(frozen=True)
class Program:
    body: tuple[Stmt, ...]
    source: str | None = field(default=None, compare=False)   # file name, for error messages

    @property
    def name(self) -> str:
        for st in self.body:
            if isinstance(st, ExprStmt) and st.value.op == "kernel":
                arg = st.value.args[0] if st.value.args else None
                if isinstance(arg, Const):
                    return str(arg.value)
        return "<unnamed>"

    def params(self) -> dict[str, object]:
        """Compile-time parameters with their defaults, from every `param(...)` statement."""
        out: dict[str, object] = {}
        for st in self.body:
            if isinstance(st, ExprStmt) and st.value.op == "param":
                for k, v in st.value.kwargs:
                    out[k] = v.value if isinstance(v, Const) else v
        return out

    def __repr__(self) -> str:
        return f"<CuIR program {self.name!r}: {count_statements(self.body)} statements>"


def count_statements(body) -> int:
    n = 0
    for st in body:
        n += 1
        for child in children(st):
            n += count_statements(child)
    return n


def children(st) -> tuple[tuple, ...]:
    """Nested statement blocks of a statement."""
    if isinstance(st, (For, Role, Region)):
        return (st.body,)
    if isinstance(st, If):
        return (st.body, st.orelse)
    return ()


def walk_stmts(body):
    """Every statement, depth first, in source order."""
    for st in body:
        yield st
        for child in children(st):
            yield from walk_stmts(child)


def walk_expr(e):
    """Every expression node under e (e included)."""
    if e is None:
        return
    yield e
    if isinstance(e, BinOp) or isinstance(e, Compare):
        yield from walk_expr(e.left)
        yield from walk_expr(e.right)
    elif isinstance(e, UnaryOp):
        yield from walk_expr(e.operand)
    elif isinstance(e, BoolOp) or isinstance(e, Seq):
        for v in (e.values if isinstance(e, BoolOp) else e.items):
            yield from walk_expr(v)
    elif isinstance(e, IfExp):
        for v in (e.test, e.body, e.orelse):
            yield from walk_expr(v)
    elif isinstance(e, Call):
        for v in e.args:
            yield from walk_expr(v)
        for _, v in e.kwargs:
            yield from walk_expr(v)
    elif isinstance(e, Subscript):
        yield from walk_expr(e.value)
        for ix in e.index:
            yield from walk_expr(ix)
    elif isinstance(e, Slice):
        yield from walk_expr(e.lower)
        yield from walk_expr(e.upper)


def stmt_exprs(st) -> tuple:
    """The expressions a statement evaluates itself (not those of nested blocks)."""
    if isinstance(st, (Assign, AugAssign, ExprStmt)):
        return (st.value,)
    if isinstance(st, For):
        return (st.start, st.stop, st.step)
    if isinstance(st, If):
        return (st.test,)
    if isinstance(st, Role):
        return (st.warps, st.count)
    return ()
