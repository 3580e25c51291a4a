"""Read a target CuIR program back into the handful of expressions lowering needs.

The deterministic generators lower what the rules taxonomy produces: a score expression, a mask
predicate, per-tile `visit` (may) and full (must) predicates or a block-table read, and a
normalisation. `extract(program)` finds them in the rewritable regions and raises LowerError for a
shape it does not know (an LLM-written region, say), which the LLM lower task then handles.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cubridge.cuir import nodes as N
from cubridge.lower.cexpr import LowerError


@dataclass
class VariantIR:
    score: object = None                 # expression of s, iq, ik, b, h (None: identity)
    mask: object = None                  # predicate of iq, ik, b, h (None: every pair attended)
    may: object = None                   # per-tile predicate of q_lo, q_hi, k_lo, k_hi (None: table)
    must: object = None
    table: bool = False                  # tile classes come from BLOCK_CLASS
    table_bh: bool = False               # ... indexed [b, h, m_block, n]
    norm: str = "softmax"
    norm_arg: object = None              # sigmoid bias / relu scale expression
    scalars: list = field(default_factory=list)     # (name, "int" | "float")
    tables: list = field(default_factory=list)      # (name, "int" | "float", ndim)
    dense_reference: bool = False        # the reference program itself (no rewrite)


def _regions(program, name):
    return [st for st in N.walk_stmts(program.body) if isinstance(st, N.Region) and st.name == name]


def _assign(body, target):
    for st in N.walk_stmts(body):
        if isinstance(st, N.Assign) and st.targets == (target,):
            return st.value
    return None


def extract(program: N.Program) -> VariantIR:
    ir = VariantIR()
    _extra_io(program, ir)
    per_tile = [r for r in _regions(program, "kv_range") if _assign(r.body, "visit") is not None]
    if not per_tile:
        raise LowerError("no per-tile `visit` assignment in a kv_range region")
    visit = _assign(per_tile[0].body, "visit")
    if isinstance(visit, N.Const) and visit.value is True and _assign(per_tile[0].body, "k_lo") is None:
        ir.dense_reference = True
        return ir
    cls = _assign(per_tile[0].body, "cls")
    if cls is not None:
        ir.table = True
        ir.table_bh = len(cls.args) == 5
        # visit = (INTERVAL) and cls != 0, or just cls != 0: keep the interval part for chunks
        if isinstance(visit, N.BoolOp) and visit.op == "and":
            ir.may = visit.values[0] if len(visit.values) == 2 else N.BoolOp("and", visit.values[:-1])
    else:
        ir.may = visit
    _score(program, ir)
    _mask(program, ir)
    _norm(program, ir)
    return ir


def _extra_io(program, ir):
    for st in program.body:
        if isinstance(st, N.Assign) and isinstance(st.value, N.Call):
            name, call = st.targets[0], st.value
            dt = call.args[0].id if call.args and isinstance(call.args[0], N.Name) else None
            if call.op == "scalar_input":
                ir.scalars.append((name, "int" if dt == "i32" else "float"))
            elif call.op == "global_input" and name not in ("Q", "K", "V"):
                ir.tables.append((name, "int" if dt == "i32" else "float", len(call.args[1].items)))


def _score(program, ir):
    regions = _regions(program, "score")
    if not regions:
        raise LowerError("no score region")
    body = [st for st in regions[0].body if isinstance(st, N.Assign)]
    first = body[0] if body else None
    if not (first and first.targets == ("s",) and isinstance(first.value, N.BinOp) and first.value.op == "*"):
        raise LowerError("score region does not start with `s = s * sm_scale`")
    rest = [st for st in body[1:] if st.targets != ("ik",)]
    if len(rest) > 1 or (rest and rest[0].targets != ("s",)):
        raise LowerError("score region has a form the generator does not know")
    ir.score = rest[0].value if rest else None


def _mask(program, ir):
    regions = _regions(program, "mask")
    if not regions:
        raise LowerError("no mask region")
    partial = _assign(regions[0].body, "partial")
    where = None
    for st in N.walk_stmts(regions[0].body):
        if isinstance(st, N.Assign) and st.targets == ("s",) and isinstance(st.value, N.Call) \
                and st.value.op == "where":
            where = st.value
    if where is None or partial is None:
        raise LowerError("mask region lacks `partial = ...` and `s = where(...)`")
    cond = where.args[0]
    # (PRED) & (ik < NK): the bound is the kernel's own; keep PRED.
    if isinstance(cond, N.BinOp) and cond.op == "&" and _is_bound(cond.right):
        ir.mask = cond.left
    else:
        raise LowerError("mask predicate is not `(PRED) & (ik < NK)`")
    if not ir.table:
        # partial = not (MUST) or k0 + BLOCK_N > NK
        if isinstance(partial, N.BoolOp) and partial.op == "or" and isinstance(partial.values[0], N.UnaryOp):
            ir.must = partial.values[0].operand
        else:
            raise LowerError("`partial` is not `not (MUST) or k0 + BLOCK_N > NK`")


def _is_bound(e) -> bool:
    return (isinstance(e, N.Compare) and e.op == "<" and isinstance(e.left, N.Name) and e.left.id == "ik"
            and isinstance(e.right, N.Name) and e.right.id == "NK")


def _norm(program, ir):
    regions = _regions(program, "softmax")
    p = _assign(regions[0].body, "p") if regions else None
    if p is None:
        raise LowerError("no `p = ...` in the softmax region")
    if isinstance(p, N.Call) and p.op == "sigmoid" and isinstance(p.args[0], N.BinOp) and p.args[0].op == "+":
        ir.norm, ir.norm_arg = "sigmoid", p.args[0].right
    elif isinstance(p, N.BinOp) and p.op == "*" and isinstance(p.left, N.Call) and p.left.op == "relu":
        ir.norm, ir.norm_arg = "relu", p.right
    elif _assign(regions[0].body, "m_new") is not None:
        ir.norm = "softmax"
    else:
        raise LowerError("softmax region has a form the generator does not know")
