"""Variant specs: the format, its loader, and a generic eager attention built from a spec's hooks.

A spec is a plain Python file with a required `reference(q, k, v, **params)`, optional `PARAMS`
and FlexAttention-style hooks; cubridge/specs/__init__.py describes the format, and the ten
built-in specs next to it are examples. Layout: q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D]
(query head h reads kv head h // (Hq // Hkv)), out [B, Hq, Nq, D].

Example:
    >>> spec = load_spec("causal")
    >>> spec
    Spec('causal', params={}, hooks=mask_mod, norm=softmax, path='cubridge/specs/causal.py')
    >>> count_attended_pairwise(spec.hooks_for(Nq=4, Nk=4, Hq=1, Hkv=1), B=1, Hq=1, Nq=4, Nk=4)
    10
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import itertools
import math
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from cubridge import inputs as rt
from cubridge.inputs import check_query_length  # noqa: F401 (re-exported)
from cubridge.errors import SpecError
from cubridge.evalmod import mask_values, score_values
from cubridge.specs import BUILTIN, EXAMPLES

NORMALIZATION_KINDS = ("softmax", "sigmoid", "relu")
# count_attended_pairwise evaluates the mask this many elements at a time: 2^26 bools = 64 MiB, which
# fits next to a benchmark's tensors on any GPU and still needs only ~100 chunks at N = 16k.
CHUNK_ELEMS = 1 << 26
# flex_expressible asks a hooks() factory for its normalisation at this small shape.
_PROBE_N = 256
MASK_ARGS = "b, h, q_idx, kv_idx"
SCORE_ARGS = "score, b, h, q_idx, kv_idx"
_module_counter = itertools.count()


@dataclass(frozen=True)
class Normalization:
    """How scores become weights. softmax: row-normalised; sigmoid: p = sigmoid(s + bias);
    relu: p = relu(s) * scale. sigmoid and relu keep no running max, no row sum, no division.
    A masked pair always gives p = 0. (A softcap is a score_mod, not a normalisation.)"""

    kind: str = "softmax"
    bias: float = 0.0
    scale: float = 1.0

    def __post_init__(self):
        if self.kind not in NORMALIZATION_KINDS:
            raise SpecError(f"unknown normalization kind {self.kind!r}",
                            hint=f"use one of {', '.join(NORMALIZATION_KINDS)}, e.g. "
                                 "Normalization('sigmoid', bias=-math.log(N))")
        # A bias on softmax or a scale on sigmoid would be silently ignored: refuse it instead.
        if self.bias != 0.0 and self.kind != "sigmoid":
            raise SpecError(f"bias={self.bias} has no effect on {self.kind}",
                            hint="bias is for 'sigmoid' only; add it to the score in a score_mod")
        if self.scale != 1.0 and self.kind != "relu":
            raise SpecError(f"scale={self.scale} has no effect on {self.kind}",
                            hint="scale is for 'relu' only; scale the score in a score_mod")

    def __repr__(self) -> str:
        if self.kind == "sigmoid":
            return f"sigmoid(bias={self.bias:.4g})"
        if self.kind == "relu":
            return f"relu(scale={self.scale:.4g})"
        return self.kind

    def apply(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Weights p from (score_mod-ed) scores; `mask` broadcasts to scores, True = attended."""
        if self.kind == "softmax":
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        elif self.kind == "sigmoid":
            p = torch.sigmoid(scores + self.bias)
        else:
            p = torch.relu(scores) * self.scale
        # Also turns the NaN of a fully masked softmax row into the 0 the convention asks for.
        return p.masked_fill(~mask, 0.0)


@dataclass(frozen=True)
class Hooks:
    """The structured form of a variant, FlexAttention-compatible: None means no mask / no score
    transform. Mods are torch-only functions that broadcast over index tensors."""

    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    normalization: Normalization = Normalization()

    def __post_init__(self):
        if self.mask_mod is not None:
            _check_signature(self.mask_mod, "mask_mod", MASK_ARGS)
        if self.score_mod is not None:
            _check_signature(self.score_mod, "score_mod", SCORE_ARGS)
        if not isinstance(self.normalization, Normalization):
            raise SpecError(f"normalization is {self.normalization!r}, not a Normalization",
                            hint="use cubridge.spec.Normalization('sigmoid', bias=...)")

    @property
    def flex_expressible(self) -> bool:
        """FlexAttention always normalises with softmax; anything else needs our kernels."""
        return self.normalization.kind == "softmax"

    def for_flex(self, Nq: int, Nk: int) -> "Hooks":
        """The mods as FlexAttention calls them, with q_idx the query row in [0, Nq): ours take the
        query's position (row + Nk - Nq), so the rows are shifted when Nq < Nk."""
        shift = Nk - Nq
        if shift == 0:
            return self
        mask, score = self.mask_mod, self.score_mod
        return Hooks(None if mask is None else (lambda b, h, q, kv: mask(b, h, q + shift, kv)),
                     None if score is None else (lambda x, b, h, q, kv: score(x, b, h, q + shift, kv)),
                     self.normalization)

    def __repr__(self) -> str:
        return (f"Hooks(mask_mod={_fn_name(self.mask_mod)}, score_mod={_fn_name(self.score_mod)}, "
                f"normalization={self.normalization!r})")


@dataclass(frozen=True, repr=False)
class Spec:
    """A loaded variant spec. `params` are the defaults; None values are derived from the shape by
    the spec itself (its docstring says how)."""

    name: str
    path: str
    source: str
    doc: str
    params: dict
    reference: Callable
    factory: Callable | None = None        # the spec's hooks(Nq, Nk, Hq, Hkv, device, **params)
    module_hooks: Hooks | None = None      # from module-level mask_mod / score_mod / NORMALIZATION
    runtime_inputs: dict = field(default_factory=dict)   # name -> inputs.RuntimeInput
    sampler: Callable | None = None        # the spec's sample_runtime_inputs(...), if any

    @property
    def has_hooks(self) -> bool:
        return self.factory is not None or self.module_hooks is not None

    @property
    def flex_expressible(self) -> bool:
        """True iff the normalisation is softmax (FlexAttention can then run the mods)."""
        if not self.has_hooks:
            return False
        return self.hooks_for(_PROBE_N, _PROBE_N, 1, 1).flex_expressible

    def resolved_params(self, **overrides) -> dict[str, Any]:
        """The defaults with `overrides` applied; an unknown name is an error."""
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            allowed = ", ".join(f"{k} (default {v!r})" for k, v in self.params.items())
            raise SpecError(f"unknown param(s) {', '.join(unknown)} for spec {self.name!r}",
                            where=self.path,
                            hint=f"allowed: {allowed}" if allowed else "this spec takes no params")
        for k, v in overrides.items():
            problem = _type_problem(v, self.params[k])
            if problem:
                raise SpecError(f"param {k}={v!r} of spec {self.name!r}: {problem}", where=self.path,
                                hint=f"give {k} a value like its default {self.params[k]!r}")
        return {**self.params, **overrides}

    def run_reference(self, q, k, v, runtime: dict | None = None, **overrides) -> torch.Tensor:
        """reference(q, k, v) with the default params, after checking the overrides' names.

        Queries are aligned to the end of the keys: with Nq < Nk, query row i sits at position
        Nk - Nq + i. The reference is run on the Nk-row problem (q padded at the front) and the
        last Nq rows are kept, so a reference written for Nq == Nk is right at every Nq <= Nk.
        Runtime inputs: `runtime` as the call gives them, or None for the sampled values."""
        params = self.resolved_params(**overrides)
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        check_query_length(Nq, Nk, self.path)
        params.update(self.runtime_for(Nq, Nk, Hq, Hkv, B, q.device, runtime, params))
        if Nq == Nk:
            return self.reference(q, k, v, **params)
        padded = torch.cat([q.new_zeros(B, Hq, Nk - Nq, D), q], dim=2)
        return self.reference(padded, k, v, **params)[:, :, Nk - Nq:]

    def runtime_for(self, Nq, Nk, Hq, Hkv, B, device, runtime: dict | None, params: dict) -> dict:
        """The runtime inputs of a call, checked; None samples representative values (a function
        of the shape, so every caller at one shape sees the same ones)."""
        if runtime is None:
            return rt.sample(self.runtime_inputs, Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, device=device,
                             params=params, sampler=self.sampler)
        return rt.check(self.runtime_inputs, runtime, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params=params,
                        device=device)

    def hooks_for(self, Nq: int, Nk: int, Hq: int, Hkv: int, device="cpu", *, B: int = 1,
                  runtime: dict | None = None, **params) -> Hooks:
        """The hooks at one shape, with captured tensors on `device`; a spec with runtime inputs
        gets `runtime` (checked) or, when None, the values sampled at this shape and batch B."""
        resolved = self.resolved_params(**params)
        _check_heads(Hq, Hkv, self.path)
        if self.factory is not None:
            if self.runtime_inputs:
                resolved.update(self.runtime_for(Nq, Nk, Hq, Hkv, B, torch.device(device), runtime, resolved))
            return self._call_factory(Nq, Nk, Hq, Hkv, torch.device(device), resolved)
        if self.module_hooks is not None:
            return self.module_hooks
        raise SpecError(f"spec {self.name!r} defines only reference(); it has no hooks",
                        where=self.path,
                        hint="the rules proposer needs mask_mod / score_mod / NORMALIZATION or a "
                             "hooks() factory; add them, or use an LLM proposer, which handles "
                             "hook-less specs")

    def picture(self, N: int = 24, h: int = 0, **params) -> str:
        """The mask of query head h at Nq = Nk = N, one row per query."""
        hooks = self.hooks_for(N, N, h + 1, 1, **params)
        return mask_picture(hooks, N, N, h=h)

    def _call_factory(self, Nq, Nk, Hq, Hkv, device, params) -> Hooks:
        try:
            hooks = self.factory(Nq, Nk, Hq, Hkv, device, **params)
        except Exception as exc:
            shown = {k: (f"<tensor {list(v.shape)}>" if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
            call = f"hooks({Nq}, {Nk}, {Hq}, {Hkv}, {device}{_kwargs(shown)})"
            raise _located_error(exc, self.path, call) from exc
        if not isinstance(hooks, Hooks):
            raise SpecError(f"hooks() returned a {type(hooks).__name__}, not a Hooks",
                            where=_where_of(self.factory) or self.path,
                            hint="return cubridge.spec.Hooks(mask_mod=..., score_mod=..., "
                                 "normalization=...) from hooks(Nq, Nk, Hq, Hkv, device, **params)")
        return hooks

    def __repr__(self) -> str:
        if self.factory is not None:
            hooks = "hooks()"
        elif self.module_hooks is not None:
            mods = [m for m in ("mask_mod", "score_mod") if getattr(self.module_hooks, m)]
            hooks = "+".join(mods) or "dense"
            hooks += f", norm={self.module_hooks.normalization!r}"
        else:
            hooks = "none (reference only)"
        path = _short(self.path)
        return f"Spec({self.name!r}, params={self.params!r}, hooks={hooks}, path={path!r})"


def builtin_specs() -> list[str]:
    """The names of the specs shipped in cubridge/specs/, in docs/DESIGN.md order."""
    return list(BUILTIN)


def load_spec(name_or_path) -> Spec:
    """Load a spec from a .py path, a built-in name ("prefixlm") or a dotted module ("pkg.spec").

    Example:
        >>> load_spec("prefixlm").params
        {'prefix': None}
    """
    if isinstance(name_or_path, Spec):
        return name_or_path
    text = os.fspath(name_or_path)
    if _looks_like_path(name_or_path):
        module = _import_file(Path(text))
    elif text in BUILTIN or text in EXAMPLES:
        module = _import_module(f"cubridge.specs.{text}")
    else:
        module = _import_module(text)
    return _spec_from_module(module)


def attention_from_hooks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         hooks: Hooks) -> torch.Tensor:
    """The eager definition of what hooks mean: materialise all scores, apply score_mod, mask_mod
    and the normalisation, in q's dtype. Used to cross-check hooks against a spec's reference.

    Example:
        >>> q = k = v = torch.randn(1, 1, 5, 8, dtype=torch.float64)
        >>> attention_from_hooks(q, k, v, load_spec("causal").hooks_for(5, 5, 1, 1)).shape
        torch.Size([1, 1, 5, 8])
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    _check_heads(Hq, Hkv, "attention_from_hooks")
    k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    check_query_length(Nq, Nk, "attention_from_hooks")
    positions = torch.arange(Nk - Nq, Nk, device=q.device)     # queries aligned to the end of the keys
    b, h, q_idx, kv_idx = index_grids(B, Hq, positions, Nk, q.device)
    if hooks.score_mod is not None:
        # Cast back: a captured float64 table must not silently upcast a bf16 run. score_values
        # evaluates FlexAttention's per-element idioms too.
        scores = score_values(hooks.score_mod, scores, b, h, q_idx, kv_idx).to(scores.dtype)
    mask = _eval_mask(hooks, b, h, q_idx, kv_idx)
    return hooks.normalization.apply(scores, mask) @ v


def count_attended_pairwise(hooks: Hooks, B: int, Hq: int, Nq: int, Nk: int, device="cpu", *,
                            chunk_elems: int = CHUNK_ELEMS) -> int:
    """The exact number of attended (b, h, q, kv) pairs, by evaluating the mask_mod on every pair
    (a block of query rows at a time, so memory stays bounded at N = 16k on a GPU): for masks the
    tracer does not take (transfer.pairs.count_attended counts the others tile by tile), and as
    the check of the tile-by-tile count.

    Example:
        >>> count_attended_pairwise(Hooks(), B=2, Hq=3, Nq=4, Nk=5)
        120
    """
    if hooks.mask_mod is None:
        return B * Hq * Nq * Nk
    rows = max(1, chunk_elems // (B * Hq * Nk))
    total = 0
    for start in range(0, Nq, rows):
        q_rows = torch.arange(start, min(start + rows, Nq), device=device) + (Nk - Nq)   # positions
        mask = _eval_mask(hooks, *index_grids(B, Hq, q_rows, Nk, device))
        total += _broadcast_count(mask, (B, Hq, len(q_rows), Nk))
    return total


def index_grids(B: int, Hq: int, q_rows: torch.Tensor, Nk: int, device):
    """b [B,1,1,1], h [1,Hq,1,1], q_idx [1,1,rows,1], kv_idx [1,1,1,Nk]: they broadcast to the
    score tile, so one call of a mod evaluates it everywhere."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(Hq, device=device).view(1, Hq, 1, 1)
    kv_idx = torch.arange(Nk, device=device).view(1, 1, 1, Nk)
    return b, h, q_rows.to(device).view(1, 1, -1, 1), kv_idx


def mask_picture(hooks: Hooks, Nq: int, Nk: int, b: int = 0, h: int = 0) -> str:
    """One text row per query (at positions Nk - Nq .. Nk - 1): '#' attended, '.' masked."""
    grids = index_grids(b + 1, h + 1, torch.arange(Nk - Nq, Nk), Nk, "cpu")
    mask = _eval_mask(hooks, *grids).expand(b + 1, h + 1, Nq, Nk)[b, h]
    return "\n".join("".join("#" if x else "." for x in row.tolist()) for row in mask)


# ---- evaluation helpers ----------------------------------------------------------------------

def mask_of(hooks: Hooks, b, h, q_idx, kv_idx) -> torch.Tensor:
    """The hooks' mask on index grids (all True without a mask_mod), broadcastable to the scores."""
    return _eval_mask(hooks, b, h, q_idx, kv_idx)


def _eval_mask(hooks: Hooks, b, h, q_idx, kv_idx) -> torch.Tensor:
    if hooks.mask_mod is None:
        return torch.ones((), dtype=torch.bool, device=q_idx.device)
    return mask_values(hooks.mask_mod, b, h, q_idx, kv_idx)


def _broadcast_count(mask: torch.Tensor, full: tuple[int, ...]) -> int:
    # A head-independent mask comes back as [1, 1, rows, Nk]: count it once and multiply instead
    # of materialising B * Hq copies.
    try:
        torch.broadcast_shapes(mask.shape, full)
    except RuntimeError:
        raise SpecError(f"mask_mod returned shape {tuple(mask.shape)}, which does not broadcast "
                        f"to the score tile {full}",
                        hint="build the mask only from b, h, q_idx, kv_idx with elementwise ops"
                        ) from None
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    copies = math.prod(n for n, m in zip(full, shape) if m == 1)
    return int(mask.sum(dtype=torch.int64)) * copies


def _check_heads(Hq: int, Hkv: int, where: str):
    if Hkv <= 0 or Hq % Hkv:
        raise SpecError(f"Hq={Hq} is not a multiple of Hkv={Hkv}", where=where,
                        hint="use Hkv = Hq (MHA), a divisor of Hq (GQA) or 1 (MQA)")


def _check_signature(fn, what: str, args: str, params: dict | None = None, where=None):
    """Refuse `fn` now if calling it as what(args, **params) would fail later, deep in a search."""
    call = f"{what}({args}{_kwargs(params or {})})"
    if not callable(fn):
        raise SpecError(f"`{what}` is a {type(fn).__name__}, not a function", where=where,
                        hint=f"define def {call}: ...")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check
    try:
        sig.bind(*args.split(", "), **(params or {}))
    except TypeError:
        raise SpecError(f"{what} is defined as {_fn_name(fn)}{sig}, but is called as {call}",
                        where=_where_of(fn) or where,
                        hint=f"define it as def {call}: ... (every PARAMS entry is passed as a "
                             "keyword; mods take the FlexAttention arguments)") from None


def _type_problem(value, default) -> str | None:
    """Why `value` cannot stand for a param whose default is `default` (None: it fits). A default
    of None means derived from the shape, a number; an int fits a float default."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if default is None:
        return None if value is None or number(value) else f"expected a number, got {type(value).__name__}"
    if isinstance(default, bool) or not number(default):
        ok = isinstance(value, type(default))
    else:
        ok = number(value) and (isinstance(default, float) or isinstance(value, int))
    return None if ok else f"expected {type(default).__name__}, got {type(value).__name__}"


def _kwargs(params: dict) -> str:
    return "".join(f", {k}={v!r}" for k, v in params.items())


def _fn_name(fn) -> str:
    return "None" if fn is None else getattr(fn, "__name__", type(fn).__name__)


def _where_of(fn) -> str | None:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f"{_short(code.co_filename)}:{code.co_firstlineno}" if code else None


def _short(path: str) -> str:
    """Paths under the working directory print relative: shorter reprs and messages."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else path
    except (ValueError, OSError):
        return path


# ---- loading ---------------------------------------------------------------------------------

def _looks_like_path(name_or_path) -> bool:
    text = os.fspath(name_or_path)
    return (isinstance(name_or_path, os.PathLike) or text.endswith(".py")
            or os.sep in text or "/" in text)


def _not_found(what: str, where: str) -> SpecError:
    stem = Path(where).stem if where.endswith(".py") else where.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(stem, BUILTIN, n=1)
    maybe = f" (did you mean {close[0]!r}?)" if close else ""
    return SpecError(f"{what} not found{maybe}", where=where,
                     hint=f"give a path to a spec .py file, a dotted module name on sys.path, or a "
                          f"built-in name: {', '.join(BUILTIN)}")


def _import_file(path: Path):
    if not path.is_file():
        raise _not_found("spec file", str(path))
    # A fresh unique name per load: two files with the same stem never collide, and loading an
    # edited file again re-executes it.
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_cubridge_spec_{stem}_{next(_module_counter)}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling inside the spec look it up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _located_error(exc, str(path), "importing the spec") from exc
    return module


def _import_module(name: str):
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        found = None  # a parent package is missing
    except Exception as exc:
        raise _located_error(exc, name, f"importing the parent package of {name}") from exc
    if found is None:
        what = "built-in spec or module" if "." not in name else "spec module"
        raise _not_found(f"{what} {name!r}", name)
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise _located_error(exc, found.origin or name, "importing the spec") from exc


def _located_error(exc: Exception, path: str, doing: str) -> SpecError:
    """A SpecError pointing at the line of the spec file where `exc` happened."""
    line, text = _error_line(exc, path)
    where = f"{_short(path)}:{line}" if line else _short(path)
    if isinstance(exc, SpecError):
        return SpecError(exc.message, where=exc.where or where, hint=exc.hint)
    at = f"line {line} of the spec (`{text}`)" if text else _short(path)
    return SpecError(f"{doing} raised {type(exc).__name__}: {exc}", where=where,
                     hint=f"the error is raised at {at}; `python {_short(path)}` reproduces it")


def _error_line(exc: Exception, path: str) -> tuple[int | None, str]:
    target = os.path.realpath(path)
    if isinstance(exc, SyntaxError) and exc.filename and os.path.realpath(exc.filename) == target:
        return exc.lineno, (exc.text or "").strip()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if os.path.realpath(frame.filename) == target:
            return frame.lineno, (frame.line or "").strip()
    return None, ""


def _spec_from_module(module) -> Spec:
    path = getattr(module, "__file__", None) or module.__name__
    params = getattr(module, "PARAMS", {})
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise SpecError(f"PARAMS is {params!r}, not a dict of name -> default", where=path,
                        hint='write PARAMS = {"window": 256}, or leave PARAMS out')
    reference = getattr(module, "reference", None)
    if reference is None:
        raise SpecError("the spec has no reference() function", where=path,
                        hint="define def reference(q, k, v, **params) returning the attention "
                             "output in plain PyTorch: q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] "
                             "-> out [B, Hq, Nq, D]")
    runtime = rt.declare(getattr(module, "RUNTIME_INPUTS", None), params, path)
    keywords = {**params, **{n: None for n in runtime}}
    _check_signature(reference, "reference", "q, k, v", keywords, where=path)
    factory = getattr(module, "hooks", None)
    if factory is not None:
        _check_signature(factory, "hooks", "Nq, Nk, Hq, Hkv, device", keywords, where=path)
    elif runtime:
        raise SpecError("RUNTIME_INPUTS without a hooks() factory", where=path,
                        hint="mods read runtime inputs through hooks(Nq, Nk, Hq, Hkv, device, *, "
                             f"{', '.join(runtime)}, **params), which closes over them")
    name = getattr(module, "NAME", None) or Path(path).stem
    if not isinstance(name, str):
        raise SpecError(f"NAME is a {type(name).__name__}", where=path,
                        hint='write NAME = "variant", or leave NAME out to use the file stem')
    source = Path(path).read_text() if Path(path).is_file() else ""  # informative only
    return Spec(name=name, path=path, source=source, doc=inspect.cleandoc(module.__doc__ or ""),
                params=dict(params), reference=reference, factory=factory,
                module_hooks=_module_hooks(module, path), runtime_inputs=runtime,
                sampler=getattr(module, "sample_runtime_inputs", None))


def _module_hooks(module, path: str) -> Hooks | None:
    mods = [getattr(module, attr, None) for attr in ("mask_mod", "score_mod", "NORMALIZATION")]
    if all(m is None for m in mods):
        return None
    mask_mod, score_mod, norm = mods
    try:
        return Hooks(mask_mod, score_mod, Normalization() if norm is None else norm)
    except SpecError as exc:
        raise SpecError(exc.message, where=exc.where or path, hint=exc.hint) from None
