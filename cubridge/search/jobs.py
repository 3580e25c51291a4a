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
    from cubridge.verify import default_cases
    job = KernelJob.from_json(p)
    ctx = ScreenContext(reference_program(job.reference), job.reference, spec_for(job), dict(job.spec_params),
                        default_cases(quick=job.quick), (job.head_dim,))
    prop = Proposal(job.text, job.origin)
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


@register("race")
def race_job(p: dict):
    from cubridge.search import measure
    if not measure.gpu_available():
        return Outcome(TrialState.VERIFIED, "the final race needs a GPU (none visible to this worker)"), {}
    return measure.race(p)
