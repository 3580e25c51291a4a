"""Which grid axes the interpreter may run together (vectorise), by taint analysis.

An axis can be vectorised when its index never reaches a control position: a loop bound, an if
test, a slice bound, a shared-memory or barrier index, a wait parity. Everything else (gathers
from global memory, arithmetic on tiles) works on per-lane tensors.
"""
from __future__ import annotations

from cubridge.cuir import nodes as N


def _names(e) -> set[str]:
    return {x.id for x in N.walk_expr(e) if isinstance(x, N.Name)}


def _control_exprs(st, smem_like: set[str]):
    """Expressions of a statement that steer control flow or address shared state."""
    if isinstance(st, N.For):
        yield from (st.start, st.stop, st.step)
    elif isinstance(st, N.If):
        yield st.test
    elif isinstance(st, N.Role):
        yield from (st.warps, st.count)
    for top in N.stmt_exprs(st):
        for e in N.walk_expr(top):
            if isinstance(e, N.Slice):
                yield from (x for x in (e.lower, e.upper) if x is not None)
            elif isinstance(e, N.Subscript) and e.value.id in smem_like:
                yield from (i for i in e.index if not isinstance(i, N.Slice))
            elif isinstance(e, N.IfExp):
                yield e.test
            elif isinstance(e, N.Call) and e.op in ("wait", "wait_group", "mma_wait", "zeros", "full",
                                                      "smem", "mbarrier"):
                yield from e.args[1:] if e.op == "wait" else e.args
                yield from (v for _, v in e.kwargs)


def _tainted(body, seeds: set[str]) -> set[str]:
    tainted = set(seeds)
    changed = True
    while changed:
        changed = False
        for st in N.walk_stmts(body):
            if isinstance(st, N.Assign) and _names(st.value) & tainted:
                new = set(st.targets) - tainted
            elif isinstance(st, N.AugAssign) and _names(st.value) & tainted:
                new = {st.target} - tainted
            elif isinstance(st, N.For) and (_names(st.start) | _names(st.stop)) & tainted:
                new = {st.var} - tainted
            else:
                new = set()
            if new:
                tainted |= new
                changed = True
    return tainted


def vectorisable_axes(block_body, axis_names: list[str]) -> list[bool]:
    """For each grid axis name, whether it can be run as a lane (never steers control)."""
    smem_like = set()
    for st in N.walk_stmts(block_body):
        if isinstance(st, N.Assign) and isinstance(st.value, N.Call) and st.value.op in ("smem", "mbarrier"):
            smem_like.update(st.targets)
    control = set()
    for st in N.walk_stmts(block_body):
        for e in _control_exprs(st, smem_like):
            control |= _names(e)
    return [not (_tainted(block_body, {a}) & control) for a in axis_names]
