"""A tuning run killed with SIGKILL and resumed loses no finished trial and repeats none.

`python -m cubridge.cli tune` runs on the replay runner (a synthetic recording, 0.2 s per job),
is killed once some trials are in trials.jsonl, then `--resume` finishes the budget."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import optuna

from cubridge.config import load_config
from cubridge.search.testing_jobs import synthetic_recording

TRIALS = 12
KILL_AFTER = 5          # lines in trials.jsonl


def measured(lines):
    return [r for r in lines if r["outcome"]["state"] != "config_invalid"]


def read_log(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def test_sigkill_then_resume_loses_and_repeats_nothing(tmp_path):
    out = tmp_path / "out"
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        spec: causal
        reference: fa3_sm90
        shapes: {{model: llama2-7b, lengths: [1024, 8192]}}
        budget: {{trials: {TRIALS}, minutes: 5}}
        output: {out}
        """))
    cfg = load_config(cfg_path)
    rec = tmp_path / "recording.json"
    rec.write_text(json.dumps(synthetic_recording("fa3_sm90", 128, "sm_90a", cfg.shapes.targets, fail_every=4,
                                                  delay_s=0.2)))
    cmd = [sys.executable, "-m", "cubridge.cli", "tune", str(cfg_path), "--runner", "replay", "--replay", str(rec)]
    env = {**os.environ, "CI": "true", "PYTHONUNBUFFERED": "1"}
    log = out / "trials.jsonl"

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while len(read_log(log)) < KILL_AFTER and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    first_output = proc.communicate()[0].decode()
    assert proc.returncode == -signal.SIGKILL, first_output
    before = read_log(log)
    assert KILL_AFTER <= len(before) and len(measured(before)) < TRIALS, "the kill must land mid-run"

    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    after = read_log(log)

    by_number = {r["number"]: r for r in after}
    assert len(by_number) == len(after)
    assert all(by_number[r["number"]] == r for r in before), "a finished trial was lost or rewritten"
    points = [(r["proposal_id"], json.dumps(r["config"]["point"], sort_keys=True)) for r in after]
    assert len(set(points)) == len(points), "a finished trial was run again"
    assert len(measured(after)) == TRIALS

    study = optuna.load_study(study_name=f"{cfg.name}-{cfg.search_key}", storage=f"sqlite:///{out / 'study.db'}")
    states = {t.number: t for t in study.trials}
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    for r in after:
        assert states[r["number"]].user_attrs["state"] == r["outcome"]["state"]
    interrupted = [t for t in study.trials if t.user_attrs.get("state") == "interrupted"]
    assert all(t.state == optuna.trial.TrialState.FAIL and t.number not in by_number for t in interrupted)
    assert (out / "report.md").is_file() and (out / "dispatch.json").is_file()
