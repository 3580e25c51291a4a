"""`cubridge-tune` configs: YAML loaded into typed, frozen dataclasses, validated before any work.

Every error names the file, the line (YAML nodes carry marks), the field as a dotted path and what
is expected; unknown keys are rejected with the list of allowed ones. A config whose spec file is
missing, whose reference kernel is unknown, or whose shapes cannot run (Hq not a multiple of Hkv,
a head dim the kernel lacks, N < 1) never starts a run.

A file is either one run (the keys of TuneConfig) or a plan of runs (`runs:` + `overrides:` +
`output:`, see configs/README.md); `load_plan` reads both.

Example:
    >>> cfg = load_config("configs/h100_prefixlm.yaml")          # doctest: +SKIP
    >>> [t.key for t in cfg.shapes.targets][:2]                    # doctest: +SKIP
    ['N=1024,B=16', 'N=2048,B=8']
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from cubridge.errors import CubridgeError
from cubridge.vocab import DTYPES   # the one spelling of kernel dtypes (config.DTYPES for its readers)

# heads_q, heads_kv, head_dim
MODELS = {"llama2-7b": (32, 32, 128), "qwen2.5-72b": (64, 8, 128), "llama3.1-405b": (128, 8, 128)}
ARCHES = ("sm_80", "sm_90a")
PROPOSERS = ("rules", "vllm", "openai")
RUNNERS = ("local", "ray", "replay")
OBJECTIVES = ("per_shape", "geomean")
DEFAULT_TOKENS = 16384          # B * N per target shape, as in the paper's benchmarks


class ConfigError(CubridgeError):
    """A config cannot be used; `where` is "file:line: field"."""


@dataclass(frozen=True)
class Target:
    """One target shape: q [batch, heads_q, query_len, head_dim], k/v [batch, heads_kv, seqlen,
    head_dim]; query_len None means seqlen. Queries are aligned to the end of the keys."""
    batch: int
    heads_q: int
    heads_kv: int
    seqlen: int
    head_dim: int
    query_len: int | None = None

    @property
    def nq(self) -> int:
        return self.seqlen if self.query_len is None else self.query_len

    @property
    def key(self) -> str:
        """The shape key used in Outcome.times_ms and the dispatch table."""
        nq = "" if self.nq == self.seqlen else f",Nq={self.nq}"
        return f"N={self.seqlen}{nq},B={self.batch}"


@dataclass(frozen=True)
class Shapes:
    heads_q: int
    heads_kv: int
    head_dim: int
    lengths: tuple[int, ...]
    batch: int | None = None          # fixed batch; None: tokens // N per length
    tokens: int = DEFAULT_TOKENS
    model: str | None = None
    query_lengths: tuple | None = None   # Nq per length (parallel to lengths); None: Nq = N

    @property
    def targets(self) -> tuple[Target, ...]:
        nqs = self.query_lengths or (None,) * len(self.lengths)
        return tuple(Target(self.batch or self.tokens // n, self.heads_q, self.heads_kv, n, self.head_dim,
                            None if nq == n else nq) for n, nq in zip(self.lengths, nqs))


@dataclass(frozen=True)
class ProposerConfig:
    kind: str = "rules"
    population: int = 8               # proposals asked per round (rules has exactly one)
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunnerConfig:
    kind: str = "local"
    address: str | None = None        # ray: None starts a local instance; "auto" or ray://host:port
    replay: Path | None = None        # replay: the recorded JobResults (JSON)
    timeout_s: float = 600.0          # one job (compile + check + time); past it the worker is killed


@dataclass(frozen=True)
class Budget:
    trials: int = 24                  # jobs measured (invalid tile configs cost nothing and do not count)
    minutes: float = 6.0              # wall time of the search loop of one invocation


@dataclass(frozen=True)
class TuneConfig:
    path: Path
    name: str
    spec: str                         # built-in name, dotted module or absolute path
    spec_params: dict
    references: tuple[str, ...]
    arch: str
    dtype: str
    shapes: Shapes
    proposer: ProposerConfig
    runner: RunnerConfig
    budget: Budget
    objectives: str
    output: Path
    storage: str | None = None
    backward: bool = False            # also tune the backward kernel's configs (cubridge/search/backward.py)

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.output / 'study.db').resolve()}"

    @property
    def search_key(self) -> str:
        """Hash of what defines the search space and objectives: a run resumed under another key
        would mix incomparable trials."""
        s = self.shapes
        data = [self.spec if "/" not in self.spec else Path(self.spec).name, self.spec_params,
                list(self.references), self.arch, self.dtype, s.heads_q, s.heads_kv, s.head_dim,
                [t.key for t in s.targets], self.objectives]
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "spec": self.spec, "spec_params": self.spec_params,
                "references": list(self.references), "arch": self.arch, "dtype": self.dtype,
                "shapes": {"heads_q": self.shapes.heads_q, "heads_kv": self.shapes.heads_kv,
                           "head_dim": self.shapes.head_dim, "lengths": list(self.shapes.lengths),
                           "batch": self.shapes.batch, "tokens": self.shapes.tokens, "model": self.shapes.model,
                           "query_lengths": list(self.shapes.query_lengths or ()) or None},
                "proposer": {"kind": self.proposer.kind, "population": self.proposer.population,
                             "options": self.proposer.options},
                "runner": {"kind": self.runner.kind, "address": self.runner.address,
                           "timeout_s": self.runner.timeout_s},
                "budget": {"trials": self.budget.trials, "minutes": self.budget.minutes},
                "objectives": self.objectives, "output": str(self.output), "storage": self.storage,
                "backward": self.backward}


# ------------------------------------------------------------------ the schema, as data
TOP_KEYS = {"name": "run name (default: the file stem)", "spec": "built-in spec name or path to a spec .py",
            "spec_params": "mapping of the spec's PARAMS overrides", "reference": "reference kernel name or list",
            "arch": f"one of {', '.join(ARCHES)}", "dtype": f"one of {', '.join(DTYPES)}",
            "shapes": "target shapes (model preset or heads)", "proposer": "kind / population / options",
            "runner": "kind / address / replay / timeout_s", "budget": "trials / minutes",
            "objectives": f"one of {', '.join(OBJECTIVES)}", "output": "output directory",
            "storage": "Optuna storage URL (default sqlite in the output directory)",
            "backward": "true: also check and time the backward kernel's configs (training; default false)"}
SHAPE_KEYS = {"model": f"one of {', '.join(MODELS)}", "heads_q": "query heads", "heads_kv": "key/value heads",
              "head_dim": "head dimension", "lengths": "list of sequence lengths",
              "batch": "fixed batch size", "tokens": f"B * N per shape (default {DEFAULT_TOKENS})",
              "query_length": "queries per shape (Nq <= N, end-aligned): one int, or a list parallel to lengths"}
PROPOSER_KEYS = {"kind": f"one of {', '.join(PROPOSERS)}", "population": "proposals per round",
                 "options": "mapping passed to the proposer"}
RUNNER_KEYS = {"kind": f"one of {', '.join(RUNNERS)}", "address": "Ray cluster address",
               "replay": "recorded JobResults JSON (runner replay)", "timeout_s": "seconds per job"}
BUDGET_KEYS = {"trials": "measured trials", "minutes": "search wall time"}
PLAN_KEYS = {"runs": "list of config files (relative to this file)",
             "overrides": "mapping deep-merged into every run", "output": "root output directory"}


class _Reader:
    """Typed access to a parsed YAML mapping, raising ConfigError with file, line and field."""

    def __init__(self, path: Path, lines: dict[str, tuple[Path, int]]):
        self.path = path
        self.lines = lines

    def error(self, fld: str, message: str, hint: str | None = None) -> ConfigError:
        file, line = self.lines.get(fld) or self._nearest(fld)
        loc = f"{_show(file)}:{line}" if line else _show(file)
        return ConfigError(message, where=f"{loc}: {fld}" if fld else loc, hint=hint)

    def _nearest(self, fld: str) -> tuple[Path, int | None]:
        while "." in fld:
            fld = fld.rsplit(".", 1)[0]
            if fld in self.lines:
                return self.lines[fld]
        return self.path, None

    def mapping(self, value, fld: str, allowed: dict) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(fld, f"expected a mapping, got {_kind(value)} {value!r}",
                             hint="keys: " + ", ".join(allowed))
        for key in value:
            if key not in allowed:
                sub = f"{fld}.{key}" if fld else str(key)
                close = difflib.get_close_matches(str(key), list(allowed), n=1)
                maybe = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.error(sub, f"unknown key {key!r}{maybe}",
                                 hint="allowed keys: " + ", ".join(f"{k} ({v})" for k, v in allowed.items()))
        return value

    def integer(self, value, fld: str, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(fld, f"expected an integer >= {minimum}, got {_kind(value)} {value!r}")
        if value < minimum:
            raise self.error(fld, f"expected an integer >= {minimum}, got {value}")
        return value

    def number(self, value, fld: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.error(fld, f"expected a positive number, got {_kind(value)} {value!r}")
        return float(value)

    def string(self, value, fld: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(fld, f"expected a non-empty string, got {_kind(value)} {value!r}")
        return value

    def choice(self, value, fld: str, choices) -> str:
        if not isinstance(value, str) or value not in choices:
            close = difflib.get_close_matches(str(value), list(choices), n=1)
            maybe = f" (did you mean {close[0]!r}?)" if close else ""
            raise self.error(fld, f"expected one of {', '.join(choices)}, got {value!r}{maybe}")
        return value

    def boolean(self, value, fld: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(fld, f"expected true or false, got {_kind(value)} {value!r}")
        return value

    def int_list(self, value, fld: str) -> tuple[int, ...]:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not value:
            raise self.error(fld, f"expected a non-empty list of integers, got {_kind(value)} {value!r}",
                             hint="e.g. lengths: [1024, 2048, 4096]")
        return tuple(self.integer(v, f"{fld}[{i}]") for i, v in enumerate(value))


# ------------------------------------------------------------------ reading YAML with line marks
def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "nothing"}.get(type(value), type(value).__name__)


def _show(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _read_yaml(path: Path) -> tuple[Any, dict[str, tuple[Path, int]]]:
    if not path.is_file():
        raise ConfigError("config file not found", where=_show(path),
                          hint="give the path of a YAML config, e.g. configs/h100_prefixlm.yaml")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"not a text file (byte {e.start} is not UTF-8)", where=f"{_show(path)}:{line}",
                          hint="give a YAML config, e.g. configs/h100_prefixlm.yaml") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config: {e.strerror}", where=_show(path)) from None
    if "\x00" in text:
        raise ConfigError("not a text file (it contains NUL bytes)", where=_show(path),
                          hint="give a YAML config, e.g. configs/h100_prefixlm.yaml")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{_show(path)}:{mark.line + 1}" if mark else _show(path)
        raise ConfigError(f"not valid YAML: {getattr(e, 'problem', None) or e}", where=where,
                          hint="check indentation and that every key is followed by ': '") from None
    lines: dict[str, tuple[Path, int]] = {}
    if node is not None:
        _walk(node, "", path, lines)
    return data, lines


def _walk(node, prefix: str, path: Path, lines: dict) -> None:
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            name = f"{prefix}.{key.value}" if prefix else str(key.value)
            if key.value in seen:
                raise ConfigError(f"key {key.value!r} given twice", where=f"{_show(path)}:{key.start_mark.line + 1}: {name}",
                                  hint="remove one of them")
            seen.add(key.value)
            lines[name] = (path, key.start_mark.line + 1)
            _walk(value, name, path, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[f"{prefix}[{i}]"] = (path, item.start_mark.line + 1)
            _walk(item, f"{prefix}[{i}]", path, lines)


# ------------------------------------------------------------------ building the dataclasses
def load_config(path) -> TuneConfig:
    """Read and validate one run config (not a plan: see load_plan)."""
    path = Path(path)
    data, lines = _read_yaml(path)
    r = _Reader(path, lines)
    if isinstance(data, dict) and "runs" in data:
        raise r.error("runs", "this file is a plan of several runs", hint="load it with load_plan()")
    return _build(data, r, path)


def load_plan(path) -> list[TuneConfig]:
    """One config, or the runs of a plan file (`runs:` list, optional `overrides:` and `output:`),
    every one validated before any starts."""
    path = Path(path)
    data, lines = _read_yaml(path)
    r = _Reader(path, lines)
    if not (isinstance(data, dict) and "runs" in data):
        return [_build(data, r, path)]
    plan = r.mapping(data, "", PLAN_KEYS)
    runs = plan["runs"]
    if not isinstance(runs, list) or not runs:
        raise r.error("runs", f"expected a non-empty list of config files, got {_kind(runs)}",
                      hint="runs: [h100_full.yaml, h100_causal.yaml]")
    overrides = r.mapping(plan.get("overrides"), "overrides", TOP_KEYS)
    root = Path(r.string(plan["output"], "output")) if plan.get("output") is not None else None
    configs = []
    for i, item in enumerate(runs):
        sub = path.parent / r.string(item, f"runs[{i}]")
        if not sub.is_file():
            raise r.error(f"runs[{i}]", f"config file {_show(sub)} not found",
                          hint="paths in runs: are relative to the plan file")
        sub_data, sub_lines = _read_yaml(sub)
        if not isinstance(sub_data, dict):
            raise _Reader(sub, sub_lines).error("", f"expected a mapping of config keys, got {_kind(sub_data)}")
        merged_lines = dict(sub_lines)
        merged_lines.update({k.removeprefix("overrides."): v for k, v in lines.items() if k.startswith("overrides.")})
        merged = _deep_merge(sub_data, overrides)
        if root is not None:
            merged["output"] = str(root / (merged.get("name") or sub.stem))
            merged_lines["output"] = lines["output"]
        configs.append(_build(merged, _Reader(sub, merged_lines), sub))
    return configs


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _build(data, r: _Reader, path: Path) -> TuneConfig:
    if not isinstance(data, dict):
        raise r.error("", f"expected a mapping of config keys, got {_kind(data)}",
                      hint="start from configs/h100_prefixlm.yaml; keys: " + ", ".join(TOP_KEYS))
    d = r.mapping(data, "", TOP_KEYS)
    if "spec" not in d:
        raise r.error("spec", "missing: which variant to tune", hint="spec: prefixlm (or a path to a spec .py)")
    name = r.string(d.get("name", path.stem), "name")
    spec = _resolve_spec(r.string(d["spec"], "spec"), r, path)
    spec_params = _spec_params(d.get("spec_params"), spec, r)
    refs = d.get("reference", "fa3_sm90")
    refs = tuple(r.string(x, f"reference[{i}]") for i, x in enumerate(refs)) if isinstance(refs, list) \
        else (r.string(refs, "reference"),)
    arch = r.choice(d.get("arch", "sm_90a"), "arch", ARCHES)
    dtype = r.choice(d.get("dtype", "bf16"), "dtype", DTYPES)
    shapes = _shapes(r.mapping(d.get("shapes"), "shapes", SHAPE_KEYS), r)
    _check_references(refs, arch, shapes.head_dim, r, isinstance(d.get("reference"), list))
    _check_memory(shapes, arch, r)
    proposer = _proposer(r.mapping(d.get("proposer"), "proposer", PROPOSER_KEYS), r)
    runner = _runner(r.mapping(d.get("runner"), "runner", RUNNER_KEYS), r, path)
    b = r.mapping(d.get("budget"), "budget", BUDGET_KEYS)
    budget = Budget(r.integer(b.get("trials", Budget.trials), "budget.trials"),
                    r.number(b.get("minutes", Budget.minutes), "budget.minutes"))
    objectives = r.choice(d.get("objectives", "per_shape"), "objectives", OBJECTIVES)
    output = Path(r.string(d.get("output", f"out/{name}"), "output"))
    storage = r.string(d["storage"], "storage") if d.get("storage") is not None else None
    if storage is not None and "://" not in storage:
        raise r.error("storage", f"{storage!r} is not a database URL",
                      hint="e.g. sqlite:///out/study.db or postgresql://user@host/db; leave it out for "
                           "SQLite in the output directory")
    backward = r.boolean(d.get("backward", False), "backward")
    if backward:
        _check_trainable(shapes, r)
    return TuneConfig(path, name, spec, spec_params, refs, arch, dtype, shapes, proposer, runner, budget,
                      objectives, output, storage, backward)


def _check_trainable(shapes: Shapes, r: _Reader) -> None:
    """`backward: true` only where the backward kernel is built (fa2_bwd_sm80: D 64 / 128)."""
    from cubridge.runtime.fa2_bwd_sm80 import HEAD_DIMS
    if shapes.head_dim not in HEAD_DIMS:
        raise r.error("backward", f"the backward kernel is built for head dims {', '.join(map(str, HEAD_DIMS))}, "
                                  f"not {shapes.head_dim}",
                      hint="set backward: false (forward only), or tune a head dim the backward supports")


def _resolve_spec(text: str, r: _Reader, path: Path) -> str:
    from cubridge.spec import load_spec
    looks_like_path = text.endswith(".py") or "/" in text
    spec = str((path.parent / text).resolve()) if looks_like_path else text
    if looks_like_path and not Path(spec).is_file():
        raise r.error("spec", f"spec file {_show(Path(spec))} not found",
                      hint="paths are relative to the config file; or use a built-in name "
                           "(cubridge specs lists them)")
    try:
        load_spec(spec)
    except CubridgeError as e:
        raise r.error("spec", e.message, hint=e.hint) from None
    return spec


def _spec_params(value, spec: str, r: _Reader) -> dict:
    from cubridge.spec import load_spec
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise r.error("spec_params", f"expected a mapping, got {_kind(value)} {value!r}", hint="spec_params: {prefix: 512}")
    try:
        load_spec(spec).resolved_params(**value)
    except CubridgeError as e:
        raise r.error("spec_params", e.message, hint=e.hint) from None
    return dict(value)


def _shapes(s: dict, r: _Reader) -> Shapes:
    explicit = [k for k in ("heads_q", "heads_kv", "head_dim") if k in s]
    if "model" in s:
        model = r.choice(s["model"], "shapes.model", list(MODELS))
        if explicit:
            raise r.error(f"shapes.{explicit[0]}", "given together with shapes.model",
                          hint=f"either a model preset ({model} = {MODELS[model][0]} q / {MODELS[model][1]} kv "
                               f"heads, head dim {MODELS[model][2]}) or heads_q/heads_kv/head_dim")
        hq, hkv, hd = MODELS[model]
    elif explicit:
        missing = [k for k in ("heads_q", "heads_kv", "head_dim") if k not in s]
        if missing:
            raise r.error(f"shapes.{missing[0]}", "missing", hint="give heads_q, heads_kv and head_dim, or a model preset")
        model = None
        hq, hkv, hd = (r.integer(s[k], f"shapes.{k}") for k in ("heads_q", "heads_kv", "head_dim"))
    else:
        raise r.error("shapes", "no target shapes", hint=f"shapes: {{model: llama2-7b, lengths: [1024, 4096]}}; "
                                                          f"models: {', '.join(MODELS)}")
    if hq % hkv:
        raise r.error("shapes.heads_q" if "heads_q" in s else "shapes.model",
                      f"heads_q {hq} is not a multiple of heads_kv {hkv}", hint="GQA needs heads_q = G * heads_kv")
    if "lengths" not in s:
        raise r.error("shapes.lengths", "missing", hint="lengths: [1024, 2048, 4096, 8192, 16384]")
    lengths = r.int_list(s["lengths"], "shapes.lengths")
    if len(set(lengths)) != len(lengths):
        raise r.error("shapes.lengths", f"lengths repeat: {list(lengths)}", hint="list each length once")
    if "batch" in s and "tokens" in s:
        raise r.error("shapes.tokens", "given together with shapes.batch", hint="a fixed batch, or B = tokens // N")
    batch = r.integer(s["batch"], "shapes.batch") if "batch" in s else None
    tokens = r.integer(s.get("tokens", DEFAULT_TOKENS), "shapes.tokens")
    if batch is None and max(lengths) > tokens:
        raise r.error("shapes.lengths", f"N = {max(lengths)} > tokens = {tokens} gives batch 0",
                      hint="raise shapes.tokens or give shapes.batch")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    nqs = _query_lengths(s, lengths, r)
    return Shapes(hq, hkv, hd, tuple(lengths[i] for i in order), batch, tokens, model,
                  None if nqs is None else tuple(nqs[i] for i in order))


def _query_lengths(s: dict, lengths: tuple, r: _Reader) -> tuple | None:
    """shapes.query_length: Nq for every length (an int) or per length (a list parallel to lengths);
    queries are aligned to the end of the keys, so each Nq <= its length N."""
    if "query_length" not in s:
        return None
    raw = s["query_length"]
    if isinstance(raw, list):
        nqs = r.int_list(raw, "shapes.query_length")
        if len(nqs) != len(lengths):
            raise r.error("shapes.query_length", f"{len(nqs)} query lengths for {len(lengths)} lengths",
                          hint="give one int for every length, or a list as long as shapes.lengths")
    else:
        nqs = (r.integer(raw, "shapes.query_length"),) * len(lengths)
    for i, (nq, n) in enumerate(zip(nqs, lengths)):
        if nq > n:
            fld = f"shapes.query_length[{i}]" if isinstance(raw, list) else "shapes.query_length"
            raise r.error(fld, f"query length {nq} > length {n}",
                          hint="queries are aligned to the end of the keys (a KV-cache prefill): Nq <= N")
    return nqs


# The most memory one GPU of each arch has (A100 80 GB; H200 141 GB): a target shape whose
# tensors alone exceed it cannot run anywhere, and used to be accepted (N = 10^9: q alone ~8 TB).
GPU_MEMORY_GIB = {"sm_80": 80, "sm_90a": 141}


def _check_memory(shapes: Shapes, arch: str, r: _Reader) -> None:
    for t in shapes.targets:
        # q, o: B Hq N D; k, v: B Hkv N D (16-bit); lse: B Hq N fp32.
        need = 2 * t.batch * t.seqlen * t.head_dim * (2 * t.heads_q + 2 * t.heads_kv) + 4 * t.batch * t.heads_q * t.seqlen
        if need > GPU_MEMORY_GIB[arch] * 2 ** 30:
            raise r.error("shapes.lengths", f"N = {t.seqlen} (batch {t.batch}) needs {need / 2 ** 30:,.0f} GiB for "
                          f"q, k, v and the output alone; the largest {arch} GPU has {GPU_MEMORY_GIB[arch]} GiB",
                          hint="use shorter lengths or a smaller batch / tokens")


def _check_references(refs, arch: str, head_dim: int, r: _Reader, is_list: bool) -> None:
    from cubridge.runtime.kernels import kernel_names, reference_kernel
    known = kernel_names()
    for i, ref in enumerate(refs):
        fld = f"reference[{i}]" if is_list else "reference"
        if ref not in known:
            close = difflib.get_close_matches(ref, known, n=1)
            maybe = f" (did you mean {close[0]!r}?)" if close else ""
            raise r.error(fld, f"unknown reference kernel {ref!r}{maybe}",
                          hint=f"reference kernels (ref_kernels/): {', '.join(known)}")
        space = reference_kernel(ref).space
        if arch not in space.arches:
            raise r.error("arch", f"{ref} does not run on {arch}", hint=f"{ref} needs one of {', '.join(space.arches)}")
        if head_dim not in space.head_dims:
            raise r.error("shapes.head_dim" if "shapes.head_dim" in r.lines else "shapes",
                          f"head dim {head_dim} is not built by {ref}",
                          hint=f"{ref} supports head dims {', '.join(map(str, space.head_dims))}")


def _proposer(p: dict, r: _Reader) -> ProposerConfig:
    from cubridge.registry import available
    kind = r.choice(p.get("kind", "rules"), "proposer.kind", PROPOSERS)
    if kind not in available():
        raise r.error("proposer.kind", f"proposer {kind!r} is not available in this install",
                      hint=f"available: {', '.join(available())}; the LLM proposers need cubridge.llm and "
                           "pip install -e '.[vllm]'")
    options = p.get("options") or {}
    if not isinstance(options, dict):
        raise r.error("proposer.options", f"expected a mapping, got {_kind(options)}")
    return ProposerConfig(kind, r.integer(p.get("population", ProposerConfig.population), "proposer.population"),
                          dict(options))


def _runner(p: dict, r: _Reader, path: Path) -> RunnerConfig:
    kind = r.choice(p.get("kind", "local"), "runner.kind", RUNNERS)
    address = r.string(p["address"], "runner.address") if p.get("address") is not None else None
    replay = (path.parent / r.string(p["replay"], "runner.replay")).resolve() if p.get("replay") else None
    if kind == "replay" and replay is None:
        raise r.error("runner.replay", "runner kind replay needs the recorded results file",
                      hint="runner: {kind: replay, replay: recorded.json}, or --runner replay --replay FILE")
    timeout = r.number(p.get("timeout_s", RunnerConfig.timeout_s), "runner.timeout_s")
    return RunnerConfig(kind, address, replay, timeout)


def with_overrides(cfg: TuneConfig, *, output=None, trials=None, runner=None, replay=None, address=None) -> TuneConfig:
    """The config with command-line overrides applied (validated like the file's values)."""
    if trials is not None and trials < 1:
        raise ConfigError(f"--trials {trials}: expected an integer >= 1", where="command line")
    if runner == "replay" and replay is None and cfg.runner.replay is None:
        raise ConfigError("--runner replay needs --replay FILE", where="command line",
                          hint="record results with a GPU run, or write them by hand (see runners/replay.py)")
    rc = replace(cfg.runner, kind=runner or cfg.runner.kind,
                 replay=Path(replay).resolve() if replay else cfg.runner.replay,
                 address=address if address is not None else cfg.runner.address)
    return replace(cfg, output=Path(output) if output else cfg.output, runner=rc,
                   budget=replace(cfg.budget, trials=trials or cfg.budget.trials))
