"""Artifacts of a run (trial log, Pareto front, dispatch table, manifest, report, plot) and
`cubridge.load`'s refusals, all on CPU: the run is tuned on a synthetic replay recording."""
from __future__ import annotations

import builtins
import json
import textwrap

import pytest
import torch

import cubridge
from cubridge.config import ConfigError, Target, load_config
from cubridge.errors import CubridgeError, LaunchError
from cubridge.load import check_arch
from cubridge.search import artifacts
from cubridge.search.runners import make_runner
from cubridge.search.testing_jobs import synthetic_recording
from cubridge.search.tuner import tune
from cubridge.vocab import Outcome, TrialRecord, TrialState

LENGTHS = [1024, 4096, 16384]


def _cfg(tmp, name):
    p = tmp / f"{name}.yaml"
    p.write_text(textwrap.dedent(f"""\
        spec: prefixlm
        reference: fa3_sm90
        shapes: {{heads_q: 8, heads_kv: 2, head_dim: 128, lengths: {LENGTHS}}}
        budget: {{trials: 6, minutes: 2}}
        output: {tmp / name}
        """))
    return load_config(p)


def _tune(tmp, cfg, **kw):
    rec = synthetic_recording("fa3_sm90", 128, "sm_90a", cfg.shapes.targets, **kw)
    for row in rec["results"][-1]["data"]["shapes"].values():
        row["ours_ms"] = row["baselines_ms"]["flex_attention"] / 1.5      # synthetic, labelled so
    (tmp / f"{cfg.name}.json").write_text(json.dumps(rec))
    return tune(cfg, runner=make_runner("replay", replay=tmp / f"{cfg.name}.json"), say=lambda *_: None)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("artifacts")
    cfg = _cfg(tmp, "tuned")
    _tune(tmp, cfg)
    return cfg.output


# ------------------------------------------------------------------ pure pieces
def rec(n, a=0.0, b=0.0, state="ok", times=None):
    return TrialRecord(n, "c", "rules", "fa3_sm90", f"cfg{n}", {"n": n},
                       Outcome(TrialState(state), times_ms=times or {"a": a, "b": b}))


def test_pareto_front_keeps_the_non_dominated_ok_trials():
    recs = [rec(0, 1.0, 3.0), rec(1, 2.0, 2.0), rec(2, 2.5, 2.5), rec(3, 0.5, 0.5, "crash"), rec(4, 3.0, 1.0)]
    assert [r.number for r in artifacts.pareto_front(recs, ["a", "b"])] == [0, 1, 4]


def test_dispatch_buckets_cover_every_length_and_prefer_shared_configs():
    targets = [Target(1, 8, 2, 1024, 128), Target(1, 8, 2, 4096, 128)]
    front = [rec(0, times={"N=1024,B=1": 1.0, "N=4096,B=1": 3.0}), rec(1, times={"N=1024,B=1": 1.01, "N=4096,B=1": 2.0})]
    table = artifacts.choose_dispatch(front, targets)
    assert [e["trial"] for e in table] == [1, 1]        # 1% slower at 1k, but one kernel for both
    assert (table[0]["min_seqlen"], table[0]["max_seqlen"], table[1]["min_seqlen"], table[1]["max_seqlen"]) \
        == (1, 2048, 2049, None)
    assert artifacts.select_bucket(table, 2048)["seqlen"] == 1024
    assert artifacts.select_bucket(table, 10 ** 6)["seqlen"] == 4096


def test_final_race_decides_among_each_shapes_finalists():
    targets = [Target(1, 8, 2, 1024, 128), Target(1, 8, 2, 4096, 128)]
    k1, k4 = targets[0].key, targets[1].key
    front = [rec(n, times={k1: a, k4: b}) for n, a, b in [(0, 1.00, 2.00), (1, 1.05, 2.30), (2, 1.50, 1.95)]]
    fin = artifacts.finalists(front, targets)
    assert fin == {k1: [0, 1], k4: [2, 0]}              # within 10% of each shape's best search time
    # Round-robin, trial 1 beats trial 0 at 1k by more than the sharing tolerance; 4k was not raced.
    table = artifacts.choose_dispatch(front, targets, {k1: {"0": 1.10, "1": 1.02}})
    assert [e["trial"] for e in table] == [1, 2]
    assert table[0]["race_ms"] == 1.02 and table[0]["time_ms"] == 1.05 and "race_ms" not in table[1]
    assert [e["trial"] for e in artifacts.choose_dispatch(front, targets, {})] == [0, 2]


def test_report_says_the_race_did_not_run_on_a_replay_without_one(run_dir):
    # The synthetic recording has no race record: the search's own times decide, and both say so.
    report = (run_dir / "report.md").read_text()
    assert "## Final race" in report and "the search's own times decided" in report
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["race"]["outcome"]["state"] == "crash" and manifest["race"]["shapes"] == {}


def test_trial_log_survives_a_torn_last_line(tmp_path):
    log = artifacts.TrialLog(tmp_path / "trials.jsonl")
    log.append(rec(0))
    log.append(rec(1))
    with open(log.path, "a") as f:
        f.write('{"number": 2, "outc')                 # a kill in the middle of a write
    log = artifacts.TrialLog(log.path)
    assert [r.number for r in log.read()] == [0, 1]
    log.append(rec(2))
    assert [r.number for r in log.read()] == [0, 1, 2]


def test_trial_records_read_back_typed_and_equal(tmp_path):
    full = TrialRecord(3, "c", "llm", "fa2_sm80", "128x64s2w4", {"block_m": 128},
                       Outcome(TrialState.WRONG_ANSWER, "max err 0.3", {}), {"N=1024,B=1": {"sdpa": 0.5}}, "gpu0",
                       "abc", [{"case": 1}], {"name": "H100"}, 12.5)
    log = artifacts.TrialLog(tmp_path / "trials.jsonl")
    log.append(full)
    [back] = log.read()
    assert back == full and back.state is TrialState.WRONG_ANSWER
    assert TrialRecord.from_json(json.loads(json.dumps(full.to_json()))) == full


def test_an_older_runs_records_still_read(tmp_path):
    """Runs logged before worker / cubin_key / gpu_check / device / finished_at existed."""
    old = {"number": 0, "proposal_id": "c", "origin": "rules", "outcome": {"state": "ok", "times_ms": {"a": 1.0}},
           "config": {"reference": "fa3_sm90", "label": "l", "point": {"block_m": 128}}}
    (tmp_path / "trials.jsonl").write_text(json.dumps(old) + "\n")
    [r] = artifacts.TrialLog(tmp_path / "trials.jsonl").read()
    assert (r.times_ms, r.point, r.worker, r.device) == ({"a": 1.0}, {"block_m": 128}, "", None)


@pytest.mark.parametrize("edit, why", [(lambda d: d.update(speedup=2), "unknown speedup"),
                                       (lambda d: d.pop("outcome"), "missing outcome"),
                                       (lambda d: d["outcome"].update(state="great"), "'great' is not a valid"),
                                       (lambda d: d["config"].pop("point"), "malformed KeyError")])
def test_a_record_of_another_version_is_refused_by_line(tmp_path, edit, why):
    d = rec(0).to_json()
    edit(d)
    (tmp_path / "trials.jsonl").write_text(json.dumps(rec(1).to_json()) + "\n" + json.dumps(d) + "\n")
    with pytest.raises(ConfigError, match=why) as e:
        artifacts.TrialLog(tmp_path / "trials.jsonl").read()
    assert e.value.where.endswith("trials.jsonl:2") and "another version" in str(e.value)


# ------------------------------------------------------------------ the output directory
def test_output_directory_holds_every_artifact(run_dir):
    for name in ("trials.jsonl", "study.db", "population.json", "screen.json", "dispatch.json", "manifest.json",
                 "report.md", "spec.py", "run.json"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "kernel").glob("*.cuir"))


def test_manifest_records_versions_hashes_verification_and_timings(run_dir):
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["status"] == "tuned" and len(m["spec"]["sha256"]) == 64
    assert set(m["references"]["fa3_sm90"]) == {"kernel.cu", "kernel.cuir"}
    assert {"torch", "optuna", "python", "nvcc"} <= set(m["host"])
    assert m["device"]["name"].startswith("synthetic")
    assert m["candidates"][0]["state"] == "verified"
    rows = m["timings"]["rows"]
    assert [r["seqlen"] for r in rows] == LENGTHS
    assert all(r["ours_tflops"] and r["baselines"]["flex_attention"]["tflops"] for r in rows)


def test_report_has_the_table_and_the_plot(run_dir):
    text = (run_dir / "report.md").read_text()
    assert "| N | B | config | ours ms | ours TFLOPS | flex_attention TFLOPS | vs best baseline |" in text
    assert "1.50x" in text and "eager at N = 1024, 4096, 16384: skipped: synthetic" in text
    if (run_dir / "tflops.png").is_file():
        assert (run_dir / "tflops.png").read_bytes()[:4] == b"\x89PNG" and "](tflops.png)" in text
    else:
        assert "matplotlib is not installed" in text


def test_report_says_so_when_matplotlib_is_missing(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rows = [{"seqlen": 1024, "ours_tflops": 100.0, "baselines": {}}]
    assert "matplotlib is not installed" in artifacts.plot_tflops(rows, tmp_path / "x.png", "t")
    assert not (tmp_path / "x.png").exists()


def test_plot_is_a_png_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    rows = [{"seqlen": n, "ours_tflops": 300.0 + n / 100, "baselines": {"flex_attention": {"tflops": 250.0}}}
            for n in LENGTHS]
    note = artifacts.plot_tflops(rows, tmp_path / "tflops.png", "t")
    assert note == "![TFLOPS vs sequence length](tflops.png)"
    assert (tmp_path / "tflops.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ cubridge.load
def test_load_picks_the_bucket_and_prints_itself(run_dir):
    k = cubridge.load(run_dir)
    assert "sm_90a bf16 D=128" in repr(k)
    assert k.select(1000)["seqlen"] == 1024 and k.select(100000)["seqlen"] == 16384


def test_load_refuses_what_it_was_not_built_for(run_dir):
    k = cubridge.load(run_dir)
    q = torch.zeros(1, 8, 64, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="runs on a GPU"):
        k(q, kv, kv)
    with pytest.raises(LaunchError, match="tuned for Hq=8, Hkv=2 and neither layout"):
        k(q[:, :3], kv, kv)
    with pytest.raises(LaunchError, match="built for bf16"):
        k(q.half(), kv.half(), kv.half())
    with pytest.raises(LaunchError, match="head dim 64"):
        k(q[..., :64], kv[..., :64], kv[..., :64])
    with pytest.raises(LaunchError, match="N must be >= 1"):
        k.select(0)


def test_load_refuses_another_gpu_arch():
    with pytest.raises(LaunchError, match="built for sm_90a; NVIDIA A100 is sm_80"):
        check_arch("sm_90a", (8, 0), "NVIDIA A100")
    with pytest.raises(LaunchError, match="built for sm_80"):
        check_arch("sm_80", (9, 0))
    check_arch("sm_90a", (9, 0))
    check_arch("sm_80", (8, 6))


def test_load_refuses_a_directory_with_no_tuned_kernel(tmp_path):
    with pytest.raises(CubridgeError, match="not a cubridge-tune output directory"):
        cubridge.load(tmp_path)
    cfg = _cfg(tmp_path, "cpu_only")
    rec = synthetic_recording("fa3_sm90", 128, "sm_90a", cfg.shapes.targets, gpus=0)
    (tmp_path / "r.json").write_text(json.dumps(rec))
    tune(cfg, runner=make_runner("replay", replay=tmp_path / "r.json"), say=lambda *_: None)
    with pytest.raises(CubridgeError, match="no tuned kernel .*timing needs a GPU"):
        cubridge.load(cfg.output)
