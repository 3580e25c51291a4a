"""The rule taxonomy of docs/DESIGN.md as data, and the structural checker that enforces it.

A transfer may change only: score transforms, mask predicates, the iteration space, the
normalisation (with its epilogue), extra inputs and outputs, and the head mapping. Each rule names
the regions it may rewrite and the ops allowed there. Everything else -- roles, the pipeline,
memory movement, tile parameters -- must keep the reference's structure: `check_structure`
compares the two programs with the allowed parts blanked out and rejects the first difference,
naming the rule a change would have needed.
"""
from __future__ import annotations

from dataclasses import dataclass

from cubridge.cuir import nodes as N
from cubridge.errors import CubridgeError

_ELEMENTWISE = ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "relu", "abs", "sqrt", "rsqrt", "erf",
                "maximum", "minimum", "where", "cast", "row_index", "col_index", "gather", "min", "max",
                "cdiv", "full", "zeros")


@dataclass(frozen=True)
class Rule:
    name: str
    regions: tuple[str, ...]
    ops: tuple[str, ...]
    doc: str


TAXONOMY: tuple[Rule, ...] = (
    Rule("score_transform", ("score",), _ELEMENTWISE,
         "elementwise on the score tile with its indices: scale, bias, ALiBi, softcap, table lookups"),
    Rule("mask_predicate", ("mask",), _ELEMENTWISE,
         "elementwise predicates on indices and captured tensors"),
    Rule("iteration_space", ("kv_range",), _ELEMENTWISE,
         "KV bounds per query tile, tile skipping, full / partial split (interval analysis or block table)"),
    Rule("normalization", ("softmax", "epilogue"), _ELEMENTWISE + ("row_max", "row_sum", "store"),
         "online softmax, sigmoid, relu, ...: the state, its update and the epilogue"),
    Rule("extra_io", (), ("global_input", "scalar_input", "global_output"),
         "extra inputs (bias tables, ids, shape-dependent scalars) and outputs (LSE)"),
    Rule("head_map", ("head_map",), ("min", "max", "cdiv", "gather"), "MHA, GQA, MQA"),
)
REWRITABLE = {r: rule for rule in TAXONOMY for r in rule.regions}
CORE_IO = ("Q", "K", "V", "O")


class StructureError(CubridgeError):
    """A candidate changed something the taxonomy does not allow."""


def _is_extra_io(st) -> bool:
    return (isinstance(st, N.Assign) and isinstance(st.value, N.Call)
            and st.value.op in ("global_input", "scalar_input", "global_output") and st.targets[0] not in CORE_IO)


def skeleton(body) -> tuple:
    """The program with rewritable regions emptied and extra I/O declarations dropped."""
    out = []
    for st in body:
        if _is_extra_io(st) or isinstance(st, N.Doc):
            continue
        if isinstance(st, N.Region) and st.name in REWRITABLE:
            out.append(N.Region(st.name, ()))
        elif isinstance(st, N.Region):
            out.append(N.Region(st.name, skeleton(st.body)))
        elif isinstance(st, N.For):
            out.append(N.For(st.var, st.start, st.stop, st.step, skeleton(st.body)))
        elif isinstance(st, N.If):
            out.append(N.If(st.test, skeleton(st.body), skeleton(st.orelse)))
        elif isinstance(st, N.Role):
            out.append(N.Role(st.name, st.warps, st.count, st.as_name, skeleton(st.body)))
        else:
            out.append(st)
    return tuple(out)


def _line_of(st) -> int:
    return getattr(st, "line", 0)


def check_structure(reference: N.Program, candidate: N.Program) -> None:
    """Raise StructureError at the first change the taxonomy does not allow."""
    _compare(skeleton(reference.body), skeleton(candidate.body), _index_lines(candidate.body), candidate)
    for st in N.walk_stmts(candidate.body):
        if isinstance(st, N.Region) and st.name in REWRITABLE:
            rule = REWRITABLE[st.name]
            for inner in N.walk_stmts(st.body):
                if isinstance(inner, (N.Role, N.Region)):
                    raise StructureError(f"rule {rule.name}: region {st.name!r} may not contain roles or regions",
                                         where=_where(candidate, inner))
                for top in N.stmt_exprs(inner):
                    for e in N.walk_expr(top):
                        if isinstance(e, N.Call) and e.op not in rule.ops:
                            raise StructureError(
                                f"rule {rule.name}: op {e.op}() is not allowed in region {st.name!r}",
                                where=_where(candidate, inner),
                                hint=f"allowed there: {', '.join(rule.ops)}; memory movement and "
                                     "synchronisation keep the reference's structure")


def _index_lines(body):
    return [_line_of(st) for st in body]


def _where(prog, st) -> str:
    return f"{prog.source or '<candidate>'}:{_line_of(st)}"


def _compare(ref, cand, lines, prog):
    for i, (a, b) in enumerate(zip(ref, cand)):
        if a == b:
            continue
        if type(a) is type(b) and isinstance(a, (N.For, N.If, N.Role, N.Region)) and _shallow_equal(a, b):
            for ca, cb in zip(N.children(a), N.children(b)):
                _compare(ca, cb, None, prog)
            if all(len(ca) == len(cb) for ca, cb in zip(N.children(a), N.children(b))):
                continue
        raise StructureError(
            "statement differs from the reference outside the regions the taxonomy lets a transfer "
            f"rewrite ({', '.join(sorted(REWRITABLE))}) and the extra I/O declarations",
            where=_where(prog, b),
            hint="roles, pipeline, memory movement and tile parameters keep the reference's structure")
    if len(ref) != len(cand):
        extra = cand[len(ref)] if len(cand) > len(ref) else (cand[-1] if cand else None)
        raise StructureError(f"the candidate has {'more' if len(cand) > len(ref) else 'fewer'} statements "
                             "than the reference at this level", where=_where(prog, extra) if extra else None,
                             hint="only the rewritable regions may change")


def _shallow_equal(a, b) -> bool:
    if isinstance(a, N.For):
        return (a.var, a.start, a.stop, a.step) == (b.var, b.start, b.stop, b.step)
    if isinstance(a, N.If):
        return a.test == b.test
    if isinstance(a, N.Role):
        return (a.name, a.warps, a.count, a.as_name) == (b.name, b.warps, b.count, b.as_name)
    return a.name == b.name
