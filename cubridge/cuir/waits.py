"""Static synchronisation checks: async copies waited on before use; roles and barriers matching.

These are lints over the program text, by buffer name (a ring of stages counts as one buffer):
every read of a shared buffer filled asynchronously must follow, in the reading role's program
order (loops taken twice, so a loop-carried fill counts), a wait on the mechanism that completes
the fill: wait_group for cp.async, wait on the fill's barrier for tma_load. The interpreter then
checks the same thing exactly, per slot and per phase.
"""
from __future__ import annotations

from cubridge.cuir import nodes as N

_DST_OPS = ("copy_async", "tma_load", "store")


def _base(e) -> str | None:
    if isinstance(e, N.Name):
        return e.id
    if isinstance(e, N.Subscript):
        return e.value.id
    return None


def _roles(program):
    """(role name, count expr, body) for each role; a role-less program is one role 'block'."""
    roles = [(st.name, st.count, st.body) for st in program.body if isinstance(st, N.Role)]
    if roles:
        shared = tuple(st for st in program.body if not isinstance(st, N.Role))
        return [(n, c, shared + b) for n, c, b in roles]
    return [("block", N.Const(1), program.body)]


def _calls(body):
    for st in N.walk_stmts(body):
        for top in N.stmt_exprs(st):
            for e in N.walk_expr(top):
                if isinstance(e, N.Call):
                    yield st, e


def _in_loop_writes(body, op):
    """Buffers filled by `op` inside some for loop of body."""
    out = set()
    for st in N.walk_stmts(body):
        if isinstance(st, N.For):
            for _, c in _calls(st.body):
                if c.op == op and c.args:
                    out.add(_base(c.args[0]))
    return out


def check_waits(program, fail):
    roles = _roles(program)
    tma = {}          # buffer -> (barrier base name, role, in a loop)
    for name, _, body in roles:
        looped = _in_loop_writes(body, "tma_load")
        for _, c in _calls(body):
            if c.op == "tma_load" and len(c.args) == 3:
                buf = _base(c.args[0])
                tma[buf] = (_base(c.args[2]), name, buf in looped)
    for name, _, body in roles:
        foreign = {b: v for b, v in tma.items() if v[1] != name}
        state = {b: ("bar", v[0]) for b, v in foreign.items()}
        _walk(body, state, foreign, fail)


def _walk(body, pending, foreign, fail):
    for st in body:
        if isinstance(st, N.For):
            for _ in range(2):
                for b, v in foreign.items():
                    if v[2]:
                        pending[b] = ("bar", v[0])
                _walk(st.body, pending, foreign, fail)
            continue
        if isinstance(st, N.If):
            a, b = dict(pending), dict(pending)
            _walk(st.body, a, foreign, fail)
            _walk(st.orelse, b, foreign, fail)
            pending.clear()
            pending.update(a)
            pending.update(b)
            continue
        if isinstance(st, (N.Region, N.Role)):
            _walk(st.body, pending, foreign, fail)
            continue
        for top in N.stmt_exprs(st):
            _reads(top, pending, fail, st.line)
            _effects(top, pending)


def _reads(e, pending, fail, line):
    """Fail on a read of a pending buffer anywhere in e (destinations of copies are writes)."""
    if isinstance(e, N.Call):
        args = e.args[1:] if e.op in _DST_OPS else e.args
        if e.op in _DST_OPS and e.args and isinstance(e.args[0], N.Subscript):
            for ix in e.args[0].index:
                _reads(ix, pending, fail, line)
        for a in args:
            _reads(a, pending, fail, line)
        for _, v in e.kwargs:
            _reads(v, pending, fail, line)
        return
    b = _base(e)
    if b is not None and b in pending:
        mech = pending[b]
        how = "wait_group(n)" if mech[0] == "group" else f"wait({mech[1]}[...], parity)"
        fail(f"read of shared buffer {b} before waiting for the asynchronous copy that fills it", line,
             f"insert {how} before this statement")
    if isinstance(e, N.Subscript):
        for ix in e.index:
            _reads(ix, pending, fail, line)
        return
    for child in _children(e):
        _reads(child, pending, fail, line)


def _children(e):
    if isinstance(e, (N.BinOp, N.Compare)):
        return (e.left, e.right)
    if isinstance(e, N.UnaryOp):
        return (e.operand,)
    if isinstance(e, N.BoolOp):
        return e.values
    if isinstance(e, N.Seq):
        return e.items
    if isinstance(e, N.IfExp):
        return (e.test, e.body, e.orelse)
    if isinstance(e, N.Slice):
        return tuple(x for x in (e.lower, e.upper) if x is not None)
    return ()


def _effects(e, pending):
    for c in N.walk_expr(e):
        if not isinstance(c, N.Call):
            continue
        if c.op == "copy_async":
            pending[_base(c.args[0])] = ("group", None)
        elif c.op == "tma_load" and len(c.args) == 3:
            pending[_base(c.args[0])] = ("bar", _base(c.args[2]))
        elif c.op == "wait_group":
            for b in [b for b, m in pending.items() if m[0] == "group"]:
                del pending[b]
        elif c.op == "wait" and c.args:
            bar = _base(c.args[0])
            for b in [b for b, m in pending.items() if m == ("bar", bar)]:
                del pending[b]
        elif c.op == "store" and c.args:
            pending.pop(_base(c.args[0]), None)


def check_barriers(program, env_counts, fail, bar_counts=None):
    bars = {}
    for st in program.body:
        if isinstance(st, N.Assign) and isinstance(st.value, N.Call) and st.value.op == "mbarrier":
            count = st.value.kwarg("count", N.Const(1))
            bars[st.targets[0]] = (count, st.line)
    arrivals, waits = {}, {}
    for name, _, body in _roles(program):
        for st, c in _calls(body):
            if c.op in ("arrive", "tma_load", "wait", "bar_sync"):
                bar = _base(c.args[0] if c.op != "tma_load" else c.args[-1]) if c.args else None
                if bar not in bars:
                    fail(f"{c.op}() on {bar!r}, which is not an mbarrier", st.line,
                         "declare it at the top level: name = mbarrier(count=1, n=STAGES)")
                books = (waits, arrivals) if c.op == "bar_sync" else ((waits,) if c.op == "wait" else (arrivals,))
                for book in books:       # bar_sync both arrives and waits
                    book.setdefault(bar, {}).setdefault(name, st.line)
    for bar, (count, line) in bars.items():
        if bar in waits and bar not in arrivals:
            fail(f"barrier {bar} is waited on but nothing arrives on it", min(waits[bar].values()),
                 "arrive(...) on it, or complete it with tma_load(..., barrier)")
        if bar in arrivals and bar not in waits:
            fail(f"barrier {bar} is arrived on but no role waits on it", min(arrivals[bar].values()),
                 "wait on it where the data or the free slot is needed, or remove it")
        if bar not in arrivals and bar not in waits:
            fail(f"barrier {bar} is declared but never used", line, "remove it")
        need = (bar_counts or {}).get(bar, count.value if isinstance(count, N.Const) else None)
        if need is None and isinstance(count, N.Name):
            need = _param(program, count.id)
        have = sum((env_counts.get(r) or 1) for r in arrivals.get(bar, {}))
        if isinstance(need, int) and need > have:
            fail(f"barrier {bar} needs {need} arrivals per phase but only {have} role instance(s) arrive on it",
                 line, "lower count= or have every consumer instance arrive")


def _param(program, name):
    v = program.params().get(name)
    return v if isinstance(v, int) else None
