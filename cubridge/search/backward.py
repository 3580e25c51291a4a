"""Backward tuning, in the same run as the forward (`backward: true` in the config; issue 17).

The op's backward is the run's spec lowered onto a backward kernel (cubridge.runtime.variant_bwd):
fa2_bwd_sm80 at its tile configs (block_m x block_n x warps that build at the head dim) and, for
an sm_90 run, fa3_bwd_sm90 (its variant option; on an H100 in session 9 about 1.7x the best fa2
config). The space is small and discrete (at most 9 points), so instead of an Optuna search each point is checked
under the verification rule on the GPU (dQ, dK, dV against float64 autograd of the spec's
reference) and all that pass are timed round-robin at every target shape in one GPU job, beside
FlexAttention's backward where FlexAttention runs the spec. That is the forward's final race
applied to the whole space: the one measurement that decides is taken in one process, under the
same conditions for every point. Each dispatch bucket then carries its shape's fastest config
(`"backward"` in dispatch.json), which cubridge.op's backward uses for that bucket.

Driver side here; the GPU job is cubridge.search.measure_bwd (registered as "backward").
"""
from __future__ import annotations

from cubridge.runtime.variant_bwd import HOPPER_LABEL   # the Hopper variant backward: one point
from cubridge.vocab import Job, TrialState

KERNEL = "fa2_bwd_sm80"
HOPPER_KERNEL = "fa3_bwd_sm90"
BLOCK_M = (64, 128)
BLOCK_N = (64, 128)
WARPS = (4, 8)
PAYLOAD_KEYS = ("bwd_configs",)       # what the backward job adds to a KernelJob's JSON


def space(head_dim: int, arch: str = "sm_80") -> list[str]:
    """Labels of the backward points that build at `head_dim`: fa2_bwd_sm80's valid configs
    (Config.problems empty), its default first (what an untuned op runs off Hopper), then, for an
    sm_90 arch, the Hopper variant backward (HOPPER_LABEL)."""
    from cubridge.runtime.fa2_bwd_sm80 import Config, default_config
    from cubridge.runtime.fa3_bwd_sm90 import HEAD_DIMS as HOPPER_HEAD_DIMS
    default = default_config(head_dim)
    points = [Config(m, n, w) for m in BLOCK_M for n in BLOCK_N for w in WARPS]
    valid = [c for c in points if not c.problems(head_dim)]
    labels = [str(default)] + [str(c) for c in valid if c != default]
    if arch.startswith("sm_90") and head_dim in HOPPER_HEAD_DIMS:
        labels.append(HOPPER_LABEL)
    return labels


def kernel_of(label: str) -> str:
    return HOPPER_KERNEL if label == HOPPER_LABEL else KERNEL


def job(cfg, cand) -> Job:
    """The GPU job: every config of space() checked and timed at every target shape."""
    from cubridge.search.messages import payload
    body = {**payload(cfg, cand), "candidate": "backward", "bwd_configs": space(cfg.shapes.head_dim, cfg.arch)}
    # one gradient check per config plus the timings: a few trials' worth of time
    return Job("backward", body, 3 * cfg.runner.timeout_s, needs_gpu=True)


def tune(cfg, cand, runner, say) -> dict:
    """Run the job; {"outcome", "shapes": {key: {...}}, "checks": {...}} (the job's data), with the
    outcome of a failed job kept so the report says why nothing was chosen."""
    from cubridge.search.messages import run_jobs
    configs = space(cfg.shapes.head_dim, cfg.arch)
    say(f"backward: checking and timing {len(configs)} config(s) ({', '.join(sorted({kernel_of(c) for c in configs}))}) "
        f"at {len(cfg.shapes.targets)} shape(s)")
    res = run_jobs(runner, [job(cfg, cand)])["backward"]
    if res.outcome.state != TrialState.OK:
        say(f"backward: {res.outcome.state.value}: {(res.outcome.reason.splitlines() or [''])[0][:300]}")
    return {"outcome": res.outcome.to_json(), **res.data}


def choose(result: dict, dispatch: list[dict]) -> None:
    """Give each dispatch bucket its shape's fastest backward config that passed the check:
    entry["backward"] = {"kernel", "config", "ms"}. Buckets whose shape has no timed config keep
    none (the op then runs the kernel's default config)."""
    passed = {label for label, verdict in (result.get("checks") or {}).items() if verdict == "pass"}
    for e in dispatch:
        times = ((result.get("shapes") or {}).get(e["shape"]) or {}).get("configs_ms") or {}
        timed = {label: ms for label, ms in times.items() if label in passed and ms is not None}
        if timed:
            best = min(timed, key=timed.get)
            e["backward"] = {"kernel": kernel_of(best), "config": best, "ms": timed[best]}


def report_section(result: dict, dispatch: list[dict]) -> str:
    """The report's "Backward" section: per shape the chosen config, its time and TFLOPS beside
    the default config and FlexAttention's backward; then each config's check verdict."""
    from cubridge.runtime.timing import tflops
    outcome = result.get("outcome") or {}
    if outcome.get("state") != TrialState.OK.value:
        return f"Not tuned: {outcome.get('state')}: {(outcome.get('reason') or '').splitlines()[:1]}"
    lines = ["| shape | config | ours ms | ours TFLOPS | default config ms | FlexAttention ms | speedup vs Flex |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    default = next(iter(result.get("checks") or {}), None)
    for e in dispatch:
        s = (result.get("shapes") or {}).get(e["shape"]) or {}
        b, flops = e.get("backward"), s.get("flops")
        flex = (s.get("baselines_ms") or {}).get("flex")
        d_ms = (s.get("configs_ms") or {}).get(default)
        ours = b["ms"] if b else None
        lines.append(f"| {e['shape']} | {b['config'] if b else '-'} | {_f(ours, '.3f')} | "
                     f"{_f(tflops(flops, ours) if flops and ours else None)} | {_f(d_ms, '.3f')} | "
                     f"{_f(flex, '.3f')} | {_f(flex / ours if flex and ours else None, '.2f')} |")
    checks = [f"- {label}: {verdict}" for label, verdict in (result.get("checks") or {}).items()]
    errors = [f"- {k}: {v}" for k, v in (result.get("baseline_errors") or {}).items()]
    note = ("TFLOPS of a backward = 2.5 x the forward's FLOPs on attended pairs. Configs checked under the "
            "verification rule (dQ, dK, dV against float64 autograd of the spec's reference) before timing:")
    return "\n".join(lines + ["", note] + checks + (["", "Baselines not run:"] + errors if errors else []))


def _f(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)
