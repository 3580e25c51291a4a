"""The CuIR interpreter: the definition of what every CuIR op means.

It runs a program on CPU with torch tensors, for every block of the grid, emulating precision
(16-bit operands, fp32 accumulation), and runs the roles of a block in the order their barriers
allow. Faults are errors with the statement's line, never wrong numbers: a read of shared memory
before the wait that makes it visible, a deadlock, an output element no store wrote.

Blocks along grid axes that never steer control flow (batch, heads) run together as lanes
(see lanes.py), which keeps interpretation fast enough for the search loop.

Example:
    >>> import torch
    >>> from cubridge.cuir.parser import parse
    >>> prog = parse('''
    ... kernel("scale2")
    ... X = global_input(f32, [N, C])
    ... Y = global_output(f32, [N, C])
    ... i, = grid(cdiv(N, 4))
    ... store(Y[i * 4:i * 4 + 4, :], load(X[i * 4:i * 4 + 4, :]) * 2.0)
    ... ''')
    >>> x = torch.randn(10, 3)
    >>> out = interpret(prog, {"X": x}).outputs["Y"]
    >>> bool((out == 2 * x).all())
    True
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from cubridge.cuir import nodes as N
from cubridge.cuir.lanes import vectorisable_axes
from cubridge.cuir.header import KERNEL_DTYPES, HeaderMixin
from cubridge.cuir.memory import MemoryMixin
from cubridge.cuir.values import (TORCH_DTYPES, Barrier, BarrierArray, GTensor, GView, Pending,
                                  SmemBuffer, SmemView)
from cubridge.errors import CuIRError, CuIRRuntimeError

SCHEDULES = ("in_order", "reverse", "round_robin")


@dataclass
class Counters:
    """What a run executed. Multiply-adds count 2 FLOPs; bytes are per memory-level move."""
    mma_flops: int = 0
    bytes: dict = field(default_factory=lambda: {"gmem->smem": 0, "gmem->reg": 0, "smem->reg": 0,
                                                 "reg->smem": 0, "reg->gmem": 0})
    blocks: int = 0
    regions: dict = field(default_factory=dict)     # region name -> executions (in blocks)
    masked_tiles: int = 0                            # `where` executions inside region "mask"
    qk_mmas: int = 0                                 # MMAs inside region "qk": one per KV tile visited

    @property
    def kv_tiles(self) -> int:
        return self.qk_mmas


@dataclass
class RunResult:
    outputs: dict
    counters: Counters
    dims: dict
    params: dict
    dtype: str


class _Blocked:
    def __init__(self, ready, line, desc):
        self.ready, self.line, self._desc = ready, line, desc

    @property
    def desc(self) -> str:
        """Described when a deadlock is reported, so it shows the barrier state at that time."""
        return self._desc() if callable(self._desc) else self._desc


# Under "reverse" a role gives way after each arrival, so the roles it unblocks (the later ones,
# consumers) run first and the earliest (the producer) lags as far as the barriers let it. Run to
# its next wait instead, the producer refilled slot 1 right after slot 0 and never met the state
# where consumers were two phases ahead on an empty barrier: a consumer arriving on the wrong
# stage's k_empty verified although a parity wait then hangs the kernel (fuzz_cuir.json, session 7).
ARRIVING_OPS = ("arrive", "tma_load")
_PREEMPTED = _Blocked(lambda: True, 0, "preempted after an arrival")


@dataclass
class _RoleCtx:
    """One running role instance of one block."""
    name: str
    index: int
    env: dict
    groups_committed: list = field(default_factory=list)
    group_open: int = 0
    groups_done: set = field(default_factory=set)
    next_group: int = 1
    mma_pending: list = field(default_factory=list)
    observed: dict = field(default_factory=dict)     # id(barrier) -> latest phase index seen
    regions: list = field(default_factory=list)
    # Races among the warps of one role (memory.py): the interpreter runs them as one thread of
    # control, so it tracks what only a sync() orders - reads of a slot before an async refill of it,
    # and cp.async data other warps copied - by sync epoch.
    warps: int = 1
    sync_epoch: int = 0
    reads: dict = field(default_factory=dict)        # (id(buffer), row) -> (sync epoch, line) of the last read
    done_epoch: dict = field(default_factory=dict)   # cp.async group -> sync epoch its wait_group ran in

    @property
    def label(self) -> str:
        return f"{self.name}[{self.index}]"


def interpret(program: N.Program, inputs, *, params: dict | None = None, dtype=None,
              schedule: str = "in_order", vectorise: bool = True, progress=None) -> RunResult:
    """Run `program` on `inputs` (a dict by global_input name, or a sequence in declaration order).

    params: overrides of the program's `param(...)` defaults. dtype: the kernel dtype T when no
    T-typed input fixes it. schedule: the order runnable roles are picked in (to expose races).
    progress: called as progress(done, total) after each block run one at a time (long runs).
    """
    return Interpreter(program, params or {}, dtype, schedule, vectorise, progress).run(inputs)


class Interpreter(HeaderMixin, MemoryMixin):
    def __init__(self, program, params, dtype, schedule, vectorise, progress=None):
        self.progress = progress
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}")
        self.p = program
        self.schedule = schedule
        self.vectorise = vectorise
        self.override = dict(params)
        self.forced_dtype = KERNEL_DTYPES.get(dtype, dtype) if dtype is not None else None
        self.counters = Counters()
        self.globals: dict[str, GTensor] = {}
        self.dims: dict[str, int] = {}
        self.nl = 0
        self.lane_shape: tuple = ()
        self.lane_count = 1
        self.rr = 0

    # ================================================================ driver
    def fail(self, msg, line=None, hint=None):
        raise CuIRRuntimeError(msg, line=line, source=self.p.source, hint=hint)

    def run(self, inputs) -> RunResult:
        header, block = self._split()
        env = self._header_env(header, inputs)
        axes, extents = self._grid
        lanes = vectorisable_axes(block, axes) if self.vectorise else [False] * len(axes)
        lane_axes = [i for i, ok in enumerate(lanes) if ok]
        seq_axes = [i for i, ok in enumerate(lanes) if not ok]
        self.nl = len(lane_axes)
        self.lane_shape = tuple(extents[i] for i in lane_axes)
        self.lane_count = math.prod(self.lane_shape) if self.lane_shape else 1
        for k, i in enumerate(lane_axes):
            shape = [1] * self.nl
            shape[k] = extents[i]
            env[axes[i]] = torch.arange(extents[i]).view(shape)
        total = math.prod(extents[i] for i in seq_axes)
        for done, combo in enumerate(itertools.product(*(range(extents[i]) for i in seq_axes)), 1):
            benv = dict(env)
            for i, v in zip(seq_axes, combo):
                benv[axes[i]] = v
            self._run_block(block, benv)
            self.counters.blocks += self.lane_count
            if self.progress is not None:
                self.progress(done, total)
        outputs = {}
        for g in self.globals.values():
            if g.is_output:
                self._check_written(g)
                outputs[g.name] = g.data.to(TORCH_DTYPES[g.dtype]) if g.dtype != "i32" else g.data
        return RunResult(outputs, self.counters, dict(self.dims), dict(self.params), self.T)

    def _split(self):
        for i, st in enumerate(self.p.body):
            if isinstance(st, N.Assign) and isinstance(st.value, N.Call) and st.value.op == "grid":
                return self.p.body[: i + 1], self.p.body[i + 1:]
        self.fail("the program has no grid(...) statement",
                  hint="declare the block indices: m_blk, h, b = grid(cdiv(NQ, BLOCK_M), HQ, B)")

    # ================================================================ blocks and roles
    def _run_block(self, body, env):
        i = 0
        while i < len(body):
            if isinstance(body[i], N.Role):
                j = i
                while j < len(body) and isinstance(body[j], N.Role):
                    j += 1
                self._run_roles(body[i:j], env)
                i = j
            else:
                ctx = _RoleCtx("block", 0, env)
                for blocked in self.exec_stmt(body[i], ctx):
                    self.fail(f"a wait outside any role blocks forever: {blocked.desc}", body[i].line)
                i += 1

    def _run_roles(self, roles, env):
        insts = []
        for r in roles:
            count = int(self._uniform(self.eval(r.count, env, None), r.line))
            for k in range(count):
                renv = dict(env)
                if r.as_name:
                    renv[r.as_name] = k
                ctx = _RoleCtx(r.name, k, renv, warps=int(self._uniform(self.eval(r.warps, env, None), r.line)))
                insts.append([ctx, self.exec_block(r.body, ctx), None, False])
        while True:
            runnable = [x for x in insts if not x[3] and (x[2] is None or x[2].ready())]
            if not runnable:
                if all(x[3] for x in insts):
                    return
                self._deadlock(insts)
            inst = self._pick(runnable)
            inst[2] = None
            try:
                inst[2] = next(inst[1])
            except StopIteration:
                inst[3] = True
                ctx = inst[0]
                if ctx.mma_pending and any(not p.done for p in ctx.mma_pending):
                    p = next(p for p in ctx.mma_pending if not p.done)
                    self.fail(f"role {ctx.label} ends with an mma_async never retired by mma_wait", p.line)

    def _pick(self, runnable):
        if self.schedule == "in_order":
            return runnable[0]
        if self.schedule == "reverse":
            return runnable[-1]
        self.rr += 1
        return runnable[self.rr % len(runnable)]

    def _deadlock(self, insts):
        waiting = [f"{x[0].label} at line {x[2].line} waits on {x[2].desc}" for x in insts if not x[3]]
        done = [x[0].label for x in insts if x[3]]
        first = next(x[2].line for x in insts if not x[3])
        self.fail("deadlock: every unfinished role waits on a barrier no one will complete: "
                  + "; ".join(waiting) + (f" (finished: {', '.join(done)})" if done else ""), first,
                  "check that each waited phase gets its arrivals (arrive / tma_load) and the parities")

    # ================================================================ statements
    def exec_block(self, body, ctx):
        for st in body:
            yield from self.exec_stmt(st, ctx)

    def exec_stmt(self, st, ctx):
        try:
            if isinstance(st, N.Assign):
                self._assign(st, self.eval(st.value, ctx.env, ctx), ctx.env)
            elif isinstance(st, N.AugAssign):
                cur = self._read_name(st.target, ctx.env, st.line)
                ctx.env[st.target] = self.binop(st.op, cur, self.eval(st.value, ctx.env, ctx), st.line)
            elif isinstance(st, N.ExprStmt):
                if st.value.op == "wait":
                    yield from self._wait(st.value, ctx)
                elif st.value.op == "bar_sync":
                    yield from self._bar_sync(st.value, ctx)
                else:
                    self.eval(st.value, ctx.env, ctx)
                    if self.schedule == "reverse" and st.value.op in ARRIVING_OPS:
                        yield _PREEMPTED
            elif isinstance(st, N.For):
                env = ctx.env
                lo, hi, step = (int(self._uniform(self.eval(e, env, ctx), st.line)) for e in (st.start, st.stop, st.step))
                if step == 0:
                    self.fail("range() step is zero", st.line)
                for v in range(lo, hi, step):
                    env[st.var] = v
                    yield from self.exec_block(st.body, ctx)
            elif isinstance(st, N.If):
                test = self._uniform(self.eval(st.test, ctx.env, ctx), st.line)
                yield from self.exec_block(st.body if test else st.orelse, ctx)
            elif isinstance(st, N.Region):
                if ctx.index == 0:   # count per block, not per role instance
                    self.counters.regions[st.name] = self.counters.regions.get(st.name, 0) + self.lane_count
                ctx.regions.append(st.name)
                try:
                    yield from self.exec_block(st.body, ctx)
                finally:
                    ctx.regions.pop()
            elif isinstance(st, N.Role):
                self.fail("roles can only appear at the top level of the block body", st.line)
            elif isinstance(st, N.Doc):
                pass
        except CuIRError:
            raise
        except Exception as e:  # a torch error in an op: report it at the statement
            raise CuIRRuntimeError(f"{type(e).__name__}: {e}", line=st.line, source=self.p.source) from None

    def _assign(self, st, value, env):
        if len(st.targets) == 1:
            if isinstance(value, (SmemBuffer, Barrier, BarrierArray)) and value.name == "?":
                value.name = st.targets[0]
                for i, bar in enumerate(getattr(value, "bars", [])):
                    bar.name = f"{st.targets[0]}[{i}]"
            env[st.targets[0]] = value
            return
        if not isinstance(value, (tuple, list)) or len(value) != len(st.targets):
            self.fail(f"cannot unpack into {len(st.targets)} names", st.line)
        for t, v in zip(st.targets, value):
            env[t] = v

    def _wait(self, call, ctx):
        bar = self._barrier(self.eval(call.args[0], ctx.env, ctx), call.line)
        parity = int(self._uniform(self.eval(call.args[1], ctx.env, ctx), call.line))
        if parity not in (0, 1):
            self.fail(f"wait parity must be 0 or 1, got {parity}", call.line)
        if not bar.ready(parity):
            yield _Blocked(lambda: bar.ready(parity), call.line, lambda: self._wait_desc(bar, parity, ctx))
        ctx.observed[id(bar)] = max(ctx.observed.get(id(bar), -1), bar.observed_phase(parity))

    def _bar_sync(self, call, ctx):
        bar = self._barrier(self.eval(call.args[0], ctx.env, ctx), call.line)
        ctx.sync_epoch += 1          # a named barrier orders this role's warps too
        phase = bar.arrive()
        if bar.completed <= phase:
            yield _Blocked(lambda: bar.completed > phase, call.line,
                           lambda: f"{bar.name} (bar_sync: {bar.arrivals}/{bar.count} arrivals in phase {phase})")

    @staticmethod
    def _wait_desc(bar, parity, ctx) -> str:
        text = (f"{bar.name} parity {parity} ({bar.completed} phases done, "
                f"{bar.arrivals}/{bar.count} arrivals in the current one"
                + (f", the latest from line {bar.last_line})" if bar.last_line else ")"))
        seen = ctx.observed.get(id(bar), -1)
        if bar.completed - 2 > seen:
            # A phase of this parity completed unseen and the next one completed too: the parity
            # wait cannot tell them apart, and the slot that phase filled was overwritten.
            text += (f"; {ctx.label} never observed phase {bar.completed - 2} before phase "
                     f"{bar.completed - 1} completed: the slot it guarded was overwritten before this "
                     "role could read it (a producer refilling a slot without waiting for its release: missing "
                     "empty-barrier wait?)")
        return text

    # ================================================================ expressions
    def eval(self, e, env, ctx):
        if isinstance(e, N.Const):
            return e.value
        if isinstance(e, N.Name):
            return self._read_name(e.id, env, e.line)
        if isinstance(e, N.BinOp):
            return self.binop(e.op, self.eval(e.left, env, ctx), self.eval(e.right, env, ctx), e.line)
        if isinstance(e, N.Compare):
            return self.binop(e.op, self.eval(e.left, env, ctx), self.eval(e.right, env, ctx), e.line)
        if isinstance(e, N.UnaryOp):
            v = self.eval(e.operand, env, ctx)
            if e.op == "-":
                return -v
            if e.op == "~":
                return ~v if isinstance(v, torch.Tensor) else (not v if isinstance(v, bool) else ~v)
            return not self._uniform(v, e.line)
        if isinstance(e, N.BoolOp):
            result = None
            for sub in e.values:
                result = self._uniform(self.eval(sub, env, ctx), e.line)
                if (e.op == "and") != bool(result):
                    return result
            return result
        if isinstance(e, N.IfExp):
            test = self._uniform(self.eval(e.test, env, ctx), e.line)
            return self.eval(e.body if test else e.orelse, env, ctx)
        if isinstance(e, N.Seq):
            return [self.eval(i, env, ctx) for i in e.items]
        if isinstance(e, N.Subscript):
            return self._subscript(e, env, ctx)
        if isinstance(e, N.Call):
            from cubridge.cuir import ops
            return ops.call(self, e, env, ctx)
        self.fail(f"cannot evaluate {type(e).__name__}", getattr(e, "line", None))

    def _read_name(self, name, env, line):
        try:
            v = env[name]
        except KeyError:
            self.fail(f"name {name!r} is not defined", line, "assign it before use (names are per role)")
        if isinstance(v, Pending):
            if not v.done:
                self.fail(f"read of {name!r}, the result of mma_async at line {v.line}, before an mma_wait "
                          "retired it", line, "insert mma_wait(0) before using the result")
            return v.value
        return v

    def _subscript(self, e, env, ctx):
        base = self._read_name(e.value.id, env, e.line)
        items = []
        for ix in e.index:
            if isinstance(ix, N.Slice):
                lo = 0 if ix.lower is None else int(self._uniform(self.eval(ix.lower, env, ctx), e.line))
                hi = None if ix.upper is None else int(self._uniform(self.eval(ix.upper, env, ctx), e.line))
                items.append((lo, hi))
            else:
                items.append(self.eval(ix, env, ctx))
        if isinstance(base, GTensor):
            if len(items) != base.data.dim():
                self.fail(f"{base.name} has {base.data.dim()} dims, indexed with {len(items)}", e.line)
            norm = []
            for d, it in enumerate(items):
                if isinstance(it, tuple):
                    norm.append((it[0], base.data.shape[d] if it[1] is None else it[1]))
                else:
                    norm.append(it)
            return GView(base, tuple(norm))
        if isinstance(base, SmemBuffer):
            out = []
            for d, it in enumerate(items):
                n = base.shape[d]
                if isinstance(it, tuple):
                    lo, hi = it[0], n if it[1] is None else it[1]
                    if not 0 <= lo <= hi <= n:
                        self.fail(f"slice {lo}:{hi} out of range for {base.name} dim {d} of size {n}", e.line)
                    out.append((lo, hi))
                else:
                    i = int(self._uniform(it, e.line))
                    if not 0 <= i < n:
                        self.fail(f"index {i} out of range for {base.name} dim {d} of size {n}", e.line)
                    out.append(i)
            return SmemView(base, tuple(out))
        if isinstance(base, BarrierArray):
            i = int(self._uniform(items[0], e.line))
            if len(items) != 1 or not 0 <= i < len(base):
                self.fail(f"barrier index {i} out of range for {base.name} of {len(base)}", e.line)
            return base.bars[i]
        self.fail(f"{e.value.id} cannot be indexed", e.line,
                  "only global tensors, shared buffers and barrier arrays take subscripts")

    def _barrier(self, v, line) -> Barrier:
        if isinstance(v, Barrier):
            return v
        if isinstance(v, BarrierArray) and len(v) == 1:
            return v.bars[0]
        self.fail("expected a barrier (an mbarrier, or one element of an mbarrier array)", line)

    def _uniform(self, v, line):
        """A control value: must be the same for every lane run together."""
        if isinstance(v, torch.Tensor):
            flat = v.reshape(-1)
            if flat.numel() == 0:
                self.fail("empty value in a control position", line)
            if flat.numel() > 1 and not bool((flat == flat[0]).all()):
                self.fail("control flow depends on a value that differs between blocks run together",
                          line, "this is an interpreter limitation: run with vectorise=False")
            return flat[0].item()
        return v

    # ---------------------------------------------------------------- arithmetic
    def align(self, a, b):
        """Broadcast two lane-carrying tensors: equal lane dims, tile dims right-aligned."""
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return a, b
        ra, rb = a.dim() - self.nl, b.dim() - self.nl
        if ra < rb:
            a = a.reshape(a.shape[: self.nl] + (1,) * (rb - ra) + a.shape[self.nl:])
        elif rb < ra:
            b = b.reshape(b.shape[: self.nl] + (1,) * (ra - rb) + b.shape[self.nl:])
        return a, b

    def binop(self, op, a, b, line):
        if isinstance(a, (GTensor, GView, SmemBuffer, SmemView)) or isinstance(b, (GTensor, GView, SmemBuffer, SmemView)):
            self.fail(f"operator {op} on a memory buffer", line,
                      "load(...) a tile into registers first, or pass the buffer to mma")
        a, b = self.align(a, b)
        t = isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)
        if op == "+": return a + b
        if op == "-": return a - b
        if op == "*": return a * b
        if op == "/": return a / b
        if op == "//":
            return torch.div(a, b, rounding_mode="floor") if t else a // b
        if op == "%":
            return torch.remainder(a, b) if t else a % b
        if op == "&": return a & b
        if op == "|": return a | b
        if op == "^": return a ^ b
        if op == "<<": return a << b
        if op == ">>": return a >> b      # arithmetic, as torch's and CUDA's >> of a signed int
        if op == "<": return a < b
        if op == "<=": return a <= b
        if op == ">": return a > b
        if op == ">=": return a >= b
        if op == "==": return a == b
        if op == "!=": return a != b
        self.fail(f"unknown operator {op}", line)

    def lanes(self, x: torch.Tensor) -> torch.Tensor:
        """Give a lane-less tile (a fresh tensor) its lane dims of size 1."""
        return x.reshape((1,) * self.nl + tuple(x.shape))

    def as_lane_scalar(self, v):
        """A scalar or lane tensor as a tensor with exactly nl dims."""
        if isinstance(v, torch.Tensor):
            return v.reshape(v.shape[: self.nl]) if v.dim() > self.nl else v
        return torch.full((1,) * self.nl, v, dtype=torch.int64 if isinstance(v, int) else torch.float32)

