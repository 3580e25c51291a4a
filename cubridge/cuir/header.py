"""The program header in the CuIR interpreter: parameters, the kernel dtype T, global inputs and
outputs bound to the caller's tensors (and their sizes to the dims' names), scalar inputs, the
grid. A mixin of the interpreter class."""
from __future__ import annotations

import torch

from cubridge.cuir import nodes as N
from cubridge.cuir.values import DType, GTensor

KERNEL_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


class HeaderMixin:
    def _header_env(self, header, inputs) -> dict:
        self.params = {}
        for st in header:
            if isinstance(st, N.ExprStmt) and st.value.op == "param":
                for k, v in st.value.kwargs:
                    self.params[k] = v.value
        unknown = set(self.override) - set(self.params)
        if unknown:
            self.fail(f"unknown parameter(s) {sorted(unknown)}",
                      hint=f"this program's parameters: {sorted(self.params)}")
        self.params.update(self.override)
        decls = [st for st in header if isinstance(st, N.Assign) and isinstance(st.value, N.Call)
                 and st.value.op in ("global_input", "scalar_input")]
        inputs = self._match_inputs(decls, inputs)
        self.T = self._kernel_dtype(decls, inputs)
        env = {**N.CONSTANTS, **self.params}
        env.update({d: DType(self.T if d == "T" else d) for d in N.DTYPES})
        self.env_consts = env
        for st in header:
            if isinstance(st, N.Assign) and isinstance(st.value, N.Call) and st.value.op in ("global_input", "global_output"):
                self._declare_global(st, env, inputs.get(st.targets[0]))
            elif isinstance(st, N.Assign) and isinstance(st.value, N.Call) and st.value.op == "scalar_input":
                v = inputs[st.targets[0]]
                if isinstance(v, torch.Tensor):
                    v = v.item()
                dt = self.eval(st.value.args[0], env, None).name
                if not isinstance(v, (int, float)) or (dt == "i32" and not isinstance(v, int)):
                    self.fail(f"scalar input {st.targets[0]} must be a{'n int' if dt == 'i32' else ' number'}, "
                              f"got {v!r}", st.line)
                env[st.targets[0]] = int(v) if dt == "i32" else float(v)
            elif isinstance(st, N.Assign) and isinstance(st.value, N.Call) and st.value.op == "grid":
                extents = [int(self._uniform(self.eval(a, env, None), st.line)) for a in st.value.args]
                if len(st.targets) != len(extents):
                    self.fail(f"grid has {len(extents)} axes but {len(st.targets)} names are bound", st.line)
                self._grid = (list(st.targets), extents)
            elif isinstance(st, N.Assign):
                self._assign(st, self.eval(st.value, env, None), env)
            elif isinstance(st, (N.Doc,)) or (isinstance(st, N.ExprStmt) and st.value.op in ("kernel", "param")):
                continue
            else:
                self.fail("only declarations and scalar assignments may come before grid(...)", st.line)
        return env

    def _match_inputs(self, decls, inputs) -> dict:
        names = [d.targets[0] for d in decls]
        if not isinstance(inputs, dict):
            inputs = list(inputs)
            if len(inputs) != len(names):
                self.fail(f"expected {len(names)} inputs ({', '.join(names)}), got {len(inputs)}")
            return dict(zip(names, inputs))
        missing = [n for n in names if n not in inputs]
        extra = [n for n in inputs if n not in names]
        if missing or extra:
            self.fail(f"inputs do not match the program: missing {missing}, unexpected {extra}",
                      hint=f"the program's inputs: {names}")
        return dict(inputs)

    def _kernel_dtype(self, decls, inputs) -> str:
        found = set()
        for d in decls:
            dt = d.value.args[0]
            if d.value.op == "global_input" and isinstance(dt, N.Name) and dt.id == "T":
                t = inputs[d.targets[0]]
                if t.dtype not in (torch.float16, torch.bfloat16):
                    self.fail(f"input {d.targets[0]} is declared T (the kernel's 16-bit dtype) but is {t.dtype}",
                              d.line, "pass float16 or bfloat16 tensors")
                found.add(KERNEL_DTYPES[t.dtype])
        if len(found) > 1:
            self.fail(f"T-typed inputs disagree on the dtype: {sorted(found)}", hint="use one dtype for Q, K and V")
        if found:
            return found.pop()
        return self.forced_dtype or "bf16"

    def _declare_global(self, st, env, tensor):
        name = st.targets[0]
        call = st.value
        dtype = self.eval(call.args[0], env, None).name
        shape_expr = call.args[1]
        if not isinstance(shape_expr, N.Seq):
            self.fail(f"the shape of {name} must be a list literal", st.line)
        if call.op == "global_input":
            if not isinstance(tensor, torch.Tensor):
                self.fail(f"input {name} must be a torch tensor", st.line)
            if tensor.dim() != len(shape_expr.items):
                self.fail(f"input {name} has {tensor.dim()} dims, the program declares {len(shape_expr.items)}",
                          st.line, f"expected shape {[_txt(e) for e in shape_expr.items]}")
            for e, n in zip(shape_expr.items, tensor.shape):
                self._bind_dim(e, int(n), name, env, st.line)
            data = tensor.detach().to("cpu")
            data = data.to(torch.int64) if dtype == "i32" else data.to(torch.float32)
            self.globals[name] = GTensor(name, dtype, data.clone(), False, st.line)
        else:
            shape = [int(self._uniform(self.eval(e, env, None), st.line)) for e in shape_expr.items]
            data = torch.full(shape, float("nan")) if dtype != "i32" else torch.full(shape, -1, dtype=torch.int64)
            self.globals[name] = GTensor(name, dtype, data, True, st.line,
                                         written=torch.zeros(shape, dtype=torch.bool))
        env[name] = self.globals[name]

    def _bind_dim(self, e, n, tname, env, line):
        if isinstance(e, N.Name) and e.id not in env:
            env[e.id] = n
            self.dims[e.id] = n
            return
        want = self.eval(e, env, None)
        if int(want) != n:
            self.fail(f"input {tname}: dim {_txt(e)} is {n} but must be {want}", line,
                      "inputs must agree on shared dims (batch, heads, head dim)")


def _txt(e) -> str:
    from cubridge.cuir.printer import expr
    return expr(e)
