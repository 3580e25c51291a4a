"""Parse CuIR text (restricted Python syntax) into nodes.

The text is parsed with `ast` and every node is checked against a whitelist; nothing is ever
executed. A construct outside the whitelist is a CuIRSyntaxError naming the line and saying what
is allowed instead.

Example:
    >>> p = parse('kernel("k")\\nx = zeros(f32, [16, 16])\\n')
    >>> p.name
    'k'
"""
from __future__ import annotations

import ast
from pathlib import Path

from cubridge.cuir import nodes as N
from cubridge.errors import CuIRSyntaxError

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
           ast.LShift: "<<", ast.RShift: ">>"}
_UNARY = {ast.USub: "-", ast.Not: "not", ast.Invert: "~", ast.UAdd: "+"}
_CMP = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_BOOL = {ast.And: "and", ast.Or: "or"}

_FORBIDDEN_HINTS = {
    ast.Import: "imports are not CuIR: every op is built in (see cubridge.cuir.nodes.OPS)",
    ast.ImportFrom: "imports are not CuIR: every op is built in (see cubridge.cuir.nodes.OPS)",
    ast.FunctionDef: "function definitions are not CuIR: a program is one flat kernel body",
    ast.AsyncFunctionDef: "function definitions are not CuIR",
    ast.ClassDef: "class definitions are not CuIR",
    ast.Lambda: "lambdas are not CuIR",
    ast.While: "while loops are not CuIR: use `for i in range(start, stop[, step]):`",
    ast.Try: "try/except is not CuIR",
    ast.Raise: "raise is not CuIR",
    ast.Global: "global is not CuIR", ast.Nonlocal: "nonlocal is not CuIR",
    ast.Delete: "del is not CuIR", ast.Return: "return is not CuIR",
    ast.ListComp: "comprehensions are not CuIR", ast.DictComp: "comprehensions are not CuIR",
    ast.SetComp: "comprehensions are not CuIR", ast.GeneratorExp: "comprehensions are not CuIR",
    ast.Dict: "dict literals are not CuIR", ast.Set: "set literals are not CuIR",
    ast.Starred: "star-arguments are not CuIR", ast.Await: "await is not CuIR",
    ast.Yield: "yield is not CuIR", ast.YieldFrom: "yield is not CuIR",
    ast.NamedExpr: "the walrus operator is not CuIR: assign on its own line",
    ast.JoinedStr: "f-strings are not CuIR",
    ast.Assert: "assert is not CuIR", ast.Pass: "pass is not needed in CuIR: leave the block out",
    ast.Break: "break is not CuIR: bound the loop instead",
    ast.Continue: "continue is not CuIR: guard the body with `if`",
}
_BANNED_NAMES = {"exec", "eval", "compile", "open", "getattr", "setattr", "delattr", "globals",
                 "locals", "vars", "input", "breakpoint", "__import__", "print"}


def parse_file(path: str | Path) -> N.Program:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CuIRSyntaxError(f"cannot read CuIR file: {e.strerror}", source=str(path),
                              hint="check the path") from None
    return parse(text, source=str(path))


def parse(text: str, source: str | None = None) -> N.Program:
    """Parse CuIR text into a Program. Raises CuIRSyntaxError with the line on any problem."""
    try:
        tree = ast.parse(text, filename=source or "<cuir>")
    except SyntaxError as e:
        raise CuIRSyntaxError(f"syntax error: {e.msg}", line=e.lineno, source=source,
                              hint="CuIR is a subset of Python syntax; fix the text at that line") from None
    return N.Program(_Parser(source).block(tree.body), source=source)


class _Parser:
    def __init__(self, source: str | None):
        self.source = source

    def fail(self, node, message: str, hint: str | None = None):
        raise CuIRSyntaxError(message, line=getattr(node, "lineno", None), source=self.source,
                              hint=hint)

    # ------------------------------------------------------------ statements
    def block(self, stmts) -> tuple:
        return tuple(self.stmt(s) for s in stmts)

    def stmt(self, s):
        line = s.lineno
        for bad, hint in _FORBIDDEN_HINTS.items():
            if isinstance(s, bad):
                self.fail(s, f"forbidden construct: {type(s).__name__}", hint)
        if isinstance(s, ast.Expr):
            if isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
                return N.Doc(s.value.value, line=line)
            value = self.expr(s.value)
            if not isinstance(value, N.Call):
                self.fail(s, "a bare expression statement must be an op call",
                          "assign the value to a name, or call a statement op such as store(...)")
            return N.ExprStmt(value, line=line)
        if isinstance(s, ast.Assign):
            if len(s.targets) != 1:
                self.fail(s, "chained assignment (a = b = ...) is not CuIR", "assign one name per line")
            return N.Assign(self.targets(s.targets[0]), self.expr(s.value), line=line)
        if isinstance(s, ast.AugAssign):
            if not isinstance(s.target, ast.Name):
                self.fail(s, "augmented assignment needs a plain name on the left")
            op = _BINOPS.get(type(s.op))
            if op is None:
                self.fail(s, f"operator {type(s.op).__name__} is not CuIR", f"allowed: {sorted(_BINOPS.values())}")
            return N.AugAssign(self.name(s.target, s.target.id), op, self.expr(s.value), line=line)
        if isinstance(s, ast.For):
            return self.for_(s)
        if isinstance(s, ast.If):
            return N.If(self.expr(s.test), self.block(s.body), self.block(s.orelse), line=line)
        if isinstance(s, ast.With):
            return self.with_(s)
        self.fail(s, f"forbidden construct: {type(s).__name__}",
                  "CuIR statements: assignment, op call, for-range, if/else, with role(...)/region(...)")

    def targets(self, t) -> tuple[str, ...]:
        if isinstance(t, ast.Name):
            return (self.name(t, t.id),)
        if isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts):
            return tuple(self.name(e, e.id) for e in t.elts)
        if isinstance(t, ast.Subscript):
            self.fail(t, "assignment into a subscript is not CuIR",
                      "write memory with store(dst[...], value) or copy_async(dst[...], src[...])")
        self.fail(t, "assignment target must be a name or a tuple of names")

    def for_(self, s: ast.For):
        if s.orelse:
            self.fail(s, "for/else is not CuIR")
        if not isinstance(s.target, ast.Name):
            self.fail(s, "a for loop binds one name: `for j in range(...)`")
        it = s.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
            self.fail(s, "a for loop must iterate over range(...)", "write `for j in range(start, stop[, step]):`")
        if it.keywords or not 1 <= len(it.args) <= 3:
            self.fail(s, "range takes 1 to 3 positional arguments")
        args = [self.expr(a) for a in it.args]
        if len(args) == 1:
            start, stop, step = N.Const(0, line=s.lineno), args[0], N.Const(1, line=s.lineno)
        else:
            start, stop = args[0], args[1]
            step = args[2] if len(args) == 3 else N.Const(1, line=s.lineno)
        return N.For(self.name(s.target, s.target.id), start, stop, step, self.block(s.body), line=s.lineno)

    def with_(self, s: ast.With):
        if len(s.items) != 1:
            self.fail(s, "one context per with-statement", "nest `with region(...)` inside `with role(...)`")
        item = s.items[0]
        call = item.context_expr
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id in N.CONTEXTS):
            self.fail(s, "with-statements open a role(...) or a region(...)",
                      'write `with role("consumer", warps=4, count=2) as wg:` or `with region("softmax"):`')
        if not call.args or not isinstance(call.args[0], ast.Constant) or not isinstance(call.args[0].value, str):
            self.fail(s, f"{call.func.id}(...) takes its name as a string literal first")
        name = call.args[0].value
        as_name = None
        if item.optional_vars is not None:
            if not isinstance(item.optional_vars, ast.Name):
                self.fail(s, "`as` binds one name")
            as_name = self.name(item.optional_vars, item.optional_vars.id)
        body = self.block(s.body)
        if call.func.id == "region":
            if len(call.args) != 1 or call.keywords or as_name:
                self.fail(s, 'region takes only its name: `with region("softmax"):`')
            if name not in N.ALL_REGIONS:
                self.fail(s, f"unknown region {name!r}", f"regions: {', '.join(N.ALL_REGIONS)}")
            return N.Region(name, body, line=s.lineno)
        kw = {k.arg: self.expr(k.value) for k in call.keywords}
        unknown = set(kw) - {"warps", "count"}
        if len(call.args) != 1 or unknown or "warps" not in kw:
            self.fail(s, "role takes a name, warps= and optionally count=",
                      'write `with role("consumer", warps=4, count=2) as wg:`')
        count = kw.get("count", N.Const(1, line=s.lineno))
        return N.Role(name, kw["warps"], count, as_name, body, line=s.lineno)

    # ------------------------------------------------------------ expressions
    def name(self, node, ident: str) -> str:
        if ident.startswith("__") or ident in _BANNED_NAMES:
            self.fail(node, f"forbidden name {ident!r}",
                      "dunder names and Python builtins such as exec/eval/open are not CuIR")
        return ident

    def expr(self, e):
        line = getattr(e, "lineno", 0)
        for bad, hint in _FORBIDDEN_HINTS.items():
            if isinstance(e, bad):
                self.fail(e, f"forbidden construct: {type(e).__name__}", hint)
        if isinstance(e, ast.Constant):
            if not isinstance(e.value, (int, float, bool, str)) and e.value is not None:
                self.fail(e, f"constant of type {type(e.value).__name__} is not CuIR")
            return N.Const(e.value, line=line)
        if isinstance(e, ast.Name):
            return N.Name(self.name(e, e.id), line=line)
        if isinstance(e, ast.Attribute):
            self.fail(e, f"attribute access '.{e.attr}' is not allowed",
                      "CuIR has no attributes or methods; use the op functions "
                      "(e.g. transpose(x), cast(x, f32), row_max(s))")
        if isinstance(e, ast.BinOp):
            op = _BINOPS.get(type(e.op))
            if op is None:
                self.fail(e, f"operator {type(e.op).__name__} is not CuIR", f"allowed: {' '.join(_BINOPS.values())}")
            return N.BinOp(op, self.expr(e.left), self.expr(e.right), line=line)
        if isinstance(e, ast.UnaryOp):
            op = _UNARY[type(e.op)]
            operand = self.expr(e.operand)
            if op == "+":
                return operand
            if op == "-" and isinstance(operand, N.Const) and isinstance(operand.value, (int, float)) \
                    and not isinstance(operand.value, bool):
                return N.Const(-operand.value, line=line)
            return N.UnaryOp(op, operand, line=line)
        if isinstance(e, ast.Compare):
            if len(e.ops) != 1:
                self.fail(e, "chained comparisons (a < b < c) are not CuIR", "write (a < b) & (b < c)")
            op = _CMP.get(type(e.ops[0]))
            if op is None:
                self.fail(e, f"comparison {type(e.ops[0]).__name__} is not CuIR", f"allowed: {' '.join(_CMP.values())}")
            return N.Compare(op, self.expr(e.left), self.expr(e.comparators[0]), line=line)
        if isinstance(e, ast.BoolOp):
            return N.BoolOp(_BOOL[type(e.op)], tuple(self.expr(v) for v in e.values), line=line)
        if isinstance(e, ast.IfExp):
            return N.IfExp(self.expr(e.test), self.expr(e.body), self.expr(e.orelse), line=line)
        if isinstance(e, ast.Call):
            return self.call(e)
        if isinstance(e, ast.Subscript):
            return self.subscript(e)
        if isinstance(e, ast.List):
            return N.Seq(tuple(self.expr(v) for v in e.elts), line=line)
        if isinstance(e, ast.Tuple):
            self.fail(e, "tuple values are not CuIR", "use a list literal for shapes: [BLOCK_M, D]")
        self.fail(e, f"forbidden construct: {type(e).__name__}")

    def call(self, e: ast.Call):
        if not isinstance(e.func, ast.Name):
            if isinstance(e.func, ast.Attribute):
                self.fail(e, f"method call '.{e.func.attr}(...)' is not allowed",
                          "CuIR has no methods; call the op function instead")
            self.fail(e, "only named ops can be called")
        fname = self.name(e.func, e.func.id)
        if fname in N.CONTEXTS:
            self.fail(e, f"{fname}(...) is only allowed as `with {fname}(...):`")
        if fname == "range":
            self.fail(e, "range(...) is only allowed as the iterator of a for loop")
        spec = N.OPS.get(fname)
        if spec is None:
            self.fail(e, f"unknown op {fname!r}", f"allowed ops: {', '.join(sorted(N.OPS))}")
        for a in e.args:
            if isinstance(a, ast.Starred):
                self.fail(e, "star-arguments are not CuIR")
        args = tuple(self.expr(a) for a in e.args)
        kwargs = []
        for k in e.keywords:
            if k.arg is None:
                self.fail(e, "**kwargs are not CuIR")
            if fname != "param" and k.arg not in spec.kwargs:
                allowed = ", ".join(spec.kwargs) or "none"
                self.fail(e, f"{fname}() got an unknown keyword {k.arg!r}", f"keywords of {fname}: {allowed}")
            kwargs.append((k.arg, self.expr(k.value)))
        if len(args) < spec.min_args or (spec.max_args is not None and len(args) > spec.max_args):
            sig = ", ".join(p.rstrip("?") + ("=None" if p.endswith("?") else "") for p in spec.params)
            self.fail(e, f"{fname}() takes {spec.min_args}"
                      f"{'' if spec.max_args == spec.min_args else f' to {spec.max_args}'} argument(s), got {len(args)}",
                      f"signature: {fname}({sig})")
        if fname == "param":
            for k, v in kwargs:
                if not isinstance(v, N.Const):
                    self.fail(e, f"param {k} must have a constant default")
        return N.Call(fname, args, tuple(kwargs), line=getattr(e, "lineno", 0))

    def subscript(self, e: ast.Subscript):
        if not isinstance(e.value, ast.Name):
            self.fail(e, "only named buffers can be indexed", "index a global or shared buffer: K[b, hk, k0:k0 + BLOCK_N, :]")
        sl = e.slice
        items = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if not items:
            self.fail(e, "an empty index X[()] is not CuIR", "index every dim: Q[b, h, q0:q0 + BLOCK_M, :]")
        index = []
        for it in items:
            if isinstance(it, ast.Slice):
                if it.step is not None:
                    self.fail(e, "slices with a step are not CuIR")
                index.append(N.Slice(self.expr(it.lower) if it.lower else None,
                                     self.expr(it.upper) if it.upper else None, line=e.lineno))
            else:
                index.append(self.expr(it))
        return N.Subscript(N.Name(self.name(e.value, e.value.id), line=e.lineno), tuple(index), line=e.lineno)
