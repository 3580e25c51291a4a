"""Static checks of a CuIR program at one configuration of its parameters.

`check(program, params, dims)` walks the program with abstract values (tile shapes are concrete
once the parameters and the head dim are fixed; sequence lengths and batch stay unknown) and
rejects, with the statement's line and what is allowed:
- names used before they are defined, ops used on the wrong kind of value;
- shape, dtype and memory-space mismatches (copies, stores, mma, elementwise ops);
- reads of asynchronously written shared memory with no wait before them (`waits.py`);
- roles and barriers that cannot match: a barrier waited on that nothing arrives on, one arrived
  on that nothing waits for, more arrivals required than roles arrive;
- shared memory beyond the architecture's limit.
It returns a `CheckReport` with the shared-memory footprint.

Example:
    >>> from cubridge.cuir.parser import parse_file
    >>> from cubridge.paths import ref_kernel_dir
    >>> r = check(parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir"), dims={"D": 128})
    >>> r.smem_bytes
    98304
"""
from __future__ import annotations

from cubridge.cuir import nodes as N
from cubridge.cuir.waits import check_barriers, check_waits
from cubridge.cuir.absval import SMEM_LIMIT, Bar, Buf, CheckReport, DT, Glob, GView, Scalar, Tile, View
from cubridge.errors import CuIRCheckError


def check(program: N.Program, params: dict | None = None, dims: dict | None = None,
          arch: str | None = None, dtype: str = "bf16") -> CheckReport:
    """Check `program` at `params` (defaults from its param(...)) and `dims` (compile-time sizes,
    e.g. {"D": 128}; default D=64). Raises CuIRCheckError on the first problem."""
    return _Checker(program, params or {}, dims or {}, arch, dtype).run()


class _Checker:
    def __init__(self, program, params, dims, arch, dtype):
        self.p = program
        self.params_override = params
        self.dims = {"D": 64, **dims}
        self.arch = arch
        self.T = dtype
        self.report = CheckReport(0)

    def fail(self, msg, line, hint=None):
        raise CuIRCheckError(msg, line=line, source=self.p.source, hint=hint)

    # ------------------------------------------------------------ program structure
    def run(self) -> CheckReport:
        body = self.p.body
        heads = [st for st in body if isinstance(st, N.ExprStmt) and st.value.op == "kernel"]
        if len(heads) != 1:
            self.fail("a program has exactly one kernel(...) header", heads[1].line if heads else 1,
                      'start with kernel("name", arch="sm_80")')
        arch = heads[0].value.kwarg("arch")
        self.arch = self.arch or (arch.value if isinstance(arch, N.Const) else "sm_80")
        params = self.p.params()
        unknown = set(self.params_override) - set(params)
        if unknown:
            self.fail(f"unknown parameter(s) {sorted(unknown)}", heads[0].line, f"parameters: {sorted(params)}")
        params.update(self.params_override)
        self.report.params = dict(params)
        env = {k: Scalar(_kind(v), v) for k, v in params.items()}
        env.update({k: Scalar("float", v) for k, v in N.CONSTANTS.items()})
        env.update({d: DT(self.T if d == "T" else d) for d in N.DTYPES})
        grids = [st for st in body if isinstance(st, N.Assign) and isinstance(st.value, N.Call)
                 and st.value.op == "grid"]
        if len(grids) != 1:
            self.fail("a program has exactly one grid(...) statement", grids[1].line if grids else 1,
                      "m_blk, h, b = grid(cdiv(NQ, BLOCK_M), HQ, B)")
        self.block(body, env, role=None, top=True)
        check_waits(self.p, self.fail)
        # Counts as evaluated above, so expressions such as count=CONSUMERS + 1 are checked too.
        check_barriers(self.p, env_counts={n: c for n, _, c in self.report.roles}, fail=self.fail,
                       bar_counts={k: v.count for k, v in env.items() if isinstance(v, Bar)})
        limit = SMEM_LIMIT.get(self.arch)
        if limit and self.report.smem_bytes > limit:
            self.fail(f"shared memory {self.report.smem_bytes} bytes exceeds the {self.arch} limit of {limit}",
                      grids[0].line, "use smaller tiles or fewer stages")
        return self.report

    def block(self, body, env, role, top=False):
        for st in body:
            self.stmt(st, env, role, top)

    def stmt(self, st, env, role, top):
        if isinstance(st, N.Doc):
            return
        if isinstance(st, N.Role):
            if not top:
                self.fail("roles can only appear at the top level of the program", st.line)
            warps, count = self.scalar(st.warps, env, st.line), self.scalar(st.count, env, st.line)
            for what, v in (("warps", warps), ("count", count)):
                if v.kind != "int" or v.value is None or v.value < 1:
                    self.fail(f"role {st.name!r}: {what} must be a positive compile-time integer", st.line)
            self.report.roles.append((st.name, warps.value, count.value))
            renv = dict(env)
            if st.as_name:
                renv[st.as_name] = Scalar("int", None)
            self.block(st.body, renv, st.name)
            return
        if isinstance(st, N.Region):
            self.block(st.body, env, role)
            return
        if isinstance(st, N.For):
            for e in (st.start, st.stop, st.step):
                if self.scalar(e, env, st.line).kind != "int":
                    self.fail("range() bounds must be integers", st.line)
            env[st.var] = Scalar("int", None)
            self.block(st.body, env, role)
            return
        if isinstance(st, N.If):
            if not isinstance(self.value(st.test, env, st.line), Scalar):
                self.fail("an if test must be a scalar", st.line,
                          "to select elementwise on a tile use where(cond, a, b)")
            a, b = dict(env), dict(env)
            self.block(st.body, a, role)
            self.block(st.orelse, b, role)
            for k in set(a) | set(b):
                va, vb = a.get(k, b.get(k)), b.get(k, a.get(k))
                if type(va) is not type(vb) or (isinstance(va, Tile) and va != vb):
                    self.fail(f"{k!r} has different types after the two branches of this if: {_show(va)} vs {_show(vb)}",
                              st.line)
                env[k] = va if not isinstance(va, Scalar) or va == vb else Scalar(va.kind, None)
            return
        if isinstance(st, N.AugAssign):
            cur = env.get(st.target)
            if cur is None:
                self.fail(f"name {st.target!r} is not defined", st.line)
            env[st.target] = self.binop(st.op, cur, self.value(st.value, env, st.line), st.line)
            return
        if isinstance(st, N.ExprStmt):
            spec = N.OPS[st.value.op]
            if not spec.stmt:
                self.fail(f"the result of {st.value.op}(...) is unused", st.line, "assign it to a name")
            if spec.kind in (N.Kind.SYNC,) and st.value.op in ("wait", "arrive", "bar_sync", "sync", "commit_group",
                                                                  "wait_group", "mma_wait") and top and self._has_roles():
                self.fail(f"{st.value.op}() outside any role", st.line, "synchronisation belongs to a role")
            self.value(st.value, env, st.line)
            return
        if isinstance(st, N.Assign):
            v = self.value(st.value, env, st.line, target=st.targets[0])
            if len(st.targets) > 1:
                if not isinstance(v, tuple) or len(v) != len(st.targets):
                    self.fail(f"cannot unpack into {len(st.targets)} names", st.line)
                for t, x in zip(st.targets, v):
                    env[t] = x
            else:
                if isinstance(v, tuple):
                    self.fail("cannot assign several values to one name", st.line)
                env[st.targets[0]] = v
            return
        self.fail(f"unexpected statement {type(st).__name__}", st.line)

    def _has_roles(self):
        return any(isinstance(s, N.Role) for s in self.p.body)

    # ------------------------------------------------------------ expressions
    def scalar(self, e, env, line) -> Scalar:
        v = self.value(e, env, line)
        if not isinstance(v, Scalar):
            self.fail(f"expected a scalar, got {_show(v)}", line)
        return v

    def value(self, e, env, line, target=None):
        if isinstance(e, N.Const):
            return Scalar(_kind(e.value), e.value)
        if isinstance(e, N.Name):
            if e.id not in env:
                self.fail(f"name {e.id!r} is not defined", line, "assign it before use (each role has its own names)")
            return env[e.id]
        if isinstance(e, (N.BinOp, N.Compare)):
            return self.binop(e.op, self.value(e.left, env, line), self.value(e.right, env, line), line)
        if isinstance(e, N.UnaryOp):
            v = self.value(e.operand, env, line)
            if isinstance(v, Scalar):
                known = v.value is not None
                if e.op == "-":
                    return Scalar(v.kind, -v.value if known else None)
                if e.op == "not":
                    return Scalar("bool", (not v.value) if known else None)
                return Scalar(v.kind, None)
            return self._elementwise(v, v, line, what=e.op)
        if isinstance(e, N.BoolOp):
            vals = [self.value(x, env, line) for x in e.values]
            if not all(isinstance(v, Scalar) for v in vals):
                self.fail(f"'{e.op}' works on scalars", line, "on tiles use & and | elementwise")
            return Scalar("bool", None)
        if isinstance(e, N.IfExp):
            t = self.value(e.test, env, line)
            if not isinstance(t, Scalar):
                self.fail("the test of `a if c else b` must be a scalar", line, "use where(cond, a, b) on tiles")
            a, b = self.value(e.body, env, line), self.value(e.orelse, env, line)
            if t.value is not None:
                return a if t.value else b
            if type(a) is not type(b):
                self.fail(f"the branches of `a if c else b` differ: {_show(a)} vs {_show(b)}", line)
            return a if not isinstance(a, Scalar) else Scalar(a.kind, None)
        if isinstance(e, N.Seq):
            return [self.value(x, env, line) for x in e.items]
        if isinstance(e, N.Subscript):
            return self.subscript(e, env, line)
        if isinstance(e, N.Call):
            from cubridge.cuir.checker_ops import check_call
            return check_call(self, e, env, line, target)
        self.fail(f"unexpected expression {type(e).__name__}", line)

    def binop(self, op, a, b, line):
        if isinstance(a, Scalar) and isinstance(b, Scalar):
            if op in ("<", "<=", ">", ">=", "==", "!="):
                return Scalar("bool", _fold(op, a.value, b.value))
            kind = "float" if "float" in (a.kind, b.kind) or op == "/" else ("bool" if a.kind == b.kind == "bool" else "int")
            return Scalar(kind, _fold(op, a.value, b.value))
        return self._elementwise(a, b, line, what=op)

    def _elementwise(self, a, b, line, what):
        for v in (a, b):
            if isinstance(v, (Buf, View)):
                self.fail(f"elementwise {what!r} on shared-memory tile {v.buf.name if isinstance(v, View) else v.name}",
                          line, "load(...) it into registers first, or use it as an mma operand")
            if isinstance(v, (Glob, GView)):
                self.fail(f"elementwise {what!r} on global memory", line, "load(...) a tile first")
            if not isinstance(v, (Tile, Scalar)):
                self.fail(f"elementwise {what!r} on {_show(v)}", line)
        shapes = [v.shape for v in (a, b) if isinstance(v, Tile)]
        shape = self.broadcast(shapes, line, what)
        if what in ("<", "<=", ">", ">=", "==", "!="):
            return Tile("bool", shape)
        dts = [v.dtype for v in (a, b) if isinstance(v, Tile)]
        if what in ("&", "|", "^", "~") and all(d in ("bool", "i32") for d in dts):
            return Tile(dts[0], shape)
        if all(d == "i32" for d in dts) and what in ("+", "-", "*", "//", "%", "<<", ">>") and \
                all(v.kind == "int" for v in (a, b) if isinstance(v, Scalar)):
            return Tile("i32", shape)
        return Tile("f32", shape)

    def broadcast(self, shapes, line, what="op"):
        if not shapes:
            return ()
        rank = max(len(s) for s in shapes)
        out = []
        for d in range(rank):
            sizes = {s[d - rank + len(s)] for s in shapes if d - rank + len(s) >= 0} - {1}
            if len(sizes) > 1:
                self.fail(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast in {what!r}", line)
            out.append(sizes.pop() if sizes else 1)
        return tuple(out)

    def subscript(self, e, env, line):
        base = self.value(e.value, env, line)
        if isinstance(base, Glob):
            if len(e.index) != base.rank:
                self.fail(f"{base.name} has {base.rank} dims but is indexed with {len(e.index)}", line,
                          "index every dim: Q[b, h, q0:q0 + BLOCK_M, :]")
            shape = []
            for d, ix in enumerate(e.index):
                if isinstance(ix, N.Slice):
                    shape.append(self.extent(ix, env, line, base.dims[d], base.name))
                elif self.scalar(ix, env, line).kind != "int":
                    self.fail(f"index of {base.name} dim {d} must be an integer", line)
            return GView(base, tuple(shape))
        if isinstance(base, Buf):
            if len(e.index) > len(base.shape):
                self.fail(f"{base.name} has {len(base.shape)} dims", line)
            shape = []
            for d, ix in enumerate(e.index):
                if isinstance(ix, N.Slice):
                    shape.append(self.extent(ix, env, line, base.shape[d], base.name))
                else:
                    s = self.scalar(ix, env, line)
                    if s.kind != "int":
                        self.fail(f"index of {base.name} must be an integer", line)
                    if s.value is not None and not 0 <= s.value < base.shape[d]:
                        self.fail(f"index {s.value} out of range for {base.name} dim {d} of size {base.shape[d]}", line)
            return View(base, tuple(shape) + base.shape[len(e.index):])
        if isinstance(base, Bar):
            if base.n is None or len(e.index) != 1:
                self.fail(f"{base.name} is {'a single barrier' if base.n is None else 'a barrier array'}: "
                          f"{'use it without an index' if base.n is None else 'index it once'}", line)
            self.scalar(e.index[0], env, line)
            return Bar(base.name, None, base.count)
        self.fail(f"{e.value.id} ({_show(base)}) cannot be indexed", line,
                  "only global tensors, shared buffers and barrier arrays take subscripts")

    def extent(self, sl: N.Slice, env, line, size, name):
        """Slices are `start:start + EXTENT` (EXTENT a compile-time integer) or `:` (whole dim)."""
        if sl.lower is None and sl.upper is None:
            if size is None:
                self.fail(f"`:` over a run-time sized dim of {name}", line,
                          "slice a tile: start:start + EXTENT with a compile-time EXTENT")
            return size
        if sl.lower is None:
            ext = self.scalar(sl.upper, env, line).value
        elif isinstance(sl.upper, N.BinOp) and sl.upper.op == "+" and sl.upper.left == sl.lower:
            ext = self.scalar(sl.upper.right, env, line).value
        else:
            lo, hi = self.scalar(sl.lower, env, line).value, self.scalar(sl.upper, env, line).value
            ext = hi - lo if lo is not None and hi is not None else None
        if not isinstance(ext, int) or ext <= 0:
            self.fail(f"slice of {name} needs a positive compile-time extent", line,
                      "write start:start + EXTENT, e.g. k0:k0 + BLOCK_N")
        return ext


def _kind(v):
    return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "float" if isinstance(v, float) else "str"


def _fold(op, a, b):
    if a is None or b is None:
        return None
    try:
        return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
                "//": lambda: a // b, "%": lambda: a % b, "&": lambda: a & b, "|": lambda: a | b,
                "^": lambda: a ^ b, "<<": lambda: a << b, ">>": lambda: a >> b, "<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b,
                ">=": lambda: a >= b, "==": lambda: a == b, "!=": lambda: a != b}[op]()
    except (ZeroDivisionError, TypeError):
        return None


def _show(v) -> str:
    if isinstance(v, Scalar):
        return f"{v.kind} scalar"
    if isinstance(v, Tile):
        return f"{v.dtype} register tile {list(v.shape)}"
    if isinstance(v, View):
        return f"shared view of {v.buf.name} {list(v.shape)}"
    if isinstance(v, Buf):
        return f"shared buffer {v.name} {list(v.shape)}"
    if isinstance(v, (Glob, GView)):
        return "global tensor"
    if isinstance(v, Bar):
        return "barrier"
    return type(v).__name__
