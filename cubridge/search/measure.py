"""GPU side of the measure and bench jobs: the verification rule on the compiled kernel, timing at
the target shapes, and the baselines timed beside it (docs/DESIGN.md, "Verification", "Timing").

Runs only inside a runner's worker with a GPU; imported lazily by cubridge.search.jobs. A CUDA
error leaves the worker's context unusable, so such a result carries data["restart_worker"] and
the runner replaces the worker after taking it.

Example (GPU worker):
    >>> outcome, data = check_and_time(payload, lowered, cubin, bind)      # doctest: +SKIP
    >>> outcome.times_ms                                                   # doctest: +SKIP
    {'N=1024,B=16': 0.231, ...}
"""
from __future__ import annotations

import ctypes

import torch

from cubridge import rule
from cubridge.search.messages import BENCH_KEYS, RACE_KEYS, KernelJob, TargetShape
from cubridge.vocab import Outcome, TrialState

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Baselines materialising N x N scores (eager, compiled reference) are skipped past this share of
# free GPU memory rather than dying of out-of-memory halfway through the bench.
SCORE_MEMORY_SHARE = 0.5


def gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    info = {"name": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "driver": _driver_version()}
    from cubridge.runtime.build import compiler_version, default_compiler
    compiler = default_compiler()            # the one measure jobs build with: "nvcc" or "nvrtc"
    try:
        info[compiler] = compiler_version(compiler)
    except Exception as e:   # noqa: BLE001 - informative only
        info[compiler] = f"unknown ({e})"
    return info


def _driver_version() -> str:
    try:
        v = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        return "unknown"


def _spec(job: KernelJob):
    from cubridge.search.building import spec_for
    return spec_for(job)


def _extras(bind, cuir: dict, B, Hq, Hkv, N, device="cuda", Nq=None) -> dict:
    """The kernel's extra inputs at one shape; runtime inputs get the spec's representative values
    (the same ones spec.run_reference samples at this shape)."""
    if bind is None:
        return {}
    extra = bind(Nq=N if Nq is None else Nq, Nk=N, Hq=Hq, Hkv=Hkv, B=B, params=cuir, device=device)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}


def launcher(job: KernelJob, lowered, cubin: bytes):
    """`prepare(extra, device) -> call(q, k, v, out)` of the job's reference kernel for a lowered
    candidate (ReferenceKernel.launcher). Extra inputs are packed once per shape, outside the
    timed call."""
    from cubridge.runtime.kernels import reference_kernel
    return reference_kernel(job.reference).launcher(lowered, cubin, job.config)


def _is_cuda_fault(e: Exception) -> bool:
    text = str(e)
    return "CUDA" in text or "illegal" in text or "unspecified launch failure" in text


def check_and_time(job: KernelJob, lowered, cubin: bytes, bind):
    """The verification rule at every case of gpu_cases.check_cases (this tile config's KV ring,
    Nq < Nk, GQA / MQA, the spec's structure length, the targets' query lengths), O and LSE, then
    the median time at every target shape."""
    from cubridge.search.gpu_cases import check_cases, structure_length
    from cubridge.search.space import SPACES
    prepare = launcher(job, lowered, cubin)
    cuir = SPACES[job.reference].to_cuir(job.config)
    dtype = DTYPES[job.dtype]
    hq, hkv, d = job.heads_q, job.heads_kv, job.head_dim
    checks: list = []
    try:
        spec = _spec(job)
        try:
            structure = structure_length(spec, job.spec_params, cuir, hq, hkv)
        except Exception as e:   # noqa: BLE001 - the other cases still run; the record says why not this one
            if _is_cuda_fault(e):
                raise
            structure = None
            checks.append({"shape": "structure length", "result": f"not found: {str(e).splitlines()[0]}"})
        cases = check_cases(hq, hkv, cuir, job.shapes, structure)
        failed = run_checks(lambda c: prepare(_extras(bind, cuir, c.B, c.Hq, c.Hkv, c.Nk, Nq=c.Nq), "cuda"),
                            spec, job.spec_params, cases, d, dtype, checks)
        if failed:
            return Outcome(TrialState.WRONG_ANSWER, failed), {"check": checks}
        times = {}
        for t in job.shapes:
            q, k, v = random_inputs(t.batch, hq, hkv, t.seqlen, d, dtype, seed=7, Nq=t.nq)
            call = prepare(_extras(bind, cuir, t.batch, hq, hkv, t.seqlen, Nq=t.nq), "cuda")
            times[t.key] = time_ms(call, (q, k, v, torch.empty_like(q)))
    except Exception as e:   # noqa: BLE001 - a launch fault is this trial's outcome
        data = {"check": checks, "restart_worker": _is_cuda_fault(e)}
        return Outcome(TrialState.CRASH, f"{type(e).__name__}: {str(e)[:2000]}"), data
    return Outcome(TrialState.OK, f"{len(checks)} GPU checks passed", times), {"check": checks, "device": device_info()}


def run_checks(call_at, spec, spec_params: dict, cases, d: int, dtype, checks: list, device="cuda") -> str | None:
    """gpu_check at each case (gpu_cases.CheckCase) with `call_at(case)`'s kernel call, appending
    {"shape", "result"} to `checks`; the first failure's message, or None when all pass."""
    for c in cases:
        why = gpu_check(call_at(c), spec, spec_params, (c.B, c.Hq, c.Hkv, c.Nk, d, c.seed, c.Nq or c.Nk), dtype,
                        device=device)
        checks.append({"shape": f"{c.label} D={d}", "result": why or "pass"})
        if why:
            return f"GPU check at {checks[-1]['shape']}: {why}"
    return None


def random_inputs(B, Hq, Hkv, N, D, dtype, seed, device="cuda", Nq=None):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, Hq, N if Nq is None else Nq, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, generator=g)
    return q, k, v


def gpu_check(call, spec, spec_params: dict, shape, dtype, device="cuda") -> str | None:
    """None when the rule (cubridge.rule.check_run) holds for `call(q, k, v, out, lse=None)` on
    fresh random inputs of `shape` (B, Hq, Hkv, N, D, seed[, Nq]: Nq <= N, queries end-aligned),
    for O and, where the spec normalises with softmax, for the LSE the call returns (natural log,
    -inf for a row with no key; poisoned first, bitwise on rerun); else the reason."""
    from cubridge.verify import lse_of
    B, Hq, Hkv, N, D, seed, *nq = shape
    q, k, v = random_inputs(B, Hq, Hkv, N, D, dtype, seed, device, Nq=nq[0] if nq else None)
    golden = spec.run_reference(q.double(), k.double(), v.double(), **spec_params)
    ref = spec.run_reference(q, k, v, **spec_params)
    lses: list = []
    why = rule.check_run(_recording_lse(call, lses), (q, k, v), golden, ref)
    if why:
        return why
    lse_golden = lse_of(spec, q.double(), k.double(), spec_params)
    if lse_golden is None:              # no softmax: the kernel's LSE slot means nothing
        return None
    if not torch.equal(lses[0].nan_to_num(7.0), lses[1].nan_to_num(7.0)):
        return "two runs differ in LSE (race or uninitialised read)"
    verdict = rule.compare(lses[0], lse_golden, lse_of(spec, q, k, spec_params))
    return None if verdict.passed else f"LSE: {verdict.reason}"


def _recording_lse(call, lses: list):
    """call(q, k, v, out) for check_run: the launcher's call (ReferenceKernel.launcher contract:
    call(q, k, v, out, lse=None) -> (out, lse)) handed a NaN-poisoned LSE, so a row never written
    shows; keeps the LSE each run returns (a kernel may return its own instead of the slot's)."""
    def run(q, k, v, out):
        lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
        res = call(q, k, v, out, lse=lse)
        if isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], torch.Tensor):
            lse = res[1]
        lses.append(lse.clone())
    return run


# ------------------------------------------------------------------ side by side with baselines
def time_ms(fn, args: tuple = ()) -> float:
    """Median ms of fn(*args) under the one timing protocol (cubridge.runtime.timing)."""
    from cubridge.runtime.timing import bench
    return bench(lambda: fn(*args)).median_ms


def _built(job: KernelJob):
    """prepare(extra, device) of one kernel job (lowered and compiled through the cache)."""
    from cubridge.search.building import build
    lowered, result = build(job)
    return launcher(job, lowered, result.cubin)


def _shape_call(prepare, job: KernelJob, b: int, hq: int, hkv: int, n: int, nq: int | None = None):
    """The call(q, k, v, out) of a prepared kernel at one shape (its extra inputs bound)."""
    from cubridge.search.building import binder_for
    from cubridge.search.space import SPACES
    cuir = SPACES[job.reference].to_cuir(job.config)
    return prepare(_extras(binder_for(job), cuir, b, hq, hkv, n, Nq=nq), "cuda")


def bench_side_by_side(p: dict):
    """Ours (the dispatch table's kernel per shape) and every baseline, shape by shape."""
    base = KernelJob.from_json(p, BENCH_KEYS)
    spec, sp = _spec(base), base.spec_params
    dtype, hq, hkv, d = DTYPES[base.dtype], base.heads_q, base.heads_kv, base.head_dim
    rows = {}
    for e in p["entries"]:
        entry, t = KernelJob.from_json(e, ("shape",)), TargetShape(**e["shape"])
        n, b = t.seqlen, t.batch
        row = {"flops": attended_flops(spec, sp, b, hq, hkv, n, d, t.nq), "baselines_ms": {}, "baseline_errors": {}}
        q, k, v = random_inputs(b, hq, hkv, n, d, dtype, seed=11, Nq=t.nq)
        try:
            call = _shape_call(_built(entry), entry, b, hq, hkv, n, t.nq)
            row["ours_ms"] = time_ms(call, (q, k, v, torch.empty_like(q)))
        except Exception as e:   # noqa: BLE001 - reported beside the baselines
            row["ours_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        for name, make in BASELINES.items():
            try:
                row["baselines_ms"][name] = time_ms(make(spec, sp, q, k, v))
            except BaselineSkipped as e:
                row["baseline_errors"][name] = f"skipped: {e}"
            except Exception as e:   # noqa: BLE001
                row["baseline_errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.empty_cache()
        rows[t.key] = row
    return Outcome(TrialState.OK, f"{len(rows)} shapes timed beside baselines"), {"shapes": rows, "device": device_info()}


def race(p: dict):
    """The tuner's finalists, shape by shape, timed round-robin in one process (drift hits them
    alike; single trials timed minutes apart are not comparable to a few %). p["finalists"]:
    {trial number: kernel payload}; p["by_shape"]: {shape key: [trial numbers]}; p["shapes"]: the
    targets. Returns {"shapes": {key: {trial: median ms}}, "errors": {key: {trial: error}}}."""
    from cubridge.runtime.timing import bench_round_robin
    base = KernelJob.from_json(p, RACE_KEYS)
    finalists = {num: KernelJob.from_json(e) for num, e in p["finalists"].items()}
    dtype, hq, hkv, d = DTYPES[base.dtype], base.heads_q, base.heads_kv, base.head_dim
    built, shapes, errors = {}, {}, {}
    for t in base.shapes:
        trials = p["by_shape"].get(t.key) or []
        if len(trials) < 2:
            continue
        n, b = t.seqlen, t.batch
        q, k, v = random_inputs(b, hq, hkv, n, d, dtype, seed=13, Nq=t.nq)
        out = torch.empty_like(q)
        calls = {}
        for num in trials:
            entry = finalists[str(num)]
            try:
                if num not in built:
                    built[num] = _built(entry)
                calls[num] = _shape_call(built[num], entry, b, hq, hkv, n, t.nq)
            except Exception as e:   # noqa: BLE001 - this finalist drops out of the race
                errors.setdefault(t.key, {})[str(num)] = f"{type(e).__name__}: {str(e)[:300]}"
        if len(calls) < 2:
            continue
        timings = bench_round_robin([lambda c=c: c(q, k, v, out) for c in calls.values()])
        shapes[t.key] = {str(num): tm.median_ms for num, tm in zip(calls, timings)}
    return (Outcome(TrialState.OK, f"{len(shapes)} shape(s) raced"),
            {"shapes": shapes, "errors": errors, "device": device_info()})


def attended_flops(spec, sp, B, Hq, Hkv, N, D, Nq=None) -> float:
    from cubridge.transfer.pairs import count_attended
    Nq = N if Nq is None else Nq
    if not spec.has_hooks:
        return 4.0 * D * B * Hq * Nq * N
    hooks = spec.hooks_for(Nq, N, Hq, Hkv, "cuda", B=B, **sp)
    return 4.0 * D * count_attended(hooks, B, Hq, Nq, N, device="cuda")


class BaselineSkipped(Exception):
    """A baseline that does not apply to the spec (no softmax form, a score_mod SDPA cannot take)."""


def softmax_hooks(spec, sp, q, k):
    if not spec.has_hooks:
        raise BaselineSkipped("the spec has no hooks")
    hooks = spec.hooks_for(q.shape[2], k.shape[2], q.shape[1], k.shape[1], "cuda", B=q.shape[0], **sp)
    if not hooks.flex_expressible:
        raise BaselineSkipped(f"normalisation {hooks.normalization.kind} has no softmax form")
    return hooks


def _flex(spec, sp, q, k, v):
    from cubridge.runtime.timing import compiled_flex_attention
    hooks = softmax_hooks(spec, sp, q, k)
    compiled, create_block_mask = compiled_flex_attention()
    hooks = hooks.for_flex(q.shape[2], k.shape[2])       # FlexAttention's q_idx is the row, ours the position
    block_mask = None
    if hooks.mask_mod is not None:
        block_mask = create_block_mask(hooks.mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2], device="cuda")
    gqa = q.shape[1] != k.shape[1]
    return lambda: compiled(q, k, v, score_mod=hooks.score_mod, block_mask=block_mask, enable_gqa=gqa)


def _sdpa(spec, sp, q, k, v):
    import torch.nn.functional as F
    gqa = q.shape[1] != k.shape[1]
    if spec.name in ("causal", "full") and q.shape[2] == k.shape[2]:   # SDPA's is_causal is top-left aligned
        causal = spec.name == "causal"
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    hooks = softmax_hooks(spec, sp, q, k)
    if hooks.score_mod is not None:
        raise BaselineSkipped("SDPA cannot apply a score_mod")
    if hooks.mask_mod is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    from cubridge.spec import index_grids
    n, nk = q.shape[2], k.shape[2]
    b, h, qi, ki = index_grids(q.shape[0], q.shape[1], torch.arange(nk - n, nk, device="cuda"), nk, "cuda")
    mask = torch.broadcast_to(hooks.mask_mod(b, h, qi, ki), (q.shape[0], q.shape[1], n, nk)).contiguous()
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _score_memory_guard(q, k):
    need = 3 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4   # scores, probabilities, mask (fp32)
    free, _ = torch.cuda.mem_get_info()
    if need > SCORE_MEMORY_SHARE * free:
        raise BaselineSkipped(f"would materialise {need / 2**30:.1f} GiB of scores ({free / 2**30:.1f} GiB free)")


def _eager(spec, sp, q, k, v):
    _score_memory_guard(q, k)
    return lambda: spec.run_reference(q, k, v, **sp)


def _compiled(spec, sp, q, k, v):
    _score_memory_guard(q, k)
    if q.shape[2] != k.shape[2]:
        raise BaselineSkipped("the compiled reference runs at Nq == Nk only (run_reference pads the queries)")
    ref = torch.compile(spec.reference)
    params = spec.resolved_params(**sp)
    params.update(spec.runtime_for(q.shape[2], k.shape[2], q.shape[1], k.shape[1], q.shape[0], q.device, None, params))
    return lambda: ref(q, k, v, **params)


BASELINES = {"flex_attention": _flex, "sdpa": _sdpa, "eager": _eager, "torch_compile": _compiled}

