"""Job kinds for the runner contract tests: a worker must survive (or be replaced after) each.

They live in the package, not in tests/, because spawned workers and Ray workers import job kinds
by module name (cubridge.search.jobs loads this module on a miss).

    echo   -> OK, data = payload            sleep  -> OK after payload["seconds"]
    raise  -> raises ValueError (CRASH)     crash  -> os.abort() kills the worker (CRASH)
    pid    -> OK, data = {"pid": os.getpid(), "cuda_visible_devices": ...}
"""
from __future__ import annotations

import os
import time

from cubridge.vocab import Outcome, TrialState
from cubridge.search.jobs import register


@register("echo")
def echo(payload: dict):
    return Outcome(TrialState.OK, "echo"), dict(payload)


@register("sleep")
def sleep(payload: dict):
    time.sleep(float(payload.get("seconds", 1.0)))
    return Outcome(TrialState.OK, "slept"), dict(payload)


@register("raise")
def raise_(payload: dict):
    raise ValueError(payload.get("message", "raised on purpose"))


@register("crash")
def crash(payload: dict):
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # no core file from a deliberate abort
    except (ImportError, ValueError, OSError):
        pass
    os.abort()


@register("pid")
def pid(payload: dict):
    return Outcome(TrialState.OK, "pid"), {"pid": os.getpid(),
                                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


# ------------------------------------------------------------------ synthetic recordings
# Failure states a synthetic recording cycles through, so search-logic tests meet every kind.
SYNTHETIC_FAILURES = ("compile_error", "crash", "wrong_answer", "timeout")


def synthetic_recording(kernel: str, head_dim: int, arch: str, targets, *, fail_every: int = 5, gpus: int = 1,
                        delay_s: float = 0.0) -> dict:
    """A replay file (see runners/replay.py) for CPU tests of the search: made-up times, labelled
    as such, for every valid point of `kernel`'s space; every `fail_every`-th point fails. Screen
    jobs verify; the bench job reports ours and one baseline. Never used outside tests."""
    import math

    from cubridge.search.space import SPACES
    space = SPACES[kernel]
    results = [{"kind": "screen", "match": {}, "outcome": {"state": "verified", "reason": "synthetic"}}]
    for i, pt in enumerate(space.points(head_dim, arch)):
        if fail_every and i % fail_every == fail_every - 1:
            state = SYNTHETIC_FAILURES[(i // fail_every) % len(SYNTHETIC_FAILURES)]
            results.append({"kind": "measure", "match": {"config": pt},
                            "outcome": {"state": state, "reason": f"synthetic {state}"}})
            continue
        # Made up: bigger tiles win at long N, smaller at short N; stages and persistence help a little.
        speed = {t.key: 300 + 40 * math.log2(pt["block_n"] / 64) * math.log2(t.seqlen / 2048)
                 + 10 * pt["stages"] + 15 * bool(pt.get("persistent")) - 0.1 * pt["block_m"] for t in targets}
        times = {t.key: round(4 * t.batch * t.heads_q * t.head_dim * t.seqlen ** 2 / 2 / (speed[t.key] * 1e9), 6)
                 for t in targets}
        results.append({"kind": "measure", "match": {"config": pt},
                        "outcome": {"state": "ok", "reason": "synthetic", "times_ms": times}, "data": {}})
    shapes = {t.key: {"flops": 4.0 * t.batch * t.heads_q * t.head_dim * t.seqlen ** 2 / 2, "ours_ms": None,
                      "baselines_ms": {"flex_attention": 4 * t.batch * t.heads_q * t.head_dim * t.seqlen ** 2 / 2 / 3.5e11},
                      "baseline_errors": {"eager": "skipped: synthetic"}} for t in targets}
    results.append({"kind": "bench", "match": {}, "outcome": {"state": "ok", "reason": "synthetic bench"},
                    "data": {"shapes": shapes, "device": {"name": "synthetic GPU (test recording)"}}})
    return {"device": {"gpus": gpus, "name": "synthetic GPU (test recording)"}, "delay_s": delay_s, "results": results}
