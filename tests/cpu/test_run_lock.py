"""One tuning run per output directory: two tunes (or two resumes) on one directory, the second
started at several points of the first's life, end with exactly one run (exit 0) and the other
refused (exit 2, naming the holder's pid); no trial is measured twice and the budget holds.

The runs are `python -m cubridge.cli tune` on the replay runner (a synthetic recording, 0.3 s per
job). Offsets are events, not clock times: "together" starts both at once, "mid-run" starts the
second once the first has logged trials, so the test does not depend on the machine's load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from cubridge.config import load_config
from cubridge.search.lock import RunLock
from cubridge.search.testing_jobs import synthetic_recording

TRIALS = 8


def _setup(tmp_path, trials=TRIALS):
    out = tmp_path / "out"
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        spec: causal
        reference: fa3_sm90
        shapes: {{model: llama2-7b, lengths: [1024, 8192]}}
        budget: {{trials: {trials}, minutes: 5}}
        output: {out}
        """))
    cfg = load_config(cfg_path)
    rec = tmp_path / "recording.json"
    rec.write_text(json.dumps(synthetic_recording("fa3_sm90", 128, "sm_90a", cfg.shapes.targets, fail_every=4,
                                                  delay_s=0.3)))
    cmd = [sys.executable, "-m", "cubridge.cli", "tune", str(cfg_path), "--runner", "replay", "--replay", str(rec)]
    return out, cmd


def _log(out):
    path = out / "trials.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _measured(lines):
    return [r for r in lines if r["outcome"]["state"] != "config_invalid"]


def _race(cmd, out, offset_lines):
    """Start run A, then run B once A's log has `offset_lines` lines (0: at once); both to the end."""
    env = {**os.environ, "CI": "true", "PYTHONUNBUFFERED": "1"}
    a = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while offset_lines and len(_log(out)) < offset_lines and a.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    b = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = [p.communicate(timeout=180)[0] for p in (a, b)]
    return [a.returncode, b.returncode], outs


def _assert_one_ran(codes, outs, out, budget):
    assert sorted(codes) == [0, 2], "\n----\n".join(outs)
    loser = outs[codes.index(2)]
    # Refused by the lock (naming the holder), or - when the winner had already finished before the
    # loser looked - by the finished run in the directory; never a traceback.
    assert "Traceback" not in loser, loser
    assert "in use by another tuning run (pid " in loser or "already holds a run" in loser, loser
    lines = _log(out)
    assert len({r["number"] for r in lines}) == len(lines), "a trial number was logged twice"
    points = [(r["proposal_id"], json.dumps(r["config"]["point"], sort_keys=True)) for r in lines]
    assert len(set(points)) == len(points), "a trial was measured twice"
    assert len(_measured(lines)) == budget


@pytest.mark.parametrize("offset", [0, 2], ids=["together", "mid-run"])
def test_two_tunes_on_one_directory_one_runs(tmp_path, offset):
    out, cmd = _setup(tmp_path)
    codes, outs = _race(cmd, out, offset)
    _assert_one_ran(codes, outs, out, TRIALS)
    if offset:   # B started while A was measuring: the lock refused it, naming A's pid
        assert "in use by another tuning run (pid " in outs[1], outs[1]


@pytest.mark.parametrize("offset", [0, 2], ids=["together", "mid-run"])
def test_two_resumes_on_one_directory_one_runs(tmp_path, offset):
    out, cmd = _setup(tmp_path, trials=4)
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "CI": "true"})
    assert first.returncode == 0, first.stdout + first.stderr
    before = _log(out)
    codes, outs = _race(cmd + ["--resume", "--trials", str(TRIALS)], out, len(before) + offset)
    assert sorted(codes) == [0, 2], "\n----\n".join(outs)
    loser = outs[codes.index(2)]
    assert "in use by another tuning run (pid " in loser, loser
    _assert_one_ran(codes, outs, out, TRIALS)
    assert _log(out)[:len(before)] == before, "a finished trial was lost or rewritten"


def test_lock_refuses_a_second_holder_and_is_taken_over_after_its_death(tmp_path):
    from cubridge.config import ConfigError
    with RunLock(tmp_path):
        with pytest.raises(ConfigError, match=rf"in use by another tuning run \(pid {os.getpid()}\)"):
            RunLock(tmp_path).acquire()
    # A holder killed with SIGKILL: the kernel drops its flock, and the next run takes the lock.
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import sys, time
        from cubridge.search.lock import RunLock
        RunLock({str(tmp_path)!r}).acquire(); print("held", flush=True); time.sleep(60)""")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=rf"pid {holder.pid}\)"):
        RunLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
