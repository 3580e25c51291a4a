"""Backward tuning in the same run (cubridge/search/backward.py, issue 17 Deliver 6), on CPU: the
space, the config field, the choice per shape, the report section, dispatch.json's entries and the
op reading them. The GPU job itself (measure_bwd.py) runs in tests/gpu/test_backward_tuning.py."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cubridge.config import ConfigError, load_config
from cubridge.runtime.fa2_bwd_sm80 import Config, default_config
from cubridge.runtime.variant_bwd import HOPPER_LABEL
from cubridge.search import backward
from cubridge.search.runners import make_runner
from cubridge.search.testing_jobs import synthetic_recording
from cubridge.search.tuner import tune


@pytest.mark.parametrize("d", [64, 128])
def test_space_is_the_buildable_configs_default_first(d):
    labels = backward.space(d)
    assert labels[0] == str(default_config(d)) and len(labels) == len(set(labels)) >= 2
    for label in labels:
        assert not Config.parse(label).problems(d), label
    # an sm_90 run also checks and times the Hopper variant backward, as one more point
    assert backward.space(d, "sm_90a") == labels + [HOPPER_LABEL]
    assert backward.kernel_of(HOPPER_LABEL) == "fa3_bwd_sm90" and backward.kernel_of(labels[0]) == "fa2_bwd_sm80"


def write_cfg(tmp_path, extra: str, head_dim: int = 128):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(f"""\
        spec: prefixlm
        reference: fa3_sm90
        shapes: {{heads_q: 8, heads_kv: 2, head_dim: {head_dim}, lengths: [1024, 4096]}}
        budget: {{trials: 4, minutes: 2}}
        output: {tmp_path / 'out'}
        """) + extra)
    return path


def test_config_field_is_checked(tmp_path):
    assert load_config(write_cfg(tmp_path, "backward: true\n")).backward is True
    assert load_config(write_cfg(tmp_path, "")).backward is False
    with pytest.raises(ConfigError, match=r"run.yaml:6.*backward.*expected true or false, got a string 'yes'"):
        load_config(write_cfg(tmp_path, "backward: 'yes'\n"))
    with pytest.raises(ConfigError, match="backward.*head dims 64, 128, not 256"):
        load_config(write_cfg(tmp_path, "backward: true\n", head_dim=256))


def result(checks, shapes):
    return {"outcome": {"state": "ok", "reason": ""}, "checks": checks, "shapes": shapes}


def test_choice_takes_the_fastest_config_that_passed_per_shape():
    a, b, c = "64x128w8-dq64x64w4", "128x128w8-dq64x64w4", "64x64w4-dq64x64w4"
    res = result({a: "pass", b: "pass", c: "dq: max err 3.1 > bound 0.01"},
                 {"N=1024,B=16": {"configs_ms": {a: 1.0, b: 1.2}, "flops": 1e12, "baselines_ms": {"flex": 2.0}},
                  "N=4096,B=4": {"configs_ms": {a: 3.0, b: 2.5}, "flops": 4e12, "baselines_ms": {}}})
    # the failing config's (made-up) time is never chosen, even when it is the smallest
    res["shapes"]["N=4096,B=4"]["configs_ms"][c] = 0.1
    dispatch = [{"shape": "N=1024,B=16"}, {"shape": "N=4096,B=4"}, {"shape": "N=16384,B=1"}]
    backward.choose(res, dispatch)
    assert dispatch[0]["backward"] == {"kernel": "fa2_bwd_sm80", "config": a, "ms": 1.0}
    assert dispatch[1]["backward"]["config"] == b
    assert "backward" not in dispatch[2]          # not timed there: the op runs the default config
    text = backward.report_section(res, dispatch)
    assert f"| N=1024,B=16 | {a} | 1.000 | 1000.0 | 1.000 | 2.000 | 2.00 |" in text
    assert f"- {c}: dq: max err 3.1" in text


def test_a_failed_backward_job_is_said_not_hidden():
    res = {"outcome": {"state": "crash", "reason": "job backward raised RuntimeError: boom"}}
    dispatch = [{"shape": "N=1024,B=16"}]
    backward.choose(res, dispatch)
    assert "backward" not in dispatch[0]
    assert backward.report_section(res, dispatch).startswith("Not tuned: crash")


def test_a_run_with_backward_writes_its_choice_to_dispatch_and_report(tmp_path):
    cfg = load_config(write_cfg(tmp_path, "backward: true\n"))
    rec = synthetic_recording("fa3_sm90", 128, cfg.arch, cfg.shapes.targets, fail_every=0)
    labels = backward.space(128, cfg.arch)
    assert labels[-1] == HOPPER_LABEL              # the config's arch is sm_90a
    shapes = {t.key: {"flops": 1e12, "configs_ms": {lab: 1.0 + i * 0.1 * (-1) ** j for i, lab in enumerate(labels)},
                      "baselines_ms": {"flex": 3.0}} for j, t in enumerate(cfg.shapes.targets)}
    rec["results"].append({"kind": "backward", "match": {"bwd_configs": labels},
                           "outcome": {"state": "ok", "reason": "synthetic"},
                           "data": {"checks": {lab: "pass" for lab in labels}, "shapes": shapes}})
    path = tmp_path / "recording.json"
    path.write_text(json.dumps(rec))
    out = tune(cfg, runner=make_runner("replay", replay=path), say=lambda *_: None)
    assert out.status == "tuned"
    buckets = json.loads((cfg.output / "dispatch.json").read_text())["buckets"]
    chosen = {b["shape"]: b["backward"]["config"] for b in buckets}
    kernels = {b["shape"]: b["backward"]["kernel"] for b in buckets}
    first, second = (t.key for t in cfg.shapes.targets)
    assert chosen[first] == labels[0] and chosen[second] == labels[-1]   # the synthetic minimum of each shape
    assert kernels == {first: "fa2_bwd_sm80", second: "fa3_bwd_sm90"}
    report = (cfg.output / "report.md").read_text()
    assert "## Backward" in report and "FlexAttention ms" in report
    assert json.loads((cfg.output / "manifest.json").read_text())["backward"]["outcome"]["state"] == "ok"


class _Op:
    """The two things op/autograd.tuned_config reads of a TunedOp."""

    def __init__(self, buckets):
        self.buckets = buckets

    def select(self, n):
        return next(b for b in self.buckets if b["min_seqlen"] <= n and (b["max_seqlen"] is None or n <= b["max_seqlen"]))


def test_the_op_backward_uses_its_buckets_config():
    from cubridge.op.autograd import tuned_config
    op = _Op([{"min_seqlen": 1, "max_seqlen": 2048, "backward": {"config": "128x128w8-dq64x64w4"}},
              {"min_seqlen": 2049, "max_seqlen": None}])
    assert tuned_config(op, 1000) == "128x128w8-dq64x64w4"
    assert tuned_config(op, 8192) is None


def test_the_op_backward_builds_the_kernel_its_label_names(monkeypatch, tmp_path):
    """A bucket that chose the Hopper variant backward gets VariantBackward(use_hopper=True); a fa2
    label gets that config on fa2_bwd_sm80, never the Hopper path (use_hopper=False: the run chose it);
    None leaves the choice to the device and the environment."""
    from cubridge.op import autograd
    from cubridge.runtime import variant_bwd
    made = []

    class Recorder:
        def __init__(self, spec, config=None, kernel=None, use_hopper=None, **params):
            made.append((str(config) if config else None, use_hopper, type(kernel).__name__))
    monkeypatch.setattr(variant_bwd, "VariantBackward", Recorder)
    (tmp_path / "spec.py").write_text((Path(__file__).parents[2] / "cubridge" / "specs" / "prefixlm.py").read_text())
    op = type("Op", (), {"directory": tmp_path, "dispatch": {"spec": "spec.py", "spec_name": "prefixlm"}})()
    for label in (HOPPER_LABEL, "128x128w8-dq64x64w4", None, HOPPER_LABEL):
        autograd.variant_backward(op, label)
    assert made == [(None, True, "NoneType"), ("128x128w8-dq64x64w4", False, "Fa2BwdSm80"), (None, None, "Fa2BwdSm80")]
