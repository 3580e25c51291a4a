"""Runtime inputs of a spec: tensors each call supplies (document ids, prefix lengths, a bias table).

A spec declares them in `RUNTIME_INPUTS`, name -> shape (a tuple of size symbols) or a
`RuntimeInput(shape, dtype, kind)`. Size symbols: B, Hq, Hkv, Nk (N is the same as Nk), an int, or
a named size such as "buckets" (taken from PARAMS when it has that name, else from the tensors of the
call, which must agree). Nq is not a size symbol: a query sits at its absolute key position q_idx,
so per-position data is declared over Nk and read at q_idx. `reference(...)` and `hooks(...)` get each
runtime input as a keyword argument, like a param; mods read them like captured tensors.

`check(...)` refuses a call's tensors with a message naming the argument, what was expected, what
came, and the fix. `sample(...)` makes representative values for tuning and verification, from the
spec's `sample_runtime_inputs(Nq, Nk, Hq, Hkv, B, device, generator, **params)` when it has one,
else per declared kind:
- "segments": sorted ids of documents packed along the sequence, 100-2000 tokens each (shorter at
  short N, so that boundaries fall inside tiles);
- "positions": integers in [0, Nk] (per-sequence lengths, prefix ends);
- "normal": standard normal floats; "mask": random booleans.

Example:
    >>> spec = {"doc_ids": RuntimeInput(("B", "Nk"))}
    >>> ids = sample(spec, Nq=8, Nk=300, Hq=2, Hkv=1, B=1)["doc_ids"]
    >>> ids.shape, ids.dtype, bool((ids[:, 1:] >= ids[:, :-1]).all())
    (torch.Size([1, 300]), torch.int32, True)
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from cubridge.errors import LaunchError, SpecError

DTYPES = {"int32": torch.int32, "int64": torch.int64, "bool": torch.bool, "float32": torch.float32}
KINDS = ("segments", "positions", "normal", "mask")
SHAPE_SYMBOLS = ("B", "Hq", "Hkv", "Nk", "N")
# Document lengths of the "segments" kind at long N: short enough that an 8k sequence holds several
# documents, long enough that most KV tiles are full or empty rather than partial.
SEGMENT_TOKENS = (100, 2000)


@dataclass(frozen=True)
class RuntimeInput:
    """One declared runtime input: its symbolic shape, element type and how to sample it."""
    shape: tuple
    dtype: str = "int32"
    kind: str | None = None          # None: "segments" for ints over Nk, "positions" for other
    #                                  ints, "normal" for floats, "mask" for bools

    @property
    def sampling(self) -> str:
        if self.kind is not None:
            return self.kind
        if self.dtype == "bool":
            return "mask"
        if self.dtype.startswith("float"):
            return "normal"
        return "segments" if self.shape and self.shape[-1] in ("Nk", "N") else "positions"

    @property
    def family(self) -> str:
        """What a call may pass: any integer, any floating point, or bool tensor."""
        return "bool" if self.dtype == "bool" else "float" if self.dtype.startswith("float") else "int"


def declare(raw, params: dict, where: str) -> dict[str, RuntimeInput]:
    """The checked RUNTIME_INPUTS of a spec module (raw as written there)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"RUNTIME_INPUTS is a {type(raw).__name__}, not a dict", where=where,
                        hint='write RUNTIME_INPUTS = {"doc_ids": ("B", "Nk")}')
    out = {}
    for name, decl in raw.items():
        item = decl if isinstance(decl, RuntimeInput) else RuntimeInput(tuple(decl))
        _check_decl(name, item, params, where)
        out[name] = item
    return out


def _check_decl(name, item: RuntimeInput, params: dict, where: str):
    def bad(what, hint):
        raise SpecError(f"RUNTIME_INPUTS[{name!r}]: {what}", where=where, hint=hint)
    if not name.isidentifier() or name in params:
        bad("not a Python identifier, or also a PARAMS name", "use a fresh keyword name, e.g. doc_ids")
    if item.dtype not in DTYPES:
        bad(f"dtype {item.dtype!r}", f"use one of {', '.join(DTYPES)}")
    if item.kind is not None and item.kind not in KINDS:
        bad(f"kind {item.kind!r}", f"use one of {', '.join(KINDS)}")
    for d in item.shape:
        if d == "Nq":
            bad("a size Nq", "queries sit at their absolute key position q_idx: declare per-position "
                "data over Nk and read it at q_idx")
        if not (isinstance(d, int) and d > 0) and not (isinstance(d, str) and d.isidentifier()):
            bad(f"size {d!r}", f"use {', '.join(SHAPE_SYMBOLS)}, a positive int or a named size")


def check_query_length(Nq: int, Nk: int, where: str):
    """Queries are aligned to the end of the keys (query i at position Nk - Nq + i), so there can
    be no more queries than keys."""
    if Nq > Nk:
        raise SpecError(f"Nq={Nq} > Nk={Nk}: queries are aligned to the end of the keys (query i sits "
                        f"at position Nk - Nq + i), so Nq may not exceed Nk", where=where,
                        hint="give at least as many keys as queries (a KV-cache prefill has Nq <= Nk)")


def sizes(Nk: int, Hq: int, Hkv: int, B: int) -> dict:
    return {"B": B, "Hq": Hq, "Hkv": Hkv, "Nk": Nk, "N": Nk}


def expected_shape(item: RuntimeInput, known: dict) -> tuple:
    return tuple(d if isinstance(d, int) else known.get(d) for d in item.shape)


def check(declared: dict, runtime: dict, *, Nk, Hq, Hkv, B, params: dict, device) -> dict:
    """The call's runtime tensors, checked against the declaration; returns them by name. Named
    sizes not fixed by params are learnt from the first tensor that has them."""
    missing = [n for n in declared if n not in runtime]
    if missing:
        raise LaunchError(f"missing runtime input(s) {', '.join(missing)}", where="runtime inputs",
                          hint=f"pass {', '.join(f'{n}=<tensor {_fmt(declared[n].shape)}>' for n in missing)} "
                               "as keyword arguments of the call")
    extra = sorted(set(runtime) - set(declared))
    if extra:
        allowed = ", ".join(declared) or "none"
        raise LaunchError(f"unexpected runtime input(s) {', '.join(extra)}", where="runtime inputs",
                          hint=f"this spec declares: {allowed}; drop the others")
    known = {**sizes(Nk, Hq, Hkv, B), **{k: v for k, v in params.items() if isinstance(v, int)}}
    for name, item in declared.items():
        _check_one(name, item, runtime[name], known, torch.device(device))
    return {n: runtime[n] for n in declared}


def _check_one(name, item: RuntimeInput, t, known: dict, device):
    if not isinstance(t, torch.Tensor):
        raise LaunchError(f"runtime input {name} is a {type(t).__name__}, not a tensor", where=name,
                          hint=f"pass {name} as a torch tensor of shape {_fmt(item.shape)}")
    want = expected_shape(item, known)
    shape_ok = t.dim() == len(want) and all(w is None or w == s for w, s in zip(want, t.shape))
    if not shape_ok:
        got = ", ".join(f"{d}={known[d]}" for d in item.shape if isinstance(d, str) and d in known)
        raise LaunchError(f"runtime input {name} has shape {list(t.shape)}, expected {_fmt(item.shape)}"
                          f" = {[w if w is not None else '?' for w in want]}", where=name,
                          hint=f"pass {name} with shape {_fmt(item.shape)} at this call ({got})")
    for d, s in zip(item.shape, t.shape):
        if isinstance(d, str) and d not in known:
            known[d] = int(s)
    if _family(t.dtype) != item.family:
        raise LaunchError(f"runtime input {name} has dtype {t.dtype}, expected {item.dtype}", where=name,
                          hint=f"pass {name}.to(torch.{item.dtype}) ({item.family} tensors are accepted)")
    if t.device != device and not (device.type == t.device.type and device.index is None):
        raise LaunchError(f"runtime input {name} is on {t.device}, the call runs on {device}", where=name,
                          hint=f"move it first: {name}.to('{device}')")


def _family(dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def sample(declared: dict, *, Nq: int, Nk: int, Hq: int, Hkv: int, B: int, device="cpu",
           params: dict | None = None, sampler=None, seed: int | None = None) -> dict:
    """Representative values of the runtime inputs at one shape. With seed None the values are a
    function of the shape alone, so that two callers (the kernel's binding and the reference)
    sample the same tensors without passing them around."""
    if not declared:
        return {}
    params = dict(params or {})
    if seed is None:
        seed = zlib.crc32(f"{B},{Hq},{Hkv},{Nq},{Nk}".encode())
    gen = torch.Generator().manual_seed(seed)
    if sampler is not None:
        out = sampler(Nq, Nk, Hq, Hkv, B, torch.device(device), gen, **params)
        return check(declared, out, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params=params, device=device)
    known = {**sizes(Nk, Hq, Hkv, B), **{k: v for k, v in params.items() if isinstance(v, int)}}
    out = {}
    for name, item in declared.items():
        shape = expected_shape(item, known)
        if None in shape:
            raise SpecError(f"runtime input {name}: no value for size(s) "
                            f"{[d for d, s in zip(item.shape, shape) if s is None]} to sample it with",
                            hint="give the size in PARAMS, or define sample_runtime_inputs(...) in the spec")
        out[name] = _sample_one(item, shape, Nk, gen).to(device)
    return out


def _sample_one(item: RuntimeInput, shape: tuple, Nk: int, gen) -> torch.Tensor:
    kind, dtype = item.sampling, DTYPES[item.dtype]
    if kind == "normal":
        return torch.randn(shape, generator=gen).to(dtype)
    if kind == "mask":
        return torch.rand(shape, generator=gen) < 0.5
    if kind == "positions":
        return torch.randint(0, Nk + 1, shape, generator=gen).to(dtype)
    rows = torch.stack([segment_ids(shape[-1], gen) for _ in range(max(1, _prod(shape[:-1])))])
    return rows.reshape(shape).to(dtype)


def segment_ids(n: int, gen) -> torch.Tensor:
    """Sorted document ids 0, 0, ..., 1, 1, ... of random document lengths along n positions."""
    lo = min(SEGMENT_TOKENS[0], max(1, n // 6))
    hi = min(SEGMENT_TOKENS[1], max(lo, n // 2))
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n]


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out
