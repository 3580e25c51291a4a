"""The tuner's search logic on recorded (synthetic) results, and its CPU-only paths with real
workers: a local spawned worker and a real local Ray instance screening and compiling a small
population. No GPU anywhere: the replay recordings hold made-up times, labelled synthetic."""
from __future__ import annotations

import io
import json
import math
import textwrap
from types import SimpleNamespace

import optuna
import pytest

from cubridge.config import ConfigError, load_config
from cubridge.vocab import TrialState
from cubridge.search.progress import Progress
from cubridge.search.runners import make_runner
from cubridge.search.space import SPACES
from cubridge.search.testing_jobs import synthetic_recording
from cubridge.search.tuner import tune

FAILED = {"compile_error", "crash", "wrong_answer", "timeout"}


def make_cfg(tmp_path, *, spec="causal", reference="fa3_sm90", lengths=(1024, 4096, 16384), trials=12,
             objectives="per_shape", name="run", extra=""):
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        spec: {spec}
        reference: {json.dumps(reference)}
        arch: sm_90a
        shapes: {{heads_q: 8, heads_kv: 2, head_dim: 128, lengths: {list(lengths)}}}
        budget: {{trials: {trials}, minutes: 2}}
        objectives: {objectives}
        output: {tmp_path / ('out_' + name)}
        runner: {{timeout_s: 120}}
        """) + extra)
    return load_config(path)


def replay(tmp_path, cfg, **kw):
    rec = synthetic_recording("fa3_sm90", cfg.shapes.head_dim, cfg.arch, cfg.shapes.targets, **kw)
    path = tmp_path / "recording.json"
    path.write_text(json.dumps(rec))
    return make_runner("replay", replay=path)


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tuned")
    cfg = make_cfg(tmp, trials=14)
    runner = replay(tmp, cfg, fail_every=2)
    return cfg, tune(cfg, runner=runner, say=quiet), runner


def study_of(cfg):
    return optuna.load_study(study_name=f"{cfg.name}-{cfg.search_key}", storage=cfg.storage_url)


def log_of(cfg):
    return [json.loads(line) for line in (cfg.output / "trials.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ search logic on a recording
def test_tunes_within_the_trial_budget(tuned):
    cfg, result, _ = tuned
    assert result.status == "tuned" and result.exit_code == 0
    recs = log_of(cfg)
    assert sum(r["outcome"]["state"] != "config_invalid" for r in recs) == cfg.budget.trials
    assert len({(r["proposal_id"], json.dumps(r["config"]["point"], sort_keys=True)) for r in recs}) == len(recs)


def test_failures_are_trial_states_with_reasons(tuned):
    cfg, _, _ = tuned
    states = {r["outcome"]["state"] for r in log_of(cfg)}
    assert "ok" in states and len(states & FAILED) >= 2, states
    for r in log_of(cfg):
        if r["outcome"]["state"] != "ok":
            assert r["outcome"]["reason"]
    invalid = [r for r in log_of(cfg) if r["outcome"]["state"] == "config_invalid"]
    space = SPACES["fa3_sm90"]
    assert all(space.problems(r["config"]["point"], 128, "sm_90a") for r in invalid)


def test_optuna_study_mirrors_the_trial_log(tuned):
    cfg, _, _ = tuned
    study = study_of(cfg)
    trials = {t.number: t for t in study.trials}
    keys = [t.key for t in cfg.shapes.targets]
    assert len(study.directions) == len(keys)
    for r in log_of(cfg):
        t = trials[r["number"]]
        state = r["outcome"]["state"]
        assert t.user_attrs["state"] == state
        if state == "ok":
            assert t.state == optuna.trial.TrialState.COMPLETE
            assert t.values == [r["outcome"]["times_ms"][k] for k in keys]
        elif state == "config_invalid":
            assert t.state == optuna.trial.TrialState.PRUNED
        else:
            assert t.state == optuna.trial.TrialState.FAIL and t.user_attrs["reason"]
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]


def test_warm_started_from_the_measured_defaults(tuned):
    cfg, _, _ = tuned
    first = study_of(cfg).trials[0]
    known = SPACES["fa3_sm90"].best_known(128)[0]
    assert first.user_attrs.get("warm_start") and first.params == {
        "candidate": first.params["candidate"], **{f"fa3_sm90.{k}": v for k, v in known.items()}}


def test_dispatch_table_from_the_pareto_front(tuned):
    cfg, result, _ = tuned
    ok = [r for r in log_of(cfg) if r["outcome"]["state"] == "ok"]
    table = result.dispatch
    assert [e["seqlen"] for e in table] == [1024, 4096, 16384]
    assert table[0]["min_seqlen"] == 1 and table[-1]["max_seqlen"] is None
    assert all(a["max_seqlen"] + 1 == b["min_seqlen"] for a, b in zip(table, table[1:]))
    for e in table:
        best = min(r["outcome"]["times_ms"][e["shape"]] for r in ok)
        assert e["time_ms"] <= best * 1.02
    doc = json.loads((cfg.output / "dispatch.json").read_text())
    assert doc["arch"] == "sm_90a" and len(doc["buckets"]) == 3


def test_geomean_is_a_single_objective(tmp_path):
    cfg = make_cfg(tmp_path, objectives="geomean", trials=4)
    result = tune(cfg, runner=replay(tmp_path, cfg), say=quiet)
    study = study_of(cfg)
    assert len(study.directions) == 1
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    rec = {r["number"]: r for r in log_of(cfg)}
    for t in done:
        ms = rec[t.number]["outcome"]["times_ms"].values()
        assert t.values[0] == pytest.approx(math.exp(sum(map(math.log, ms)) / len(ms)))
    assert result.status == "tuned"


# ------------------------------------------------------------------ the other endings
def test_without_a_gpu_it_screens_and_says_timing_needs_one(tmp_path):
    cfg = make_cfg(tmp_path)
    runner = replay(tmp_path, cfg, gpus=0)
    result = tune(cfg, runner=runner, say=quiet)
    assert result.status == "no_gpu" and result.exit_code == 1
    assert "timing needs a GPU" in result.message
    assert "Timing needs a GPU" in (cfg.output / "report.md").read_text()
    assert not (cfg.output / "trials.jsonl").exists() and not (cfg.output / "dispatch.json").exists()


def test_dry_run_times_nothing_on_purpose(tmp_path):
    cfg = make_cfg(tmp_path)
    runner = replay(tmp_path, cfg, gpus=1)
    result = tune(cfg, runner=runner, dry_run=True, say=quiet)
    assert result.status == "screened" and result.exit_code == 0
    manifest = json.loads((cfg.output / "manifest.json").read_text())
    assert manifest["status"] == "screened" and manifest["candidates"][0]["state"] == "verified"
    assert not (cfg.output / "trials.jsonl").exists()


def test_nothing_verified(tmp_path):
    cfg = make_cfg(tmp_path)
    rec = {"device": {"gpus": 1}, "results": [{"kind": "screen", "match": {},
                                                "outcome": {"state": "rejected_check", "reason": "recorded rejection"}}]}
    (tmp_path / "r.json").write_text(json.dumps(rec))
    result = tune(cfg, runner=make_runner("replay", replay=tmp_path / "r.json"), say=quiet)
    assert result.status == "nothing_verified" and result.exit_code == 1
    assert "recorded rejection" in (cfg.output / "report.md").read_text()


def test_an_existing_run_is_resumed_only_on_request_and_only_the_same_search(tmp_path):
    cfg = make_cfg(tmp_path, trials=2)
    tune(cfg, runner=replay(tmp_path, cfg), say=quiet)
    with pytest.raises(ConfigError, match="already holds a run"):
        tune(cfg, runner=replay(tmp_path, cfg), say=quiet)
    other = make_cfg(tmp_path, trials=2, lengths=(2048,))
    with pytest.raises(ConfigError, match="different search"):
        tune(other, runner=replay(tmp_path, other), resume=True, say=quiet)
    more = make_cfg(tmp_path, trials=4)
    assert tune(more, runner=replay(tmp_path, more), resume=True, say=quiet).status == "tuned"
    assert sum(r["outcome"]["state"] != "config_invalid" for r in log_of(more)) == 4


# ------------------------------------------------------------------ real workers, CPU only
def test_local_worker_screens_and_compiles_the_population(tmp_path):
    cfg = make_cfg(tmp_path, spec="prefixlm")
    with make_runner("local", gpus=0) as runner:
        result = tune(cfg, runner=runner, quick_screen=True, say=quiet)
    assert result.status == "no_gpu"
    manifest = json.loads((cfg.output / "manifest.json").read_text())
    [cand] = manifest["candidates"]
    assert cand["state"] == "verified" and "interpreter cases passed" in cand["reason"]
    for comp in manifest["compile"].values():      # nvcc present: compiled, or an honest compile error
        assert comp["state"] in ("verified", "compile_error") and comp["reason"]
    assert (cfg.output / "kernel" / f"{cand['id']}.cuir").is_file()


def test_small_population_through_a_real_ray_instance(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    cfg = make_cfg(tmp_path, spec="prefixlm", reference=["fa2_sm80", "fa3_sm90"])
    runner = make_runner("ray", num_cpus=2, object_store_memory=80 << 20)
    try:
        assert runner.num_gpus == 0
        result = tune(cfg, runner=runner, dry_run=True, quick_screen=True, say=quiet)
    finally:
        runner.close()
    assert result.status == "screened"
    manifest = json.loads((cfg.output / "manifest.json").read_text())
    assert sorted(c["reference"] for c in manifest["candidates"]) == ["fa2_sm80", "fa3_sm90"]
    assert all(c["state"] == "verified" for c in manifest["candidates"])
    assert all(c["reason"] for c in manifest["compile"].values())


# ------------------------------------------------------------------ progress display
def test_progress_is_one_live_line_on_a_terminal(monkeypatch):
    monkeypatch.delenv("CI", raising=False)

    class Tty(io.StringIO):
        def isatty(self):
            return True
    p = Progress(5, stream=Tty())
    assert p.live
    p.update(1, "1.0 ms", {"crash": 1})
    p.message("a note")
    p.update(2, "0.9 ms", {"crash": 1})
    p.close()
    text = p.stream.getvalue()
    # a tqdm bar redrawn in place (carriage returns), the note on a line of its own above it, the
    # last state (2 of 5, best, failures) drawn, one newline for the note and one at close
    assert text.count("\n") == 2 and "\r" in text and "\ra note\n" in text
    last = text.rstrip("\n").split("\r")[-1]
    assert "2/5" in last and "best 0.9 ms" in last and "failed: crash 1" in last


def test_progress_is_quiet_plain_lines_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")

    class Tty(io.StringIO):
        def isatty(self):
            return True
    p = Progress(5, stream=Tty(), interval_s=3600)
    assert not p.live
    for i in range(1, 6):
        p.update(i, None, {})
    lines = p.stream.getvalue().splitlines()
    assert lines == ["tune: 1/5 trials | best -", "tune: 5/5 trials | best -"]
    assert TrialState.CRASH.failed


def test_the_cli_leaves_the_cubridge_logger_as_it_found_it(tmp_path):
    """A tune command's log handler writes to the stderr of that command; left installed, the next
    tune in the same process (a notebook, a test session) wrote to a closed stream and crashed."""
    import logging

    from cubridge.cli import tune_main
    from cubridge.search.progress import ProgressHandler
    logger = logging.getLogger("cubridge")
    before = (list(logger.handlers), logger.level, logger.propagate)
    tune_main([str(tmp_path / "missing.yaml"), "--dry-run"])
    assert not [h for h in logger.handlers if isinstance(h, ProgressHandler)]
    assert (list(logger.handlers), logger.level, logger.propagate) == before


# ------------------------------------------------------------------ the GPU check's rule, on CPU
def test_gpu_check_applies_the_verification_rule(tmp_path):
    """measure.gpu_check with stand-in kernels on CPU tensors: the rule, not the GPU, is under test."""
    import torch

    from cubridge.search.measure import gpu_check
    from cubridge.spec import load_spec
    spec = load_spec("causal")
    shape = (1, 4, 2, 37, 32, 0)

    def good(q, k, v, out, lse=None):
        from cubridge.verify import lse_of
        out.copy_(spec.run_reference(q.float(), k.float(), v.float()).to(out.dtype))
        return out, lse_of(spec, q.float(), k.float(), {})      # the LSE is an output too

    def unwritten(q, k, v, out, lse=None):
        good(q, k, v, out)
        out[:, :, -1] = float("nan")
        return out, good(q, k, v, out.clone())[1]

    def clobbers(q, k, v, out, lse=None):
        res = good(q, k, v, out)
        k.zero_()
        return res

    calls = []

    def racy(q, k, v, out, lse=None):
        res = good(q, k, v, out)
        calls.append(1)
        out[0, 0, 0, 0] += len(calls) * 1e-2
        return res

    check = lambda call: gpu_check(call, spec, {}, shape, torch.bfloat16, device="cpu")  # noqa: E731
    assert check(good) is None
    assert "NaN" in check(unwritten)
    assert check(clobbers) == "inputs changed by the run"
    assert "two runs differ" in check(racy)


def test_a_worker_rebuilds_a_spec_file_it_cannot_see(tmp_path):
    from cubridge.paths import REPO_DIR
    from cubridge.search.building import spec_for
    source = (REPO_DIR / "cubridge/specs/prefixlm.py").read_text()
    spec = spec_for(SimpleNamespace(spec=str(tmp_path / "elsewhere" / "my_prefix.py"), spec_source=source))
    assert spec.params == {"prefix": None} and spec.path.endswith("my_prefix.py")


def test_llm_proposer_options_follow_the_run(tmp_path):
    from types import SimpleNamespace as NS
    from cubridge.search.messages import proposer_options
    cfg = NS(proposer=NS(kind="vllm", options={"model": "/m"}), runner=NS(kind="ray"))
    opts = proposer_options(cfg, tmp_path)
    assert opts["out_dir"] == str(tmp_path / "llm") and opts["ray_actor"] is True
    cfg = NS(proposer=NS(kind="openai", options={"out_dir": "mine"}), runner=NS(kind="local"))
    assert proposer_options(cfg, tmp_path) == {"out_dir": "mine"}
    cfg = NS(proposer=NS(kind="rules", options={}), runner=NS(kind="ray"))
    assert proposer_options(cfg, tmp_path) == {}


def test_the_study_names_its_objectives_and_the_search(tuned):
    cfg, _, _ = tuned
    study = study_of(cfg)
    assert study.metric_names == [f"{t.key} ms" for t in cfg.shapes.targets]
    assert study.user_attrs["shapes"][0]["key"] == cfg.shapes.targets[0].key
    assert study.user_attrs["arch"] == "sm_90a" and study.user_attrs["references"] == ["fa3_sm90"]


def test_the_tuner_uses_optuna_through_its_public_api():
    import ast
    from pathlib import Path
    import cubridge.search.tuner as tuner_module
    tree = ast.parse(Path(tuner_module.__file__).read_text())
    private = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and n.attr in ("_storage", "_trial_id", "_study_id")})
    assert not private, f"Optuna internals used: {private}"
