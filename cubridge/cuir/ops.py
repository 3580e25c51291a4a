"""Meaning of every CuIR op call (the statement-level control flow lives in interp.py).

Each function takes the interpreter, the call node, the environment and the running role, and
returns the op's value (None for statement ops). Precision: register tiles are fp32; mma rounds
its operands to the kernel's 16-bit dtype and accumulates in fp32; shared memory and global
outputs hold values rounded to their declared dtype.
"""
from __future__ import annotations

import math

import torch

from cubridge.cuir import nodes as N
from cubridge.cuir.values import (BYTES, UNWRITTEN, Barrier, BarrierArray, DType, GView, Pending,
                                  SmemBuffer, SmemView, round_to)

_UNARY_T = {"exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
            "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "abs": torch.abs,
            "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "erf": torch.erf}
_UNARY_S = {"exp": math.exp, "exp2": lambda x: 2.0 ** x, "log": math.log, "log2": math.log2,
            "tanh": math.tanh, "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "relu": lambda x: max(x, 0.0),
            "abs": abs, "sqrt": math.sqrt, "rsqrt": lambda x: 1.0 / math.sqrt(x), "erf": math.erf}
_INT_PRESERVING = ("abs", "relu")     # of integers: integers (torch.abs / relu keep the dtype)


def call(it, e: N.Call, env, ctx):
    fn = _TABLE.get(e.op)
    if fn is None:
        it.fail(f"op {e.op!r} cannot be used here", e.line,
                "declarations (kernel, param, global_input, global_output, grid) belong before the block body")
    args = [it.eval(a, env, ctx) for a in e.args]
    return fn(it, e, args, ctx)


def _need_ctx(it, e, ctx):
    if ctx is None:
        it.fail(f"{e.op}() must run inside the block body", e.line)
    return ctx


def _region(ctx):
    return ctx.regions[-1] if ctx is not None and ctx.regions else None


def _dtype(it, v, e) -> str:
    if not isinstance(v, DType):
        it.fail(f"{e.op}(): expected a dtype (f32, f16, bf16, i32 or T)", e.line)
    return v.name


def _shape(it, v, e) -> tuple[int, ...]:
    if not isinstance(v, list):
        it.fail(f"{e.op}(): the shape must be a list literal such as [BLOCK_M, D]", e.line)
    return tuple(int(it._uniform(x, e.line)) for x in v)


# ------------------------------------------------------------------ declarations inside the block
def smem(it, e, args, ctx):
    dt, shape = _dtype(it, args[0], e), _shape(it, args[1], e)
    data = torch.full(it.lane_shape + shape, float("nan"))
    return SmemBuffer("?", dt, shape, data, [UNWRITTEN] * shape[0], e.line)


def mbarrier(it, e, args, ctx):
    count = int(it._uniform(it.eval(e.kwarg("count", N.Const(1)), ctx.env if ctx else it.env_consts, ctx), e.line))
    n = e.kwarg("n")
    if n is None:
        return Barrier("?", count)
    n = int(it._uniform(it.eval(n, ctx.env if ctx else it.env_consts, ctx), e.line))
    return BarrierArray("?", [Barrier(f"?[{i}]", count) for i in range(n)])


# ------------------------------------------------------------------ tiles
def zeros(it, e, args, ctx):
    dt, shape = _dtype(it, args[0], e), _shape(it, args[1], e)
    return it.lanes(torch.zeros(shape, dtype=torch.int64 if dt == "i32" else torch.float32))


def full(it, e, args, ctx):
    dt, shape = _dtype(it, args[0], e), _shape(it, args[1], e)
    fill = args[2]
    if isinstance(fill, torch.Tensor):
        base = torch.zeros(shape, dtype=torch.float32)
        return it.align(it.lanes(base), fill)[1] + it.lanes(base)
    return it.lanes(torch.full(shape, fill, dtype=torch.int64 if dt == "i32" else torch.float32))


def _index(it, e, args, rows: bool):
    start, n = args[0], int(it._uniform(args[1], e.line))
    ar = torch.arange(n)
    shape = (n, 1) if rows else (1, n)
    s = it.as_lane_scalar(start).reshape(it.as_lane_scalar(start).shape + (1, 1))
    return s + it.lanes(ar.reshape(shape))


def row_index(it, e, args, ctx):
    return _index(it, e, args, True)


def col_index(it, e, args, ctx):
    return _index(it, e, args, False)


def transpose(it, e, args, ctx):
    x = args[0]
    if isinstance(x, SmemView):
        return SmemView(x.buf, x.index, not x.transposed)
    if isinstance(x, SmemBuffer):
        return SmemView(x, (), True)
    if isinstance(x, torch.Tensor) and x.dim() - it.nl == 2:
        return x.transpose(-1, -2)
    it.fail("transpose() takes a 2-D tile", e.line)


def cast(it, e, args, ctx):
    x = _operand(it, args[0], e, ctx)
    dt = _dtype(it, args[1], e)
    if isinstance(x, torch.Tensor):
        return round_to(x, dt)          # to i32: truncation toward zero, as torch's .to(long) and C's int()
    if dt == "i32":
        return int(x)
    return float(x) if dt == "f32" else x


# ------------------------------------------------------------------ memory movement
def _operand(it, v, e, ctx):
    if isinstance(v, SmemBuffer):
        v = SmemView(v, ())
    if isinstance(v, SmemView):
        return it.read_smem(v, _need_ctx(it, e, ctx), e.line)
    if isinstance(v, GView):
        it.fail(f"{e.op}() cannot read global memory directly", e.line, "load(...) the tile first")
    return v


def _smem_view(it, v, e):
    if isinstance(v, SmemBuffer):
        return SmemView(v, ())
    if isinstance(v, SmemView):
        return v
    it.fail(f"{e.op}(): the destination must be a shared-memory buffer or a slot of one", e.line)


def _gview(it, v, e, what="source"):
    if not isinstance(v, GView):
        it.fail(f"{e.op}(): the {what} must be a global tensor tile such as K[b, hk, k0:k0 + BLOCK_N, :]", e.line)
    return v


def load(it, e, args, ctx):
    src = args[0]
    if isinstance(src, GView):
        data = it.gmem_load(src, e.line)
        it.counters.bytes["gmem->reg"] += data[(0,) * it.nl].numel() * BYTES[src.g.dtype] * it.lane_count
        return data
    return _operand(it, src, e, ctx)


def store(it, e, args, ctx):
    dst, value = args
    value = _operand(it, value, e, ctx)
    if isinstance(dst, GView):
        it.gmem_store(dst, value, e.line)
        return None
    view = _smem_view(it, dst, e)
    it.write_smem(view, round_to(value, view.buf.dtype) if isinstance(value, torch.Tensor) else value,
                  ("sync",), e.line)
    it.counters.bytes["reg->smem"] += math.prod(view.shape) * BYTES[view.buf.dtype] * it.lane_count
    return None


def _async_copy(it, e, dst, src, token, ctx=None):
    view = _smem_view(it, dst, e)
    src = _gview(it, src, e)
    data = round_to(it.gmem_load(src, e.line), view.buf.dtype)
    if tuple(data.shape[it.nl:]) != view.shape:
        it.fail(f"{e.op}(): source tile {tuple(data.shape[it.nl:])} does not match destination "
                f"{view.buf.name} view {view.shape}", e.line)
    it.check_refill(view, ctx, e)
    it.write_smem(view, data, token, e.line)
    it.counters.bytes["gmem->smem"] += math.prod(view.shape) * BYTES[view.buf.dtype] * it.lane_count


def copy_async(it, e, args, ctx):
    ctx = _need_ctx(it, e, ctx)
    _async_copy(it, e, args[0], args[1], ("group", ctx, ctx.group_open, e.line), ctx)


def commit_group(it, e, args, ctx):
    ctx = _need_ctx(it, e, ctx)
    ctx.groups_committed.append(ctx.group_open)
    ctx.group_open = ctx.next_group
    ctx.next_group += 1


def wait_group(it, e, args, ctx):
    ctx = _need_ctx(it, e, ctx)
    n = int(it._uniform(args[0], e.line))
    keep = ctx.groups_committed[-n:] if n > 0 else []
    for g in ctx.groups_committed:
        if g not in keep and g not in ctx.groups_done:
            ctx.groups_done.add(g)
            ctx.done_epoch[g] = ctx.sync_epoch


def tma_load(it, e, args, ctx):
    ctx = _need_ctx(it, e, ctx)
    bar = it._barrier(args[2], e.line)
    phase = bar.completed            # the phase this copy's arrival belongs to
    _async_copy(it, e, args[0], args[1], ("tma", bar, phase, e.line), ctx)
    bar.arrive()
    bar.last_line = e.line


# ------------------------------------------------------------------ synchronisation
def arrive(it, e, args, ctx):
    _need_ctx(it, e, ctx)
    bar = it._barrier(args[0], e.line)
    bar.arrive()
    bar.last_line = e.line


def sync(it, e, args, ctx):
    # The warps of a role run here as one thread of control: what sync() orders among them (reads
    # of a slot before its refill, other warps' cp.async data) is tracked by epoch (memory.py).
    if ctx is not None:
        ctx.sync_epoch += 1
    return None


def mma_wait(it, e, args, ctx):
    ctx = _need_ctx(it, e, ctx)
    n = int(it._uniform(args[0], e.line))
    live = [p for p in ctx.mma_pending if not p.done]
    for p in live[: max(0, len(live) - n)]:
        p.done = True
    ctx.mma_pending = [p for p in ctx.mma_pending if not p.done]


# ------------------------------------------------------------------ compute
def _mma_value(it, e, args, ctx):
    a = _operand(it, args[0], e, ctx)
    b = _operand(it, args[1], e, ctx)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() - it.nl != 2 or b.dim() - it.nl != 2:
        it.fail(f"{e.op}() takes two 2-D tiles", e.line)
    m, k = a.shape[-2:]
    k2, n = b.shape[-2:]
    if k != k2:
        it.fail(f"{e.op}(): inner dims differ: a is {m}x{k}, b is {k2}x{n}", e.line,
                "for S = Q K^T pass transpose(K_tile) as b")
    a, b = round_to(a, it.T), round_to(b, it.T)
    out = torch.matmul(a, b)
    if len(args) > 2 and args[2] is not None:
        acc = args[2]
        if isinstance(acc, Pending):
            acc = acc.value
        out = acc + out
    it.counters.mma_flops += 2 * m * n * k * it.lane_count
    if _region(ctx) == "qk" and ctx.index == 0:
        it.counters.qk_mmas += it.lane_count
    return out


def mma(it, e, args, ctx):
    return _mma_value(it, e, args, ctx)


def mma_async(it, e, args, ctx):
    ctx = _need_ctx(it, e, ctx)
    p = Pending(_mma_value(it, e, args, ctx), e.line)
    ctx.mma_pending.append(p)
    return p


# ------------------------------------------------------------------ elementwise and reductions
def _unary(name):
    def fn(it, e, args, ctx):
        x = _operand(it, args[0], e, ctx)
        if isinstance(x, torch.Tensor):
            if name in _INT_PRESERVING and not x.is_floating_point() and x.dtype != torch.bool:
                return _UNARY_T[name](x)
            return _UNARY_T[name](x.to(torch.float32) if not x.is_floating_point() else x)
        if name in _INT_PRESERVING and isinstance(x, int) and not isinstance(x, bool):
            return abs(x) if name == "abs" else max(x, 0)
        return _UNARY_S[name](x)
    return fn


def _minmax(torch_fn, py_fn):
    def fn(it, e, args, ctx):
        a, b = (_operand(it, x, e, ctx) for x in args)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            a, b = it.align(*(_as_tensor(x) for x in (a, b)))
            return torch_fn(a, b)
        return py_fn(a, b)
    return fn


def where(it, e, args, ctx):
    c, a, b = (_operand(it, x, e, ctx) for x in args)
    if _region(ctx) == "mask" and ctx.index == 0:
        it.counters.masked_tiles += it.lane_count
    if not any(isinstance(x, torch.Tensor) for x in (c, a, b)):
        return a if c else b
    c, a = it.align(c, a) if isinstance(a, torch.Tensor) else (c, a)
    c, b = it.align(c, b) if isinstance(b, torch.Tensor) else (c, b)
    a, b = it.align(a, b)
    return torch.where(_as_tensor(c).bool(), _as_tensor(a), _as_tensor(b))


def _as_tensor(x):
    """A Python number as a tensor of its kind: ints stay int64 (a where / maximum of integer
    tiles with an integer constant is an integer tile, usable as a gather index), bools bool."""
    if isinstance(x, torch.Tensor):
        return x
    dt = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float32
    return torch.tensor(x, dtype=dt)


def _reduce(torch_fn):
    def fn(it, e, args, ctx):
        x = _operand(it, args[0], e, ctx)
        if not isinstance(x, torch.Tensor) or x.dim() - it.nl != 2:
            it.fail(f"{e.op}() takes a 2-D tile and reduces its rows to [M, 1]", e.line)
        return torch_fn(x)
    return fn


def cdiv(it, e, args, ctx):
    a, b = args
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.div(a + b - 1, b, rounding_mode="floor")
    return -(-a // b)


def _scalar_minmax(torch_fn, py_fn):
    def fn(it, e, args, ctx):
        a, b = args
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return torch_fn(torch.as_tensor(a), torch.as_tensor(b))
        return py_fn(a, b)
    return fn


def gather(it, e, args, ctx):
    g, idx = args[0], args[1:]
    from cubridge.cuir.values import GTensor
    if not isinstance(g, GTensor):
        it.fail("gather(table, *indices): the table must be a global tensor", e.line)
    if len(idx) != g.data.dim():
        it.fail(f"gather(): {g.name} has {g.data.dim()} dims, got {len(idx)} indices", e.line)
    tensors = []
    for d, ix in enumerate(idx):
        t = ix if isinstance(ix, torch.Tensor) else it.as_lane_scalar(ix)
        if t.is_floating_point():
            it.fail(f"gather(): index {d} of {g.name} is not an integer", e.line)
        tensors.append(t.clamp(0, g.data.shape[d] - 1))
    # align tile ranks, then broadcast: lanes first, tile dims right-aligned
    rank = max(t.dim() for t in tensors)
    tensors = [t.reshape(t.shape[: it.nl] + (1,) * (rank - t.dim()) + t.shape[it.nl:]) for t in tensors]
    out = g.data[tuple(tensors)]
    it.counters.bytes["gmem->reg"] += out.numel() * BYTES[g.dtype]
    return out


def _grid_in_block(it, e, args, ctx):
    it.fail("grid(...) must appear once, before the block body", e.line)


_TABLE = {
    "smem": smem, "mbarrier": mbarrier, "zeros": zeros, "full": full, "row_index": row_index,
    "col_index": col_index, "transpose": transpose, "cast": cast, "load": load, "store": store,
    "copy_async": copy_async, "commit_group": commit_group, "wait_group": wait_group,
    "tma_load": tma_load, "arrive": arrive, "sync": sync, "mma_wait": mma_wait, "mma": mma,
    "mma_async": mma_async, "where": where, "cdiv": cdiv,
    "maximum": _minmax(torch.maximum, max), "minimum": _minmax(torch.minimum, min),
    "min": _scalar_minmax(torch.minimum, min), "max": _scalar_minmax(torch.maximum, max),
    "row_max": _reduce(lambda x: x.amax(dim=-1, keepdim=True)),
    "row_sum": _reduce(lambda x: x.sum(dim=-1, keepdim=True)),
    "grid": _grid_in_block, "gather": gather,
    **{name: _unary(name) for name in _UNARY_T},
}
