"""Job functions, registered by kind; every runner's worker executes jobs through `run_job`.

A job function takes the JSON-able payload and returns `(Outcome, data)`. `run_job` never raises:
an exception becomes a CRASH outcome carrying the traceback's tail, so a worker survives a bad
job (a fault that kills the process is the runner's business: it restarts the worker).

Built-in kinds (payloads are built by cubridge.search.tuner):
- screen  (CPU): parse -> check -> taxonomy -> interpreter verification of one candidate;
- compile (CPU): lower one candidate at one tile config and compile it (nvcc, else NVRTC; cached);
- measure (GPU): compile + GPU check (the verification rule) + time at every target shape;
- race    (GPU): each shape's finalist configs timed again round-robin (the tuner's last choice);
- bench   (GPU): the chosen kernels timed beside the baselines (FlexAttention, SDPA, eager).

Lowering (`cubridge.lower`) is imported lazily; where it is missing, compile / measure / bench
return a COMPILE_ERROR saying so, never invented numbers. What they use of it:

    lower(program, ref, *, config, head_dim, dtype) -> LoweredKernel with .defines, where offered;
        else lower(program, ref) (today's form), the -D flags from the reference's runtime Config
    launcher(lowered, cubin, *, config) -> fn(q, k, v, *, out, **extra), where offered; else
        LoweredKernel.args(extra, device) run by the reference's runtime (fa3_forward /
        Fa2Sm80 with variant=...), as tests/gpu/test_variants.py does (cubridge.search.measure)

Test-only kinds (sleep, crash, raise, echo) live in cubridge.search.testing_jobs.

Example:
    >>> from cubridge.search.api import Job
    >>> run_job(Job("echo", {"x": 1}, needs_gpu=False)).data
    {'x': 1}
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import tempfile
import traceback
from pathlib import Path
from typing import Callable

from cubridge.errors import CubridgeError
from cubridge.search.api import Job, JobResult, Outcome, Proposal, TrialState

_REGISTRY: dict[str, Callable[[dict], tuple]] = {}
# Modules that register kinds, imported on the first miss (in a worker too).
_MODULES = ("cubridge.search.jobs", "cubridge.search.testing_jobs")
LOWERING_MISSING = ("lowering is not available: cubridge.lower is not in this checkout yet, so no "
                    "kernel can be generated, compiled or timed (screening results stand)")


def register(kind: str):
    def deco(fn):
        _REGISTRY[kind] = fn
        return fn
    return deco


def get(kind: str) -> Callable[[dict], tuple]:
    if kind not in _REGISTRY:
        for module in _MODULES:
            importlib.import_module(module)
    if kind not in _REGISTRY:
        raise CubridgeError(f"unknown job kind {kind!r}", hint=f"registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[kind]


def run_job(job: Job, worker: str = "") -> JobResult:
    """Execute one job in this process; failures come back as outcomes."""
    try:
        outcome, data = get(job.kind)(job.payload)
    except Exception as e:   # noqa: BLE001 - a job must never take its worker down with it
        tail = "".join(traceback.format_exception(e)[-3:]).strip()
        outcome, data = Outcome(TrialState.CRASH, f"job {job.kind} raised {type(e).__name__}: {e}\n{tail}"), {}
    return JobResult(job, outcome, data, worker)


# ------------------------------------------------------------------ shared pieces
@functools.lru_cache(maxsize=8)
def _spec(spec: str):
    from cubridge.spec import load_spec
    return load_spec(spec)


def spec_for(p: dict):
    """The payload's spec (loaded once per worker)."""
    return _spec(_spec_path(p))


def _spec_path(p: dict) -> str:
    """A spec file the worker cannot see (another node of a Ray cluster) is rebuilt from the
    source the driver sent, under the same file name."""
    spec = p["spec"]
    if ("/" in spec or spec.endswith(".py")) and not Path(spec).is_file() and p.get("spec_source"):
        digest = hashlib.sha256(p["spec_source"].encode()).hexdigest()[:16]
        local = Path(tempfile.gettempdir()) / "cubridge_specs" / digest / Path(spec).name
        if not local.is_file():
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(p["spec_source"])
        spec = str(local)
    return spec


@functools.lru_cache(maxsize=8)
def _reference(name: str):
    from cubridge.cuir.parser import parse_file
    from cubridge.paths import ref_kernel_dir
    return parse_file(ref_kernel_dir(name) / "kernel.cuir")


@functools.lru_cache(maxsize=16)
def _rules_candidate(reference: str, spec: str, spec_params: str):
    """The rules transfer, redone in this process (deterministic): it carries the binder."""
    from cubridge.transfer.rules import transfer
    return transfer(_reference(reference), _spec(spec), spec_params=json.loads(spec_params))


def binder_for(p: dict):
    """`bind(Nq, Nk, Hq, Hkv, B, params, device) -> extra inputs` of a candidate, or None when it
    needs none. Rules candidates are re-derived; other origins bind nothing (their proposer must
    emit programs without extra inputs until it ships a binder)."""
    if p.get("origin") != "rules":
        return None
    cand = _rules_candidate(p["reference"], _spec_path(p), json.dumps(p.get("spec_params") or {}, sort_keys=True))
    if Proposal(cand.text, "rules").id != Proposal(p["text"], "rules").id:
        raise CubridgeError("the rules transfer in this worker differs from the driver's candidate",
                            hint="driver and workers must run the same cubridge checkout")
    return cand.bind


def _program(text: str, pid: str):
    from cubridge.cuir.parser import parse
    return parse(text, source=f"<candidate {pid}>")


def lowering():
    """The lowering module, or None where it is not built yet."""
    try:
        return importlib.import_module("cubridge.lower")
    except ModuleNotFoundError as e:
        if e.name in ("cubridge.lower", "cubridge"):
            return None
        raise


# ------------------------------------------------------------------ screen
@register("screen")
def screen_job(p: dict):
    from cubridge.search.screen import ScreenContext, screen
    from cubridge.verify import deep_cases, default_cases
    quick = bool(p.get("quick"))
    # Past the fixed small cases: lengths that cover the default tile config's whole iteration space.
    cases = default_cases(quick=quick) + ([] if quick else deep_cases(_reference(p["reference"]).params()))
    ctx = ScreenContext(_reference(p["reference"]), p["reference"], spec_for(p), dict(p.get("spec_params") or {}),
                        cases, (int(p["head_dim"]),))
    prop = Proposal(p["text"], p.get("origin", "?"))
    spec_problem = _spec_mask_problem(p["spec"], _spec_path(p), json.dumps(p.get("spec_params") or {}, sort_keys=True),
                                      tuple(s["seqlen"] if not p.get("quick") else min(s["seqlen"], QUICK_MASK_N)
                                            for s in p.get("shapes") or ()),
                                      (min(int(p["heads_q"]), 2), 1 if p["heads_q"] != p["heads_kv"] else min(int(p["heads_q"]), 2)))
    if spec_problem:
        return Outcome(TrialState.WRONG_ANSWER, spec_problem), {"proposal": prop.id}
    try:
        bind = binder_for(p)
    except CubridgeError as e:
        return Outcome(TrialState.WRONG_ANSWER, f"binder: {e}"), {"proposal": prop.id}
    binder = (lambda case: bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B)) if bind else None
    return screen(prop, ctx, binder), {"proposal": prop.id}


# ------------------------------------------------------------------ compile
def build(p: dict):
    """Lower and compile one candidate at one config: (lowered, CompileResult). Raises
    _Unavailable where lowering is missing, BuildError (or any CubridgeError) on failure."""
    from cubridge.runtime.build import compile_cubin, default_compiler
    lowered, options = lower_kernel(p)
    result = compile_cubin(lowered.source, arch=p["arch"], options=options, compiler=default_compiler(),
                           cache_dir=p.get("cache_dir"), name=f"{p['candidate']}.cu")
    return lowered, result


def lower_kernel(p: dict):
    """(lowered kernel, compiler options) for the payload's candidate at its tile config.

    Takes the agreed interface (lower(program, ref, config=, head_dim=, dtype=) with `defines` on
    the result) where the lowering offers it, else today's lower(program, ref), with the tile
    config's -D flags from the reference kernel's runtime Config (what kernel.cu reads)."""
    from cubridge.paths import ref_kernel_dir
    if p.get("cuda_source"):        # an LLM patch of the reference kernel, accepted on a GPU
        from cubridge.lower import LoweredKernel
        lowered = LoweredKernel(p["reference"], p["cuda_source"])
        defines = runtime_defines(p["reference"], p["config"], int(p["head_dim"]), p["dtype"])
        return lowered, ["-std=c++17", *defines, f"-I{ref_kernel_dir(p['reference'])}"]
    lower = lowering()
    if lower is None:
        raise _Unavailable(LOWERING_MISSING)
    program = _program(p["text"], p["candidate"])
    if "config" in inspect.signature(lower.lower).parameters:
        from cubridge.search.space import SPACES
        lowered = lower.lower(program, p["reference"], config=SPACES[p["reference"]].to_cuir(p["config"]),
                              head_dim=int(p["head_dim"]), dtype=p["dtype"])
    else:
        lowered = lower.lower(program, p["reference"])
    defines = getattr(lowered, "defines", None)
    if defines is None:
        defines = runtime_defines(p["reference"], p["config"], int(p["head_dim"]), p["dtype"])
    return lowered, ["-std=c++17", *defines, f"-I{ref_kernel_dir(p['reference'])}"]


def runtime_defines(ref: str, point: dict, head_dim: int, dtype: str) -> list[str]:
    """The reference kernel's -D flags for a tile config. Masking lives in the lowered mask
    region, so the reference's own causal switch stays off."""
    if ref == "fa3_sm90":
        from dataclasses import replace

        from cubridge.search.space import fa3_config
        return replace(fa3_config(point, head_dim), causal=False, bf16=dtype == "bf16").defines()
    if ref == "fa2_sm80":
        import torch

        from cubridge.search.space import fa2_config
        return fa2_config(point).defines(head_dim, torch.bfloat16 if dtype == "bf16" else torch.float16, causal=False)
    raise CubridgeError(f"no tile-config flags known for reference kernel {ref!r}")


class _Unavailable(Exception):
    pass


def _build_or_failure(p: dict):
    """(lowered, CompileResult, None) or (None, None, (COMPILE_ERROR outcome, data))."""
    try:
        lowered, result = build(p)
    except _Unavailable as e:
        return None, None, (Outcome(TrialState.COMPILE_ERROR, str(e)), {"lowering": False})
    except CubridgeError as e:
        return None, None, (Outcome(TrialState.COMPILE_ERROR, str(e)[-4000:]), {})
    return lowered, result, None


@register("compile")
def compile_job(p: dict):
    from cubridge.runtime.build import NO_COMPILER, available_compiler
    if available_compiler() is None:
        return Outcome(TrialState.COMPILE_ERROR, NO_COMPILER), {}
    lowered, result, failure = _build_or_failure(p)
    if failure:
        return failure
    return (Outcome(TrialState.VERIFIED, f"compiled for {p['arch']} ({len(result.cubin)} B cubin)"),
            {"cubin_key": result.key, "cached": result.cached, "log": result.log[-2000:]})


# ------------------------------------------------------------------ measure and bench (GPU)
@register("lift_check")
def lift_job(p: dict):
    """A lifted CuIR program against the user's kernel (cubridge/search/lift_check.py)."""
    from cubridge.search.lift_check import lift_check_job
    return lift_check_job(p)


@register("measure")
def measure_job(p: dict):
    failure = verify_at_config(p)
    if failure:
        return failure
    lowered, result, failure = _build_or_failure(p)
    if failure:
        return failure
    from cubridge.search import measure
    if not measure.gpu_available():
        return (Outcome(TrialState.VERIFIED, "compiled; timing needs a GPU (none visible to this worker)"),
                {"cubin_key": result.key})
    return measure.check_and_time(p, lowered, result.cubin, binder_for(p))


@functools.lru_cache(maxsize=8)
def _spec_mask_problem(_name: str, spec_path: str, spec_params: str, lengths: tuple, heads: tuple):
    """Once per spec and target lengths in a worker: every candidate of a run shares the answer."""
    from cubridge.verify import spec_mask_problem
    return spec_mask_problem(_spec(spec_path), lengths, heads=heads, spec_params=json.loads(spec_params))


def verify_at_config(p: dict):
    """The candidate in the interpreter at this trial's own tile config, over that config's whole
    iteration space (verify.deep_cases), before its time can count: screening ran at the default
    config only, and a program wrong at one BLOCK_N only was then timed there. None when it passes."""
    from cubridge.search.space import SPACES
    params = SPACES[p["reference"]].to_cuir(p["config"])
    key = (p["text"], p["reference"], p["spec"], json.dumps(p.get("spec_params") or {}, sort_keys=True),
           json.dumps(params, sort_keys=True))
    if key not in _VERIFIED_AT:       # configs that differ only outside CuIR (persistent) share a verdict
        _VERIFIED_AT[key] = _verify_at(p, params)
    return _VERIFIED_AT[key]


_VERIFIED_AT: dict = {}
QUICK_MASK_N = 1100        # quick screening (tests) checks the spec's mask just past index 1000 only


def _verify_at(p: dict, params: dict):
    from cubridge.verify import deep_cases, verify_program
    try:
        prog = _program(p["text"], p["candidate"])
        bind = binder_for(p)
    except CubridgeError as e:
        return Outcome(TrialState.WRONG_ANSWER, f"interpreter check at this config: {e}"), {}
    binder = (lambda c: bind(Nq=c.Nq, Nk=c.Nk, Hq=c.Hq, Hkv=c.Hkv, B=c.B, params=params)) if bind else None
    rep = verify_program(prog, spec_for(p), params=params, cases=deep_cases({**prog.params(), **params}),
                         spec_params=dict(p.get("spec_params") or {}), binder=binder)
    bad = rep.first_failure
    if bad is None:
        return None
    why = bad.error or bad.verdict.reason
    return Outcome(TrialState.WRONG_ANSWER, f"interpreter check at this config ({params}), {bad.case}: {why}"), {}


@register("bench")
def bench_job(p: dict):
    from cubridge.search import measure
    if not measure.gpu_available():
        return Outcome(TrialState.VERIFIED, "timing needs a GPU (none visible to this worker)"), {}
    return measure.bench_side_by_side(p)


@register("race")
def race_job(p: dict):
    from cubridge.search import measure
    if not measure.gpu_available():
        return Outcome(TrialState.VERIFIED, "the final race needs a GPU (none visible to this worker)"), {}
    return measure.race(p)


def cubin_path(cache_dir: str | Path, key: str) -> Path:
    """Where compile_cubin stored the cubin of `key`."""
    return Path(cache_dir) / f"{key}.cubin"
