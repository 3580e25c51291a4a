"""GPU side of the "backward" job (cubridge.search.backward): each backward config of the run's
spec checked under the verification rule, then every config that passed timed round-robin at each
target shape beside FlexAttention's backward.

The check (one shape past several tiles, GQA, ragged): dQ, dK, dV from the lowered backward against
torch.autograd of the spec's reference in float64 (golden) and in the kernel dtype (ref), outputs
poisoned with NaN first, inputs unchanged; the forward's out and LSE come from the spec's hooks in
float64 (variant_bwd.reference_forward), so only the backward is under test.

The timing needs a forward's out and LSE at the target shape, where the float64 reference would
not fit: they come from the dense non-causal forward of the same q, k, v (runtime.autograd). The
kernel's work does not depend on their values (masks and tiles come from the spec), and that LSE is
at least every masked row's true one, so P stays in [0, 1] and nothing overflows.
"""
from __future__ import annotations

import torch

from cubridge.runtime.variant_bwd import HOPPER_LABEL
from cubridge.search.backward import PAYLOAD_KEYS
from cubridge.search.measure import DTYPES, BaselineSkipped, attended_flops, device_info, random_inputs, softmax_hooks
from cubridge.search.messages import KernelJob
from cubridge.vocab import Outcome, TrialState

CHECK_SHAPE = (2, 4, 2, 1000, 1300)    # B, Hq, Hkv (GQA), Nq, Nk: ragged ends, Nq < Nk, many tiles
BWD_FLOPS = 2.5                         # a backward's FLOPs per forward FLOP (issue 17's convention)


def measure_backward(p: dict):
    from cubridge.runtime.timing import bench_round_robin
    job = KernelJob.from_json(p, PAYLOAD_KEYS)
    spec, sp = _spec(job), dict(job.spec_params)
    dtype = DTYPES[job.dtype]
    backwards = {label: _variant_backward(spec, label, sp) for label in p["bwd_configs"]}
    _prebuild(backwards.values(), job.head_dim, dtype)
    checks = _checks(backwards, spec, sp, job.head_dim, dtype)
    passed = {label: backwards[label] for label, verdict in checks.items() if verdict == "pass"}
    shapes = {}
    for t in job.shapes:
        b, n, nq = t.batch, t.seqlen, t.nq
        q, k, v = random_inputs(b, job.heads_q, job.heads_kv, n, job.head_dim, dtype, seed=17, Nq=nq)
        dout = torch.randn_like(q)
        out, lse = _dense_forward(q, k, v)
        calls, labels = [], []
        for label, bwd in passed.items():
            calls.append(lambda bwd=bwd: bwd(dout, q, k, v, out, lse, sm_scale=job.head_dim ** -0.5))
            labels.append(label)
        row = {"flops": BWD_FLOPS * attended_flops(spec, sp, b, job.heads_q, job.heads_kv, n, job.head_dim, nq),
               "configs_ms": {}, "baselines_ms": {}, "baseline_errors": {}}
        try:
            calls.append(_flex_backward(spec, sp, q, k, v, dout))
            labels.append("flex")
        except BaselineSkipped as e:
            row["baseline_errors"]["flex"] = f"skipped: {e}"
        except Exception as e:   # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            row["baseline_errors"]["flex"] = f"{type(e).__name__}: {str(e)[:300]}"
        for label, tm in zip(labels, bench_round_robin(calls) if calls else []):
            (row["baselines_ms"] if label == "flex" else row["configs_ms"])[label] = tm.median_ms
        shapes[t.key] = row
        torch.cuda.empty_cache()
    if not passed:
        return (Outcome(TrialState.WRONG_ANSWER, "no backward config passed the gradient check: "
                        + "; ".join(f"{k}: {v}" for k, v in checks.items())),
                {"checks": checks, "shapes": shapes, "device": device_info()})
    return (Outcome(TrialState.OK, f"{len(passed)} of {len(checks)} backward configs passed and were timed"),
            {"checks": checks, "shapes": shapes, "device": device_info()})


def _spec(job):
    from cubridge.search.building import spec_for
    return spec_for(job)


def _variant_backward(spec, label: str, sp: dict):
    from cubridge.runtime.build import default_compiler
    from cubridge.runtime.fa2_bwd_sm80 import Config, Fa2BwdSm80
    from cubridge.runtime.variant_bwd import VariantBackward
    if label == HOPPER_LABEL:     # the Hopper variant backward (raises off sm_90: that point fails its check)
        return VariantBackward(spec, use_hopper=True, **sp)
    config = Config.parse(label)
    return VariantBackward(spec, config=config, kernel=Fa2BwdSm80(config, compiler=default_compiler()),
                           use_hopper=False, **sp)


def _prebuild(backwards, head_dim: int, dtype) -> None:
    """Compile every config's kernel up front, in parallel (the compiler runs outside the GIL):
    one at a time, eight configs took minutes of the job. A config that fails to build fails
    again, with its message, in its check."""
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.runtime.launch import device_arch

    def build(bwd):
        if getattr(bwd, "use_hopper", False):   # fa3_bwd_sm90 builds at its first call
            return
        try:
            bwd.kernel.build(head_dim, dtype, False, False, device_arch(torch.device("cuda")), source=bwd.source)
        except Exception:   # noqa: BLE001 - reported by _check
            pass
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(build, backwards))


def _checks(backwards: dict, spec, sp: dict, d: int, dtype) -> dict[str, str]:
    """{label: "pass" or why not}: cubridge.rule.check_backward on one GradCase for every config."""
    from cubridge.runtime.variant_bwd import GradCase
    try:
        case = GradCase(spec, sp, CHECK_SHAPE + (d,), dtype, seed=29)
    except Exception as e:   # noqa: BLE001 - a reference that cannot run fails every config, named
        return dict.fromkeys(backwards, f"the reference: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return {label: _check(case, bwd) for label, bwd in backwards.items()}


def _check(case, bwd) -> str:
    try:
        verdict = case.check(bwd)
    except Exception as e:   # noqa: BLE001 - a config that cannot build or launch fails its check
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return "pass" if verdict.passed else verdict.reason


def _dense_forward(q, k, v):
    from cubridge.runtime.autograd import forward_with_lse
    return forward_with_lse(q, k, v, False, None)


def _flex_backward(spec, sp, q, k, v, dout):
    """FlexAttention's backward alone: the compiled forward builds the graph once; each call
    differentiates it again (retain_graph), as the peers' backward is timed in experiments/."""
    from cubridge.runtime.timing import compiled_flex_attention
    hooks = softmax_hooks(spec, sp, q, k).for_flex(q.shape[2], k.shape[2])
    compiled, create_block_mask = compiled_flex_attention()
    block_mask = None
    if hooks.mask_mod is not None:
        block_mask = create_block_mask(hooks.mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2], device="cuda")
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = compiled(qg, kg, vg, score_mod=hooks.score_mod, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)
