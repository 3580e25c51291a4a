"""One tuning run per output directory: two tunes (or two resumes) on one directory, the second
started at several points of the first's life, end with exactly one run (exit 0) and the other
refused (exit 2, naming the holder's pid); no trial is measured twice and the budget holds.

The runs are `python -m cubridge.cli tune` on the replay runner (a synthetic recording). Offsets are
events, not clock times, and the overlap is made certain rather than likely: the recording names a
gate file, and while it exists the replay runner answers no job, so the run holding the lock waits
(lock held) until the other has been refused - on any machine load."""
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


def _setup(tmp_path, trials=TRIALS, gate_after=0):
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
    recording = synthetic_recording("fa3_sm90", 128, "sm_90a", cfg.shapes.targets, fail_every=4, delay_s=0.05)
    rec.write_text(json.dumps({**recording, "gate": str(tmp_path / "gate"), "gate_after": gate_after}))
    cmd = [sys.executable, "-m", "cubridge.cli", "tune", str(cfg_path), "--runner", "replay", "--replay", str(rec)]
    return out, cmd


def _log(out):
    path = out / "trials.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _measured(lines):
    return [r for r in lines if r["outcome"]["state"] != "config_invalid"]


def _race(cmd, out, wait_lines, gate):
    """Close the gate, run A (it pauses, lock held, after the recording's gate_after jobs); once A's
    log has `wait_lines` lines start B; when one of them has exited, open the gate; both to the end."""
    env = {**os.environ, "CI": "true", "PYTHONUNBUFFERED": "1"}
    gate.touch()
    a = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while len(_log(out)) < wait_lines and a.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    b = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while a.poll() is None and b.poll() is None and time.monotonic() < deadline + 180:
        time.sleep(0.05)
    gate.unlink()
    outs = [p.communicate(timeout=180)[0] for p in (a, b)]
    return [a.returncode, b.returncode], outs


def _assert_one_ran(codes, outs, out, budget):
    assert sorted(codes) == [0, 2], "\n----\n".join(outs)
    loser = outs[codes.index(2)]
    assert "Traceback" not in loser, loser
    assert "in use by another tuning run (pid " in loser, loser
    lines = _log(out)
    assert len({r["number"] for r in lines}) == len(lines), "a trial number was logged twice"
    points = [(r["proposal_id"], json.dumps(r["config"]["point"], sort_keys=True)) for r in lines]
    assert len(set(points)) == len(points), "a trial was measured twice"
    assert len(_measured(lines)) == budget


# gate_after: jobs answered before the run holding the lock pauses (0: at once; 4: the screen job
# and three trials, so B arrives mid-run); wait_lines: trial-log lines before B starts.
@pytest.mark.parametrize("gate_after, wait_lines", [(0, 0), (4, 2)], ids=["together", "mid-run"])
def test_two_tunes_on_one_directory_one_runs(tmp_path, gate_after, wait_lines):
    out, cmd = _setup(tmp_path, gate_after=gate_after)
    codes, outs = _race(cmd, out, wait_lines, tmp_path / "gate")
    _assert_one_ran(codes, outs, out, TRIALS)
    if wait_lines:   # B started while A was measuring: the lock refused it, naming A's pid
        assert codes == [0, 2], outs


@pytest.mark.parametrize("gate_after, extra_lines", [(0, 0), (2, 1)], ids=["together", "mid-run"])
def test_two_resumes_on_one_directory_one_runs(tmp_path, gate_after, extra_lines):
    out, cmd = _setup(tmp_path, trials=4, gate_after=gate_after)
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "CI": "true"})
    assert first.returncode == 0, first.stdout + first.stderr
    before = _log(out)
    codes, outs = _race(cmd + ["--resume", "--trials", str(TRIALS)], out, len(before) + extra_lines if extra_lines
                        else 0, tmp_path / "gate")
    _assert_one_ran(codes, outs, out, TRIALS)
    assert _log(out)[:len(before)] == before, "a finished trial was lost or rewritten"
    if extra_lines:
        assert codes == [0, 2], outs


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
