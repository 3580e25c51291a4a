"""Print CuIR nodes back to canonical text. parse(to_text(p)) == p for every program p.

Example:
    >>> from cubridge.cuir.parser import parse
    >>> print(to_text(parse("x = (a + b) * c\\n")), end="")
    x = (a + b) * c
"""
from __future__ import annotations

from cubridge.cuir import nodes as N

INDENT = "    "
_PREC = {"or": 2, "and": 3, "not": 4, "cmp": 5, "|": 6, "^": 7, "&": 8, "<<": 9, ">>": 9, "+": 10, "-": 10,
         "*": 11, "/": 11, "//": 11, "%": 11, "unary": 12, "atom": 14, "ifexp": 1}


def to_text(program: N.Program) -> str:
    return "".join(line + "\n" for line in stmt_lines(program.body, 0))


def stmt_lines(body, depth: int):
    pad = INDENT * depth
    for st in body:
        if isinstance(st, N.Doc):
            yield pad + _doc(st.text)
        elif isinstance(st, N.Assign):
            yield f"{pad}{', '.join(st.targets)} = {expr(st.value)}"
        elif isinstance(st, N.AugAssign):
            yield f"{pad}{st.target} {st.op}= {expr(st.value)}"
        elif isinstance(st, N.ExprStmt):
            yield pad + expr(st.value)
        elif isinstance(st, N.For):
            yield f"{pad}for {st.var} in {_range(st)}:"
            yield from _block(st.body, depth + 1)
        elif isinstance(st, N.If):
            yield from _if(st, depth, "if")
        elif isinstance(st, N.Role):
            args = [repr(st.name), f"warps={expr(st.warps)}"]
            if st.count != N.Const(1):
                args.append(f"count={expr(st.count)}")
            tail = f" as {st.as_name}" if st.as_name else ""
            yield f"{pad}with role({', '.join(args)}){tail}:"
            yield from _block(st.body, depth + 1)
        elif isinstance(st, N.Region):
            yield f"{pad}with region({st.name!r}):"
            yield from _block(st.body, depth + 1)
        else:  # pragma: no cover - nodes are a closed set
            raise TypeError(f"not a CuIR statement: {st!r}")


def _block(body, depth):
    if not body:  # an empty block is not valid Python; a docstring keeps it parseable
        yield INDENT * depth + "''"     # as _doc("") prints it, so printing is idempotent
    yield from stmt_lines(body, depth)


def _if(st: N.If, depth: int, keyword: str):
    pad = INDENT * depth
    yield f"{pad}{keyword} {expr(st.test)}:"
    yield from _block(st.body, depth + 1)
    if len(st.orelse) == 1 and isinstance(st.orelse[0], N.If):
        yield from _if(st.orelse[0], depth, "elif")
    elif st.orelse:
        yield f"{pad}else:"
        yield from _block(st.orelse, depth + 1)


def _range(st: N.For) -> str:
    one, zero = st.step == N.Const(1), st.start == N.Const(0)
    if one and zero:
        return f"range({expr(st.stop)})"
    if one:
        return f"range({expr(st.start)}, {expr(st.stop)})"
    return f"range({expr(st.start)}, {expr(st.stop)}, {expr(st.step)})"


def _doc(text: str) -> str:
    # Triple quotes only where the text reads back verbatim: no backslashes, no control characters.
    if "\n" in text and '"""' not in text and not text.endswith('"') and "\\" not in text \
            and all(c.isprintable() or c in "\n\t" for c in text):
        return '"""' + text + '"""'
    return repr(text)


def _prec(e) -> int:
    if isinstance(e, N.BinOp):
        return _PREC[e.op]
    if isinstance(e, N.Compare):
        return _PREC["cmp"]
    if isinstance(e, N.BoolOp):
        return _PREC[e.op]
    if isinstance(e, N.UnaryOp):
        return _PREC["not"] if e.op == "not" else _PREC["unary"]
    if isinstance(e, N.IfExp):
        return _PREC["ifexp"]
    if isinstance(e, N.Const) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool) \
            and e.value < 0:
        return _PREC["unary"]
    return _PREC["atom"]


def _wrap(e, need: int, strict: bool = False) -> str:
    p = _prec(e)
    text = expr(e)
    return f"({text})" if (p < need or (strict and p == need)) else text


def expr(e) -> str:
    if isinstance(e, N.Name):
        return e.id
    if isinstance(e, N.Const):
        return repr(e.value)
    if isinstance(e, N.BinOp):
        p = _PREC[e.op]
        return f"{_wrap(e.left, p)} {e.op} {_wrap(e.right, p, strict=True)}"
    if isinstance(e, N.Compare):
        p = _PREC["cmp"]
        return f"{_wrap(e.left, p, True)} {e.op} {_wrap(e.right, p, True)}"
    if isinstance(e, N.BoolOp):
        p = _PREC[e.op]
        return f" {e.op} ".join(_wrap(v, p, True) for v in e.values)
    if isinstance(e, N.UnaryOp):
        if e.op == "not":
            return f"not {_wrap(e.operand, _PREC['not'])}"
        return f"{e.op}{_wrap(e.operand, _PREC['unary'])}"
    if isinstance(e, N.IfExp):
        p = _PREC["ifexp"]
        return f"{_wrap(e.body, p, True)} if {_wrap(e.test, p, True)} else {_wrap(e.orelse, p)}"
    if isinstance(e, N.Call):
        parts = [expr(a) for a in e.args] + [f"{k}={expr(v)}" for k, v in e.kwargs]
        return f"{e.op}({', '.join(parts)})"
    if isinstance(e, N.Subscript):
        return f"{e.value.id}[{', '.join(_index(i) for i in e.index)}]"
    if isinstance(e, N.Seq):
        return f"[{', '.join(expr(i) for i in e.items)}]"
    raise TypeError(f"not a CuIR expression: {e!r}")  # pragma: no cover


def _index(i) -> str:
    if isinstance(i, N.Slice):
        lo = expr(i.lower) if i.lower is not None else ""
        hi = expr(i.upper) if i.upper is not None else ""
        return f"{lo}:{hi}"
    return expr(i)
