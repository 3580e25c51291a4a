"""The rules proposer: reference CuIR + a spec's hooks -> target CuIR, deterministically.

Each rule of the taxonomy rewrites its regions of the reference program:
- iteration_space (kv_range): the KV tile range of each query tile, the per-tile `visit`, and the
  full/partial classification, from interval analysis of the traced mask when it reads only
  indices, or from a block table computed at call time when it reads captured tensors;
- mask_predicate (mask): the traced mask, applied only on partial tiles, and the ragged tail;
- score_transform (score): the traced score_mod after the 1/sqrt(D) scaling;
- normalization (softmax, epilogue): online softmax kept, or sigmoid / relu with no running
  state and no final division;
- extra_io: kernel inputs for captured tensors, runtime inputs and the block table; LSE dropped
  when the normalisation is not softmax.
Queries are aligned to the end of the keys: the reference programs index query rows by their
absolute position iq = row + NK - NQ, and the kv_range region bounds q_lo / q_hi the same way.
`Candidate.bind` (cubridge.transfer.call_binding.bind_inputs) gives the extra inputs of one call.
The result is checked against the taxonomy (`taxonomy.check_structure`) before it is returned.

Example:
    >>> from cubridge.cuir.parser import parse_file
    >>> from cubridge.paths import ref_kernel_dir
    >>> from cubridge.spec import load_spec
    >>> ref = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")
    >>> cand = transfer(ref, load_spec("prefixlm"))
    >>> cand.rules
    ['iteration_space: interval analysis', 'mask_predicate', 'normalization: softmax']
    >>> cand.bind(Nq=300, Nk=300, Hq=4, Hkv=2)     # the prefix length P = N / 2 at this shape
    {'C0': 150}
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import torch

from cubridge.cuir import nodes as N
from cubridge.cuir.parser import parse
from cubridge.cuir.printer import expr, to_text
from cubridge.transfer.record import add_record
from cubridge.transfer.call_binding import bind_inputs, shape_binder
from cubridge.transfer.forms import (EMPTY, FULL, PARTIAL, PROBE_B, block_classes, consts,  # noqa: F401
                                     fingerprint, map_consts, skeleton, trace_form)
from cubridge.transfer.intervals import classify
from cubridge.transfer.taxonomy import check_structure
from cubridge.transfer.trace import TraceError


# Shapes the hooks are traced at to tell fixed constants from shape-dependent ones: a constant
# that differs between them (P = N / 2, bias = -log N) becomes a scalar kernel input bound at call
# time. Odd sizes and two head counts make an accidental match unlikely; verification at other
# shapes would catch one.
PROBES = ((97, 131, 4, 2), (211, 173, 8, 2))


@dataclass(frozen=True)
class Binding:
    """How a candidate's extra inputs are bound at a shape, as data that travels in a job (so a
    worker binds without redoing the transfer): the shape-dependent constants (slots: input name,
    constant index, dtype), whether it reads a block table and whether per (batch, head), a
    fingerprint of the traced hooks' structure (a shape whose hooks trace differently is refused),
    the program's tile params (the table's default block sizes), and for runtime inputs: the mask
    predicate (CuIR text, for the GPU block table), which captures are runtime inputs read as they
    are (capture name, input name), which are derived from them, whether the table reads them.

    >>> b = Binding((("C0", 1, "i32"),), table=False, skeleton="ab12", params=(("BLOCK_M", 128),))
    >>> Binding.from_json(b.to_json()) == b
    True
    """
    slots: tuple = ()
    table: bool = False
    per_bh: bool = False
    skeleton: str = ""
    params: tuple = ()
    mask: str = ""
    runtime: tuple = ()
    derived: tuple = ()
    table_reads_runtime: bool = False

    def to_json(self) -> dict:
        return {"slots": [list(s) for s in self.slots], "table": self.table, "per_bh": self.per_bh,
                "skeleton": self.skeleton, "params": dict(self.params), "mask": self.mask,
                "runtime": [list(r) for r in self.runtime], "derived": list(self.derived),
                "table_reads_runtime": self.table_reads_runtime}

    @staticmethod
    def from_json(d: dict) -> "Binding":
        return Binding(tuple(tuple(s) for s in d["slots"]), bool(d["table"]), bool(d["per_bh"]), d["skeleton"],
                       tuple(sorted(d["params"].items())), d.get("mask", ""),
                       tuple(tuple(r) for r in d.get("runtime", ())), tuple(d.get("derived", ())),
                       bool(d.get("table_reads_runtime", False)))


@dataclass
class Candidate:
    """A target program, shape-generic, and how to bind its extra inputs at a shape."""
    program: N.Program
    rules: list = field(default_factory=list)      # what was rewritten, for the report
    spec: object = None
    spec_params: dict = field(default_factory=dict)
    slots: list = field(default_factory=list)      # (input name, constant index, dtype)
    table: bool = False
    per_bh: bool = False
    skeleton: str = ""                             # fingerprint of the traced hooks
    runtime: dict = field(default_factory=dict)    # capture name -> runtime input it is
    derived: tuple = ()                            # captures computed from runtime inputs
    table_reads_runtime: bool = False

    @property
    def host_path(self) -> bool:
        """True when a call needs the hooks re-run on the host (captures derived from runtime
        inputs): such a call cannot run inside a CUDA graph capture."""
        return bool(self.derived)

    @property
    def text(self) -> str:
        return to_text(self.program)

    @property
    def binding(self) -> Binding:
        # Kept per program object: printing the mask region walks the whole program, ~25 us of
        # every bind() (a spec with runtime inputs binds on every call).
        fields = (tuple(tuple(s) for s in self.slots), self.table, self.per_bh, self.skeleton,
                  tuple(self.runtime.items()), tuple(self.derived), self.table_reads_runtime)
        cached = self.__dict__.get("_binding")
        if cached is None or cached[0] is not self.program or cached[1] != fields:
            program = (tuple(sorted(self.program.params().items())), _mask_text(self.program))
            cached = self.__dict__["_binding"] = (self.program, fields, Binding(*fields[:4], *program, *fields[4:]))
        return cached[2]

    def bind(self, *, Nq: int, Nk: int, Hq: int, Hkv: int, B: int = 1, params: dict | None = None,
             device="cpu", runtime: dict | None = None) -> dict:
        """The extra kernel inputs at one call: scalars, captured tensors, runtime inputs, the
        block table. `runtime`: the call's runtime inputs, or None for representative values."""
        return bind_inputs(self.binding, self.spec, self.spec_params, Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B,
                           params=params, device=device, runtime=runtime)

    def binder_at(self, *, Nq: int, Nk: int, Hq: int, Hkv: int, B: int = 1, params: dict | None = None,
                  device="cpu"):
        """bind(runtime) at one shape (call_binding.ShapeBinder), for a caller that binds every call."""
        return shape_binder(self.binding, self.spec, self.spec_params, Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B,
                            params=params, device=device)


def transfer(reference: N.Program, spec, *, spec_params: dict | None = None, device="cpu") -> Candidate:
    """Target CuIR for `spec`, valid at every shape and tile config (tile params are chosen later:
    `Candidate.bind(params=...)`, the checker and the tuner take them); `Candidate.bind` gives its
    extra inputs."""
    spec_params = dict(spec_params or {})
    runtime = [_probe_runtime(spec, p, spec_params, device) for p in PROBES]
    forms = [trace_form(spec, *p, spec_params, device, runtime=r) for p, r in zip(PROBES, runtime)]
    if skeleton(forms[0]) != skeleton(forms[1]):
        raise TraceError(f"the hooks of {spec.name!r} trace to different structures at different shapes",
                         where=spec.path, hint="make the hooks' structure independent of the shape")
    generic, slots = _generalise(forms)
    mask, score, bias, scale = generic
    rules = []
    pred = mask if mask is not None else N.Const(True)
    table = mask is not None and any(isinstance(e, N.Call) and e.op == "gather" for e in N.walk_expr(pred))
    names = {e.id for e in N.walk_expr(pred) if isinstance(e, N.Name)}
    from_runtime, derived = _runtime_captures(spec, forms[0], runtime[0], spec_params, device)
    per_bh = table and bool(names & {"b", "h"})
    rules.append("iteration_space: " + ("block table" if table else "interval analysis"))
    if mask is not None:
        rules.append("mask_predicate")
    if score is not None:
        rules.append("score_transform")
    rules.append(f"normalization: {forms[0].norm_kind}")
    gen = _Generator(pred, score, forms[0].norm_kind, bias, scale, table, per_bh)
    body = gen.rewrite(reference.body)
    decls = [_stmts(f"{n} = scalar_input({dt})")[0] for n, _, dt in slots]
    for name, t in forms[0].captures.items():
        dt = "f32" if t.is_floating_point() else "i32"
        dims = ", ".join(f"{name}_N{d}" for d in range(t.dim()))
        decls.append(_stmts(f"{name} = global_input({dt}, [{dims}])")[0])
    if table:
        dims = "BLOCK_CLASS_B, BLOCK_CLASS_H, " if per_bh else ""
        decls.append(_stmts(f"BLOCK_CLASS = global_input(i32, [{dims}BLOCK_CLASS_M, BLOCK_CLASS_N])")[0])
    body = _add_io(body, decls, drop_lse=forms[0].norm_kind != "softmax")
    program = add_record(N.Program(body, source=f"<{spec.name} from {reference.name}>"), spec, spec_params)
    program = parse(to_text(program), source=program.source)   # normalise lines for error messages
    check_structure(reference, program)
    return Candidate(program, rules, spec, spec_params, slots, table, per_bh, fingerprint(forms[0]),
                     from_runtime, derived, table and bool(names & (set(from_runtime) | set(derived))))


# ------------------------------------------------------------------ tracing and generalising
def _probe_runtime(spec, probe, spec_params, device, seed=None) -> dict:
    if not spec.runtime_inputs:
        return {}
    from cubridge import inputs
    Nq, Nk, Hq, Hkv = probe
    return inputs.sample(spec.runtime_inputs, Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=PROBE_B, device=device,
                         params=spec.resolved_params(**spec_params), sampler=spec.sampler, seed=seed)


def _runtime_captures(spec, form, runtime: dict, spec_params, device) -> tuple[dict, tuple]:
    """(capture name -> runtime input name for runtime inputs read as they are, names of captures
    computed from runtime inputs): the latter change when the hooks get other runtime values."""
    by_id = {id(t): n for n, t in runtime.items()}
    direct = {c: by_id[id(t)] for c, t in form.captures.items() if id(t) in by_id}
    if not runtime:
        return direct, ()
    other = _probe_runtime(spec, PROBES[0], spec_params, device, seed=1)
    again = trace_form(spec, *PROBES[0], spec_params, device, runtime=other)
    derived = tuple(c for c, t in form.captures.items() if c not in direct
                    and (t.shape != again.captures[c].shape or not torch.equal(t, again.captures[c])))
    return direct, derived


def _mask_text(program) -> str:
    """The predicate of the program's mask region (CuIR text), or "" when it has none."""
    for st in N.walk_stmts(program.body):
        if isinstance(st, N.Region) and st.name == "mask":
            for inner in N.walk_stmts(st.body):
                if isinstance(inner, N.Assign) and inner.targets == ("s",) and isinstance(inner.value, N.Call) \
                        and inner.value.op == "where":
                    cond = inner.value.args[0]        # (PRED) & (ik < NK): the bound is the kernel's own
                    return expr(cond.left if isinstance(cond, N.BinOp) and cond.op == "&" else cond)
    return ""


def _generalise(forms):
    """Constants that differ between the probe shapes become scalar inputs C0, C1, ..."""
    a, b = consts(forms[0]), consts(forms[1])
    slots = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            dt = "i32" if isinstance(x, int) and isinstance(y, int) else "f32"
            slots.append((f"C{len(slots)}", i, dt))
    names = {i: n for n, i, _ in slots}
    counter = iter(range(len(a)))

    def sub(c):
        i = next(counter)
        return N.Name(names[i]) if i in names else c
    return tuple(map_consts(n, sub) for n in forms[0].nodes()), slots


def _is_true(e) -> bool:
    return isinstance(e, N.Const) and e.value is True


def _stmts(text: str):
    return parse(textwrap.dedent(text).strip() + "\n").body


class _Generator:
    def __init__(self, pred, score, norm_kind, bias, scale, table, per_bh):
        self.pred, self.score_expr, self.table = pred, score, table
        self.norm_kind, self.bias, self.scale = norm_kind, bias, scale
        self.cls_index = "b, h, m_blk" if per_bh else "m_blk"
        self.must, self.may = classify(pred)

    def rewrite(self, body):
        out = []
        for st in body:
            if isinstance(st, N.Region) and st.name in ("kv_range", "mask", "score", "softmax", "epilogue"):
                out.append(N.Region(st.name, getattr(self, st.name)(st)))
            elif isinstance(st, N.For):
                out.append(N.For(st.var, st.start, st.stop, st.step, self.rewrite(st.body)))
            elif isinstance(st, N.If):
                out.append(N.If(st.test, self.rewrite(st.body), self.rewrite(st.orelse)))
            elif isinstance(st, N.Role):
                out.append(N.Role(st.name, st.warps, st.count, st.as_name, self.rewrite(st.body)))
            elif isinstance(st, N.Region):
                out.append(N.Region(st.name, self.rewrite(st.body)))
            else:
                out.append(st)
        return tuple(out)

    # ------------------------------------------------------------ iteration space
    def kv_range(self, region):
        per_tile = any(isinstance(s, N.Assign) and "visit" in s.targets for s in region.body)
        # With a block table, the interval bound of the mask's index-only part still rules out
        # tiles before any table read (the gathers are unknown to it, so it stays sound).
        interval = "" if _is_true(self.may) else f"({expr(self.may)}) and "
        if per_tile:
            if self.table:
                return _stmts(f"""
                    k_lo = j * BLOCK_N
                    k_hi = min(k_lo + BLOCK_N, NK) - 1
                    cls = gather(BLOCK_CLASS, {self.cls_index}, j)
                    visit = {interval}cls != {EMPTY}
                """)
            return _stmts(f"""
                k_lo = j * BLOCK_N
                k_hi = min(k_lo + BLOCK_N, NK) - 1
                visit = {expr(self.may)}
            """)
        if self.table:
            may = f"{interval}gather(BLOCK_CLASS, {self.cls_index}, jj) != {EMPTY}"
        elif isinstance(self.may, N.Const) and self.may.value is True:
            return _stmts("""
                q_lo = q0 + NK - NQ
                q_hi = min(q0 + BLOCK_M, NQ) - 1 + NK - NQ
                kv_lo = 0
                kv_hi = cdiv(NK, BLOCK_N)
            """)
        else:
            may = expr(self.may)
        return _stmts(f"""
            q_lo = q0 + NK - NQ
            q_hi = min(q0 + BLOCK_M, NQ) - 1 + NK - NQ
            kv_lo = cdiv(NK, BLOCK_N)
            kv_hi = 0
            for jj in range(cdiv(NK, BLOCK_N)):
                k_lo = jj * BLOCK_N
                k_hi = min(k_lo + BLOCK_N, NK) - 1
                tile_may = {may}
                kv_lo = jj if tile_may and kv_lo > jj else kv_lo
                kv_hi = jj + 1 if tile_may else kv_hi
        """)

    # ------------------------------------------------------------ mask and score
    def mask(self, region):
        full = f"cls == {FULL}" if self.table else expr(self.must)
        pred = expr(self.pred)
        return _stmts(f"""
            partial = not ({full}) or k0 + BLOCK_N > NK
            if partial:
                ik = col_index(k0, BLOCK_N)
                s = where(({pred}) & (ik < NK), s, -inf)
        """)

    def score(self, region):
        body = list(region.body)
        if self.score_expr is None:
            return tuple(body)
        uses_ik = any(isinstance(e, N.Name) and e.id == "ik" for e in N.walk_expr(self.score_expr))
        extra = "ik = col_index(k0, BLOCK_N)\n" if uses_ik else ""
        return tuple(body) + _stmts(f"{extra}s = {expr(self.score_expr)}")

    # ------------------------------------------------------------ normalisation
    def softmax(self, region):
        if self.norm_kind == "softmax":
            return region.body
        updates = any(isinstance(st, N.Assign) and st.targets == ("m_new",) for st in region.body)
        if not updates:     # a pipelined kernel's separate O rescale: no rescale without a running max
            return ()
        if self.norm_kind == "sigmoid":
            return _stmts(f"p = sigmoid(s + {expr(self.bias)})")
        return _stmts(f"p = relu(s) * {expr(self.scale)}")

    def epilogue(self, region):
        if self.norm_kind == "softmax":
            return region.body
        out = []
        for st in region.body:
            if isinstance(st, N.ExprStmt) and st.value.op == "store" and isinstance(st.value.args[0], N.Subscript) \
                    and st.value.args[0].value.id == "O":
                value = N.Call("cast", (N.Name("acc"), N.Name("T")))
                out.append(N.ExprStmt(N.Call("store", (st.value.args[0], value))))
        return tuple(out)


def _add_io(body, decls, drop_lse):
    out = []
    for st in body:
        if drop_lse and isinstance(st, N.Assign) and st.targets == ("LSE",):
            continue
        if isinstance(st, N.Assign) and isinstance(st.value, N.Call) and st.value.op == "grid":
            out.extend(decls)
        out.append(st)
    return tuple(out)
