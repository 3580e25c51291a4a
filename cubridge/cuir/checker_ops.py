"""Per-op rules of the static checker: argument kinds, shapes, dtypes and memory spaces."""
from __future__ import annotations

from cubridge.cuir import nodes as N
from cubridge.cuir.absval import ELT_BYTES, SIXTEEN_BIT, Bar, Buf, DT, Glob, GView, Scalar, Tile, View


def check_call(ck, e: N.Call, env, line, target=None):
    rule = _RULES.get(e.op)
    if rule is None:
        ck.fail(f"op {e.op!r} cannot be used here", line)
    return rule(ck, e, env, line, target)


def _args(ck, e, env, line):
    return [ck.value(a, env, line) for a in e.args]


def _dt(ck, v, line, op):
    if not isinstance(v, DT):
        ck.fail(f"{op}(): expected a dtype (f32, f16, bf16, i32 or T)", line)
    return v.name


def _shape(ck, v, line, op):
    if not isinstance(v, list) or not all(isinstance(x, Scalar) and isinstance(x.value, int) and x.value > 0 for x in v):
        ck.fail(f"{op}(): the shape must be a list of positive compile-time integers", line,
                "tile sizes come from param(...) and the head dim D")
    return tuple(x.value for x in v)


def _reg(ck, v, line, op, what="operand"):
    """A value usable in registers: a tile, a scalar, or a shared view read by this op."""
    if isinstance(v, Buf):
        v = View(v, v.shape)
    if isinstance(v, View):
        return Tile(v.buf.dtype, v.shape)
    if isinstance(v, (Glob, GView)):
        ck.fail(f"{op}(): the {what} is in global memory", line, "load(...) it first")
    if not isinstance(v, (Tile, Scalar)):
        ck.fail(f"{op}(): the {what} must be a tile or a scalar", line)
    return v


def _view(v):
    return View(v, v.shape) if isinstance(v, Buf) else v


# ------------------------------------------------------------------ declarations
def _global(ck, e, env, line, target):
    dt = _dt(ck, ck.value(e.args[0], env, line), line, e.op)
    if not isinstance(e.args[1], N.Seq):
        ck.fail(f"{e.op}(): the shape must be a list literal", line)
    dims = []
    for x in e.args[1].items:
        if isinstance(x, N.Name) and x.id not in env:
            env[x.id] = Scalar("int", ck.dims.get(x.id))
        v = ck.scalar(x, env, line)
        dims.append(v.value)
    return Glob(target or "?", dt, len(dims), e.op == "global_output", tuple(dims))


def _scalar_input(ck, e, env, line, target):
    dt = _dt(ck, ck.value(e.args[0], env, line), line, e.op)
    return Scalar("int" if dt == "i32" else "float", None)


def _grid(ck, e, env, line, target):
    for a in e.args:
        if ck.scalar(a, env, line).kind != "int":
            ck.fail("grid extents must be integers", line)
    return tuple(Scalar("int", None) for _ in e.args)


def _smem(ck, e, env, line, target):
    dt = _dt(ck, ck.value(e.args[0], env, line), line, "smem")
    shape = _shape(ck, ck.value(e.args[1], env, line), line, "smem")
    n = 1
    for s in shape:
        n *= s
    ck.report.buffers[target or "?"] = n * ELT_BYTES[dt]
    ck.report.smem_bytes += n * ELT_BYTES[dt]
    return Buf(target or "?", dt, shape)


def _mbarrier(ck, e, env, line, target):
    count = ck.scalar(e.kwarg("count", N.Const(1)), env, line)
    n = e.kwarg("n")
    nv = ck.scalar(n, env, line).value if n is not None else None
    if count.value is None or count.value < 1 or (n is not None and (nv is None or nv < 1)):
        ck.fail("mbarrier(count=..., n=...) needs positive compile-time integers", line)
    ck.report.smem_bytes += 8 * (nv or 1)
    return Bar(target or "?", nv, count.value)


def _noop(ck, e, env, line, target):
    return None


# ------------------------------------------------------------------ tiles
def _zeros(ck, e, env, line, target):
    a = _args(ck, e, env, line)
    return Tile(_dt(ck, a[0], line, e.op), _shape(ck, a[1], line, e.op))


def _index(ck, e, env, line, target):
    a = _args(ck, e, env, line)
    n = a[1]
    if not isinstance(n, Scalar) or not isinstance(n.value, int):
        ck.fail(f"{e.op}(start, n): n must be a compile-time integer", line)
    if not isinstance(a[0], Scalar) or a[0].kind != "int":
        ck.fail(f"{e.op}(start, n): start must be an integer", line)
    return Tile("i32", (n.value, 1) if e.op == "row_index" else (1, n.value))


def _transpose(ck, e, env, line, target):
    v = _view(ck.value(e.args[0], env, line))
    if not isinstance(v, (Tile, View)) or len(v.shape) != 2:
        ck.fail("transpose() takes a 2-D tile", line)
    shape = (v.shape[1], v.shape[0])
    return View(v.buf, shape) if isinstance(v, View) else Tile(v.dtype, shape)


def _cast(ck, e, env, line, target):
    a = _args(ck, e, env, line)
    v = _reg(ck, a[0], line, "cast")
    dt = _dt(ck, a[1], line, "cast")
    if isinstance(v, Tile):
        return Tile(dt, v.shape)
    return Scalar("int" if dt == "i32" else "float", None)      # cast(x, i32) truncates, as C and torch do


# ------------------------------------------------------------------ memory
def _load(ck, e, env, line, target):
    src = _view(ck.value(e.args[0], env, line))
    if isinstance(src, GView):
        return Tile(src.g.dtype, src.shape)
    if isinstance(src, View):
        return Tile(src.buf.dtype, src.shape)
    ck.fail("load(): the source must be a global or shared tile", line)


def _store(ck, e, env, line, target):
    dst, val = _view(ck.value(e.args[0], env, line)), ck.value(e.args[1], env, line)
    val = _reg(ck, val, line, "store", "value")
    if isinstance(dst, GView):
        if not dst.g.is_output:
            ck.fail(f"store into input {dst.g.name}", line, "inputs are read-only; declare a global_output")
        dt = dst.g.dtype
    elif isinstance(dst, View):
        dt = dst.buf.dtype
    else:
        ck.fail("store(): the destination must be a global or shared tile", line)
    if isinstance(val, Tile):
        shape = val.shape
        while len(shape) > len(dst.shape) and shape[-1] == 1:
            shape = shape[:-1]
        if len(shape) != len(dst.shape) or any(a not in (1, b) for a, b in zip(shape, dst.shape)):
            ck.fail(f"store(): value shape {list(val.shape)} does not match the destination {list(dst.shape)}", line)
        if val.dtype != dt and not (val.dtype == "bool" and dt == "i32"):
            ck.fail(f"store(): value is {val.dtype} but the destination is {dt}", line,
                    f"round explicitly: cast(x, {'T' if dt in SIXTEEN_BIT else dt})")
    return None


def _copy(ck, e, env, line, target):
    a = [_view(x) for x in _args(ck, e, env, line)]
    dst, src = a[0], a[1]
    if not isinstance(dst, View):
        ck.fail(f"{e.op}(): the destination must be shared memory", line)
    if not isinstance(src, GView):
        ck.fail(f"{e.op}(): the source must be a global tile", line)
    if tuple(dst.shape) != tuple(src.shape):
        ck.fail(f"{e.op}(): source tile {list(src.shape)} does not match destination {list(dst.shape)}", line)
    if dst.buf.dtype != src.g.dtype:
        ck.fail(f"{e.op}(): copies do not convert: source {src.g.dtype}, destination {dst.buf.dtype}", line)
    if e.op == "tma_load" and not isinstance(a[2], Bar) or (e.op == "tma_load" and a[2].n is not None):
        ck.fail("tma_load(dst, src, barrier): the third argument must be one mbarrier", line)
    return None


def _int_arg(ck, e, env, line, target):
    v = ck.scalar(e.args[0], env, line)
    if v.kind != "int" or v.value is None or v.value < 0:
        ck.fail(f"{e.op}(n): n must be a non-negative compile-time integer", line)
    return None


def _barrier_arg(ck, e, env, line, target):
    a = _args(ck, e, env, line)
    if not isinstance(a[0], Bar) or a[0].n is not None:
        ck.fail(f"{e.op}(): the first argument must be one mbarrier (index a barrier array)", line)
    if e.op == "wait" and (not isinstance(a[1], Scalar) or a[1].kind != "int"):
        ck.fail("wait(barrier, parity): parity must be an integer 0 or 1", line)
    return None


# ------------------------------------------------------------------ compute
def _mma(ck, e, env, line, target):
    a = [_view(x) if x is not None else None for x in _args(ck, e, env, line)]
    for i, v in enumerate(a[:2]):
        if not isinstance(v, (Tile, View)) or len(v.shape) != 2:
            ck.fail(f"{e.op}(): operand {'ab'[i]} must be a 2-D tile", line)
        dt = v.buf.dtype if isinstance(v, View) else v.dtype
        if dt not in SIXTEEN_BIT:
            ck.fail(f"{e.op}(): operand {'ab'[i]} is {dt}; tensor cores take 16-bit operands", line,
                    "cast(x, T) first")
    if e.op == "mma_async" and not isinstance(a[1], View):
        ck.fail("mma_async(): operand b must be in shared memory (wgmma reads B from shared memory)", line)
    (m, k), (k2, n) = a[0].shape, a[1].shape
    if k != k2:
        ck.fail(f"{e.op}(): inner dims differ: a is {m}x{k}, b is {k2}x{n}", line,
                "for S = Q K^T pass transpose(K_tile) as b")
    if len(a) > 2 and a[2] is not None:
        acc = a[2]
        if not isinstance(acc, Tile) or acc.dtype != "f32" or acc.shape != (m, n):
            ck.fail(f"{e.op}(): the accumulator must be an f32 [{m}, {n}] tile, got "
                    f"{acc.dtype + ' ' + str(list(acc.shape)) if isinstance(acc, Tile) else type(acc).__name__}", line)
    return Tile("f32", (m, n))


def _is_int(v) -> bool:
    return v.dtype == "i32" if isinstance(v, Tile) else v.kind == "int"


def _typed(vals, shapes_of, ck, line, op, dtype):
    """The result of an elementwise op on `vals` (tiles / scalars) with element type `dtype`."""
    tiles = [v for v in shapes_of if isinstance(v, Tile)]
    if not tiles:
        return Scalar({"i32": "int", "bool": "bool"}.get(dtype, "float"), None)
    return Tile(dtype, ck.broadcast([v.shape for v in tiles], line, op))


def _unary(ck, e, env, line, target):
    v = _reg(ck, ck.value(e.args[0], env, line), line, e.op)
    # abs and relu of integers stay integers (an index computed as |iq - ik| is still an index)
    dt = "i32" if e.op in ("abs", "relu") and _is_int(v) else "f32"
    return _typed([v], [v], ck, line, e.op, dt)


def _binary(ck, e, env, line, target):
    a, b = (_reg(ck, x, line, e.op) for x in _args(ck, e, env, line))
    return _typed([a, b], [a, b], ck, line, e.op, "i32" if _is_int(a) and _is_int(b) else "f32")


def _is_bool(v) -> bool:
    return v.dtype == "bool" if isinstance(v, Tile) else v.kind == "bool"


def _where(ck, e, env, line, target):
    c, a, b = (_reg(ck, x, line, "where") for x in _args(ck, e, env, line))
    if isinstance(c, Tile) and c.dtype != "bool":
        ck.fail("where(cond, a, b): cond must be a boolean tile (a comparison)", line,
                "compare it: where(x != 0, a, b)")
    dt = "i32" if _is_int(a) and _is_int(b) else "bool" if _is_bool(a) and _is_bool(b) else "f32"
    return _typed([c, a, b], [c, a, b], ck, line, "where", dt)


def _reduce(ck, e, env, line, target):
    v = _reg(ck, ck.value(e.args[0], env, line), line, e.op)
    if not isinstance(v, Tile) or len(v.shape) != 2:
        ck.fail(f"{e.op}() takes a 2-D tile", line)
    return Tile("f32", (v.shape[0], 1))


def _scalar2(ck, e, env, line, target):
    a, b = _args(ck, e, env, line)
    if not (isinstance(a, Scalar) and isinstance(b, Scalar)):
        ck.fail(f"{e.op}() works on scalars", line, "use maximum/minimum on tiles")
    if e.op == "cdiv":
        return Scalar("int", -(-a.value // b.value) if a.value is not None and b.value is not None else None)
    fn = min if e.op == "min" else max
    kind = "float" if "float" in (a.kind, b.kind) else "int"
    return Scalar(kind, fn(a.value, b.value) if a.value is not None and b.value is not None else None)


def _gather(ck, e, env, line, target):
    a = _args(ck, e, env, line)
    g = a[0]
    if not isinstance(g, Glob):
        ck.fail("gather(table, *indices): the table must be a global tensor", line)
    if len(a) - 1 != g.rank:
        ck.fail(f"gather(): {g.name} has {g.rank} dims, got {len(a) - 1} indices", line)
    shapes = []
    for v in a[1:]:
        if isinstance(v, Tile):
            if v.dtype not in ("i32", "bool"):
                ck.fail("gather(): index tiles must be integers", line)
            shapes.append(v.shape)
        elif not (isinstance(v, Scalar) and v.kind == "int"):
            ck.fail("gather(): indices must be integer scalars or tiles", line)
    if not shapes:
        return Scalar("int" if g.dtype == "i32" else "float", None)
    return Tile(g.dtype, ck.broadcast(shapes, line, "gather"))


_RULES = {
    "gather": _gather,
    "kernel": _noop, "param": _noop, "global_input": _global, "scalar_input": _scalar_input, "global_output": _global, "grid": _grid,
    "smem": _smem, "mbarrier": _mbarrier, "zeros": _zeros, "full": _zeros, "row_index": _index,
    "col_index": _index, "transpose": _transpose, "cast": _cast, "load": _load, "store": _store,
    "copy_async": _copy, "tma_load": _copy, "commit_group": _noop, "wait_group": _int_arg,
    "mma_wait": _int_arg, "arrive": _barrier_arg, "wait": _barrier_arg, "bar_sync": _barrier_arg, "sync": _noop,
    "mma": _mma, "mma_async": _mma, "where": _where, "row_max": _reduce, "row_sum": _reduce,
    "maximum": _binary, "minimum": _binary, "cdiv": _scalar2, "min": _scalar2, "max": _scalar2,
    **{k: _unary for k in ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "relu", "abs", "sqrt", "rsqrt", "erf")},
}
