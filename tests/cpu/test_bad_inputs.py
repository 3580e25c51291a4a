"""Bad inputs to `cubridge-tune` each give `error: WHERE: what` and exit 2, never a traceback:
a binary config, spec_params of the wrong type, a shape no GPU can hold, a torn run.json or
trials.jsonl on --resume."""
from __future__ import annotations

import json
import textwrap

import pytest

from cubridge.cli import main, tune_main
from cubridge.search.runners import make_runner
from cubridge.search.testing_jobs import synthetic_recording
from cubridge.search.tuner import tune
from support.tuned_run import replayed_run


def tune_cli(capsys, *argv):
    code = tune_main([str(a) for a in argv])
    return code, capsys.readouterr().err


def config(tmp_path, body: str, name="run"):
    p = tmp_path / f"{name}.yaml"
    p.write_text(textwrap.dedent(body).replace("{out}", str(tmp_path / "out")))
    return p


def test_binary_config(capsys, tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"spec: causal\n\x9a\xff\x00binary")
    code, err = tune_cli(capsys, p, "--dry-run")
    assert code == 2 and err.startswith(f"error: {p}:2: not a text file"), err


@pytest.mark.parametrize("params, what", [("{prefix: abc}", "param prefix='abc' of spec 'prefixlm': expected a number"),
                                          ("{prefix: [1]}", "expected a number, got list")])
def test_spec_params_of_the_wrong_type(capsys, tmp_path, params, what):
    p = config(tmp_path, f"""\
        spec: prefixlm
        spec_params: {params}
        shapes: {{model: llama2-7b, lengths: [1024]}}
        output: {{out}}
        """)
    code, err = tune_cli(capsys, p, "--dry-run")
    assert code == 2 and err.startswith(f"error: {p}:2: spec_params: ") and what in err, err
    assert not (tmp_path / "out").exists()


def test_spec_param_types_on_the_command_line(capsys):
    code = main(["verify-ir", "fa2_sm80", "--spec", "causal_blockwise", "--spec-param", "block=1.5", "--quick"])
    err = capsys.readouterr().err
    assert code == 2 and "param block=1.5 of spec 'causal_blockwise': expected int, got float" in err, err


def test_a_shape_no_gpu_can_hold(capsys, tmp_path):
    p = config(tmp_path, """\
        spec: causal
        shapes: {model: llama2-7b, lengths: [1024, 1000000000], batch: 1}
        output: {out}
        """)
    code, err = tune_cli(capsys, p, "--dry-run")
    assert code == 2 and f"error: {p}:2: shapes.lengths: N = 1000000000 (batch 1) needs" in err, err
    assert "the largest sm_90a GPU has 141 GiB" in err


@pytest.mark.parametrize("output", ["afile", "afile/sub"])
def test_an_output_that_is_a_file(capsys, tmp_path, output):
    (tmp_path / "afile").write_text("not a run")
    p = config(tmp_path, f"""\
        spec: causal
        shapes: {{model: llama2-7b, lengths: [1024]}}
        output: {tmp_path / output}
        """)
    code, err = tune_cli(capsys, p, "--dry-run")
    assert code == 2 and err.startswith(f"error: {p}: output: {tmp_path / 'afile'} is a file, not a directory"), err
    assert (tmp_path / "afile").read_text() == "not a run"


@pytest.fixture
def finished_run(tmp_path):
    run = replayed_run(tmp_path, "causal", "{model: llama2-7b, lengths: [1024, 8192]}", trials=5)
    return run.config, run.recording, run.output


def test_torn_run_json_on_resume(capsys, finished_run):
    p, rec, out = finished_run
    text = (out / "run.json").read_text()
    (out / "run.json").write_text(text[: len(text) // 2])
    code, err = tune_cli(capsys, p, "--resume", "--runner", "replay", "--replay", rec)
    assert code == 2 and err.startswith(f"error: {p}: output: {out / 'run.json'} is not valid JSON (line "), err


def test_torn_trial_log_on_resume(capsys, finished_run):
    p, rec, out = finished_run
    lines = (out / "trials.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][: len(lines[1]) // 2] + "\n"       # a damaged line in the middle
    (out / "trials.jsonl").write_text("".join(lines))
    code, err = tune_cli(capsys, p, "--resume", "--trials", "8", "--runner", "replay", "--replay", rec)
    assert code == 2 and err.startswith(f"error: {out / 'trials.jsonl'}:2: not a trial record"), err


# ------------------------------------------------------------------ reports say only what happened
def test_a_dry_run_without_a_compiler_says_so_and_promises_no_kernel(tmp_path, monkeypatch):
    from cubridge.config import load_config
    from cubridge.search import tuner
    monkeypatch.setattr(tuner, "available_compiler", lambda: None)
    p = config(tmp_path, """\
        spec: causal
        reference: fa3_sm90
        shapes: {model: llama2-7b, lengths: [1024]}
        output: {out}
        """)
    cfg = load_config(p)
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps(synthetic_recording("fa3_sm90", 128, "sm_90a", cfg.shapes.targets)))
    res = tune(cfg, runner=make_runner("replay", replay=rec), dry_run=True, say=lambda *_: None)
    assert res.status == "screened"
    assert "stopped after screening (compile skipped: neither nvcc nor NVRTC" in res.message
    report = (cfg.output / "report.md").read_text()
    assert "runs the tuned kernel" not in report and "there is no tuned kernel to load (screened)" in report
    assert "compiling" not in report.split("## ")[0]
    manifest = json.loads((cfg.output / "manifest.json").read_text())
    assert not (cfg.output / "trials.jsonl").exists() and manifest["trials"]["log"] is None


def test_a_tuned_run_names_its_log_and_its_kernel(finished_run):
    _, _, out = finished_run
    assert json.loads((out / "manifest.json").read_text())["trials"]["log"] == "trials.jsonl"
    assert f'`cubridge.load("{out}")` runs the tuned kernel.' in (out / "report.md").read_text()
