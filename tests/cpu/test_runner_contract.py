"""One contract every Runner must meet (local processes, a real local Ray instance, replay):
every job comes back exactly once; a job that raises, kills its worker (os.abort) or hangs past
its timeout costs that job only (CRASH / TIMEOUT) and the next job runs; results() returns
promptly when nothing is due; close() is idempotent. The replay runner meets it from a recording."""
from __future__ import annotations

import json
import time

import pytest

from cubridge.vocab import Job, Runner, TrialState
from cubridge.search.runners import make_runner

KINDS = ["local", "ray", "replay"]
TIMEOUT_S = 2.0

# What each test job must come back as: the replay runner is told so by its recording.
RECORDING = {"device": {"gpus": 0}, "results": [
    {"kind": "echo", "match": {}, "outcome": {"state": "ok"}, "data": {"echoed": True}},
    {"kind": "raise", "match": {}, "outcome": {"state": "crash", "reason": "job raise raised ValueError: boom"}},
    {"kind": "crash", "match": {}, "outcome": {"state": "crash", "reason": "worker killed by SIGABRT"}},
    {"kind": "sleep", "match": {}, "outcome": {"state": "timeout", "reason": "job ran past its timeout"}},
]}


def _make(kind, tmp_path_factory):
    if kind == "ray":
        pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
        return make_runner("ray", num_cpus=2, object_store_memory=80 << 20)
    if kind == "replay":
        path = tmp_path_factory.mktemp("replay") / "recording.json"
        path.write_text(json.dumps(RECORDING))
        return make_runner("replay", replay=path)
    return make_runner("local", gpus=0)


@pytest.fixture(scope="module", params=KINDS)
def runner(request, tmp_path_factory):
    r = _make(request.param, tmp_path_factory)
    yield r
    r.close()


def collect(runner: Runner, n: int, limit_s: float = 90.0) -> list:
    out, end = [], time.monotonic() + limit_s
    while len(out) < n and time.monotonic() < end:
        out += runner.results(timeout_s=5.0)
    assert len(out) == n, f"{len(out)} of {n} results within {limit_s} s"
    return out


def run_one(runner, job):
    runner.submit([job])
    [res] = collect(runner, 1)
    assert res.job == job
    return res


def test_is_a_runner(runner):
    assert isinstance(runner, Runner)
    assert runner.num_workers >= 1
    assert runner.num_gpus == 0          # a CPU machine (the replay recording says so too)


def test_every_job_comes_back_exactly_once(runner):
    jobs = [Job("echo", {"i": i}, needs_gpu=bool(i % 2)) for i in range(6)]
    runner.submit(jobs)
    got = collect(runner, len(jobs))
    assert sorted(r.job.payload["i"] for r in got) == list(range(6))
    assert all(r.outcome.state == TrialState.OK for r in got)
    assert all(r.worker for r in got)
    assert runner.results(timeout_s=0.5) == []


def test_a_job_that_raises_is_a_crash_outcome(runner):
    res = run_one(runner, Job("raise", {"message": "boom"}, timeout_s=30))
    assert res.outcome.state == TrialState.CRASH
    assert "ValueError" in res.outcome.reason and "boom" in res.outcome.reason
    assert run_one(runner, Job("echo", {"after": "raise"})).outcome.state == TrialState.OK


@pytest.mark.parametrize("needs_gpu", [True, False], ids=["worker", "cpu-task"])
def test_a_job_that_kills_its_worker_costs_only_that_job(runner, needs_gpu):
    res = run_one(runner, Job("crash", {}, timeout_s=30, needs_gpu=needs_gpu))
    assert res.outcome.state == TrialState.CRASH
    assert res.outcome.reason
    assert run_one(runner, Job("echo", {"after": "crash"}, needs_gpu=needs_gpu)).outcome.state == TrialState.OK


@pytest.mark.parametrize("needs_gpu", [True, False], ids=["worker", "cpu-task"])
def test_a_job_past_its_timeout_is_a_timeout_outcome(runner, needs_gpu):
    # A 60 s sleep that comes back TIMEOUT (not OK) was cut at its timeout: no clock needed.
    res = run_one(runner, Job("sleep", {"seconds": 60}, timeout_s=TIMEOUT_S, needs_gpu=needs_gpu))
    assert res.outcome.state == TrialState.TIMEOUT and res.outcome.reason
    assert run_one(runner, Job("echo", {"after": "timeout"}, needs_gpu=needs_gpu)).outcome.state == TrialState.OK


def test_results_return_empty_when_nothing_is_due(runner):
    # How fast is a benchmark's question; here: a bounded wait with nothing queued returns (empty).
    assert runner.results(timeout_s=0.2) == []
    assert runner.results(timeout_s=0) == []


@pytest.mark.parametrize("kind", ["local", "replay"])
def test_close_is_idempotent(tmp_path_factory, kind):
    r = _make(kind, tmp_path_factory)
    r.close()
    r.close()
    with pytest.raises(RuntimeError, match="runner is closed"):
        r.submit([Job("echo", {})])


# ------------------------------------------------------------------ local runner specifics
def test_local_workers_are_restarted_and_see_their_device(tmp_path_factory):
    with make_runner("local", gpus=0) as r:
        first = run_one(r, Job("pid", {})).data
        assert first["cuda_visible_devices"] == ""          # the CPU worker sees no GPU
        assert run_one(r, Job("crash", {})).outcome.state == TrialState.CRASH
        second = run_one(r, Job("pid", {})).data
        assert second["pid"] != first["pid"]
        assert "SIGABRT" in run_one(r, Job("crash", {})).outcome.reason


def test_replay_without_a_recording_says_so(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"results": []}))
    res = run_one(make_runner("replay", replay=path), Job("measure", {"config": {"block_m": 128}}))
    assert res.outcome.state == TrialState.CRASH
    assert "no recorded result" in res.outcome.reason
