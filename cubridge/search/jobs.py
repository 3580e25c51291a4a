"""Job functions, registered by kind; every runner's worker executes jobs through `run_job`.

A job function takes the JSON-able payload and returns `(Outcome, data)`. `run_job` never raises:
an exception becomes a CRASH outcome carrying the traceback's tail, so a worker survives a bad
job (a fault that kills the process is the runner's business: it restarts the worker).

Built-in kinds (payloads are built by cubridge.search.tuner):
- screen  (CPU): parse -> check -> taxonomy -> interpreter verification of one candidate;
- compile (CPU): lower one candidate at one tile config and compile it (nvcc, else NVRTC; cached);
- measure (GPU): compile + GPU check (the verification rule) + time at every target shape;
- race    (GPU): each shape's finalist configs timed again round-robin (the tuner's last choice);
- bench   (GPU): the chosen kernels timed beside the baselines (FlexAttention, SDPA, eager);
- backward (GPU): the backward's configs checked and timed beside FlexAttention's backward.

What they build and launch comes from the candidate's reference kernel
(cubridge.runtime.kernels.ReferenceKernel: compile options, launcher); see building.py.

Test-only kinds (sleep, crash, raise, echo) live in cubridge.search.testing_jobs.

Example:
    >>> from cubridge.vocab import Job
    >>> run_job(Job("echo", {"x": 1}, needs_gpu=False)).data
    {'x': 1}
"""
from __future__ import annotations

import importlib
import json
import traceback
from typing import Callable

from cubridge.errors import CubridgeError
from cubridge.search.building import binder_for, build, reference_program, spec_for
from cubridge.search.messages import KernelJob
from cubridge.vocab import Job, JobResult, Outcome, Proposal, TrialState

_REGISTRY: dict[str, Callable[[dict], tuple]] = {}
# Modules that register kinds, imported on the first miss (in a worker too).
_MODULES = ("cubridge.search.jobs", "cubridge.search.testing_jobs")


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


# ------------------------------------------------------------------ screen
@register("screen")
def screen_job(p: dict):
    from cubridge.search.screen import ScreenContext, screen
    from cubridge.verify import deep_cases, default_cases
    job = KernelJob.from_json(p)
    ref = reference_program(job.reference)
    # Past the fixed small cases: lengths that cover the default tile config's whole iteration space.
    cases = default_cases(quick=job.quick) + ([] if job.quick else deep_cases(ref.params()))
    ctx = ScreenContext(ref, job.reference, spec_for(job), dict(job.spec_params), cases, (job.head_dim,))
    prop = Proposal(job.text, job.origin)
    spec_problem = _spec_mask_problem(job)
    if spec_problem:
        return Outcome(TrialState.WRONG_ANSWER, spec_problem), {"proposal": prop.id}
    bind = binder_for(job)
    binder = (lambda case: bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B)) if bind else None
    return screen(prop, ctx, binder), {"proposal": prop.id}


# ------------------------------------------------------------------ compile
def _build_or_failure(job: KernelJob):
    """(lowered, CompileResult, None) or (None, None, (COMPILE_ERROR outcome, data))."""
    try:
        lowered, result = build(job)
    except CubridgeError as e:
        return None, None, (Outcome(TrialState.COMPILE_ERROR, str(e)[-4000:]), {})
    return lowered, result, None


@register("compile")
def compile_job(p: dict):
    from cubridge.runtime.build import NO_COMPILER, available_compiler
    if available_compiler() is None:
        return Outcome(TrialState.COMPILE_ERROR, NO_COMPILER), {}
    job = KernelJob.from_json(p)
    lowered, result, failure = _build_or_failure(job)
    if failure:
        return failure
    return (Outcome(TrialState.VERIFIED, f"compiled for {job.arch} ({len(result.cubin)} B cubin)"),
            {"cubin_key": result.key, "cached": result.cached, "log": result.log[-2000:]})


# ------------------------------------------------------------------ measure and bench (GPU)
@register("lift_check")
def lift_job(p: dict):
    """A lifted CuIR program against the user's kernel (cubridge/search/lift_check.py)."""
    from cubridge.search.lift_check import lift_check_job
    return lift_check_job(p)


@register("measure")
def measure_job(p: dict):
    job = KernelJob.from_json(p)
    failure = verify_at_config(job)
    if failure:
        return failure
    lowered, result, failure = _build_or_failure(job)
    if failure:
        return failure
    from cubridge.search import measure
    if not measure.gpu_available():
        return (Outcome(TrialState.VERIFIED, "compiled; timing needs a GPU (none visible to this worker)"),
                {"cubin_key": result.key})
    return measure.check_and_time(job, lowered, result.cubin, binder_for(job))


@register("bench")
def bench_job(p: dict):
    from cubridge.search import measure
    if not measure.gpu_available():
        return Outcome(TrialState.VERIFIED, "timing needs a GPU (none visible to this worker)"), {}
    return measure.bench_side_by_side(p)


@register("backward")
def backward_job(p: dict):
    """The run's backward configs checked and timed (cubridge/search/backward.py, measure_bwd.py)."""
    from cubridge.search import measure
    if not measure.gpu_available():
        return Outcome(TrialState.VERIFIED, "backward tuning needs a GPU (none visible to this worker)"), {}
    from cubridge.search.measure_bwd import measure_backward
    return measure_backward(p)


@register("race")
def race_job(p: dict):
    from cubridge.search import measure
    if not measure.gpu_available():
        return Outcome(TrialState.VERIFIED, "the final race needs a GPU (none visible to this worker)"), {}
    return measure.race(p)


# ------------------------------------------------------------------ verification depth (issue 20)
QUICK_MASK_N = 1100        # quick screening (tests) checks the spec's mask just past index 1000 only
_VERIFIED_AT: dict = {}
_SPEC_MASK: dict = {}


def _spec_mask_problem(job: KernelJob):
    """The spec's hooks against its reference() at the tuned lengths (verify.spec_mask_problem),
    once per spec and lengths in a worker: every candidate of a run shares the answer."""
    from cubridge.verify import spec_mask_problem
    lengths = tuple(s.seqlen if not job.quick else min(s.seqlen, QUICK_MASK_N) for s in job.shapes)
    hq = min(job.heads_q, 2)
    heads = (hq, 1 if job.heads_q != job.heads_kv else hq)
    key = (job.spec, job.spec_source, json.dumps(job.spec_params, sort_keys=True), lengths, heads)
    if key not in _SPEC_MASK:
        _SPEC_MASK[key] = spec_mask_problem(spec_for(job), lengths, heads=heads, spec_params=dict(job.spec_params))
    return _SPEC_MASK[key]


def verify_at_config(job: KernelJob):
    """The candidate in the interpreter at this trial's own tile config, over that config's whole
    iteration space (verify.deep_cases), before its time can count: screening ran at the default
    config only, and a program wrong at one BLOCK_N only was then timed there. None when it passes;
    configs that differ only outside CuIR (persistent) share a verdict."""
    from cubridge.search.space import SPACES
    params = SPACES[job.reference].to_cuir(job.config)
    key = (job.text, job.reference, job.spec, json.dumps(job.spec_params, sort_keys=True),
           json.dumps(params, sort_keys=True))
    if key not in _VERIFIED_AT:
        _VERIFIED_AT[key] = _verify_at(job, params)
    return _VERIFIED_AT[key]


def _verify_at(job: KernelJob, params: dict):
    from cubridge.cuir.parser import parse
    from cubridge.verify import deep_cases, verify_program
    try:
        prog = parse(job.text, source=f"<candidate {job.candidate}>")
        bind = binder_for(job)
    except CubridgeError as e:
        return Outcome(TrialState.WRONG_ANSWER, f"interpreter check at this config: {e}"), {}
    binder = (lambda c: bind(Nq=c.Nq, Nk=c.Nk, Hq=c.Hq, Hkv=c.Hkv, B=c.B, params=params)) if bind else None
    rep = verify_program(prog, spec_for(job), params=params, cases=deep_cases({**prog.params(), **params}),
                         spec_params=dict(job.spec_params), binder=binder)
    bad = rep.first_failure
    if bad is None:
        return None
    why = bad.error or bad.verdict.reason
    return Outcome(TrialState.WRONG_ANSWER, f"interpreter check at this config ({params}), {bad.case}: {why}"), {}
