"""Configs: the shipped ones load; bad ones are rejected before any work, naming the file, the line,
the field (dotted path) and what is expected."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from cubridge.cli import tune_main
from cubridge.config import MODELS, ConfigError, load_config, load_plan, with_overrides
from cubridge.paths import REPO_DIR

CONFIGS = REPO_DIR / "configs"
VARIANTS = ["full", "causal", "prefixlm", "global_sliding_window", "causal_blockwise", "share_question",
            "relative_pos", "relu", "sigmoid", "composite"]

GOOD = """\
spec: prefixlm
reference: fa3_sm90
arch: sm_90a
dtype: bf16
shapes:
  model: llama2-7b
  lengths: [1024, 4096]
proposer:
  kind: rules
budget:
  trials: 8
  minutes: 2
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def rejected(tmp_path, text: str) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "run.yaml" in str(e.value)          # every error names the file
    return e.value


# ------------------------------------------------------------------ shipped configs
@pytest.mark.parametrize("variant", VARIANTS)
def test_h100_config_per_variant(variant):
    cfg = load_config(CONFIGS / f"h100_{variant}.yaml")
    assert cfg.spec == variant and cfg.references == ("fa3_sm90",) and cfg.arch == "sm_90a"
    assert (cfg.shapes.heads_q, cfg.shapes.heads_kv, cfg.shapes.head_dim) == MODELS["llama2-7b"]
    assert [t.seqlen for t in cfg.shapes.targets] == [1024, 2048, 4096, 8192, 16384]
    assert all(t.batch * t.seqlen == 16384 for t in cfg.shapes.targets)
    assert cfg.proposer.kind == "rules"
    assert cfg.budget.minutes <= 6          # search + bench must fit in 10 minutes on one H100


def test_nightly_plan_runs_every_variant_with_overrides():
    plan = load_plan(CONFIGS / "nightly.yaml")
    assert [c.spec for c in plan] == VARIANTS
    assert all(c.budget.trials == 48 for c in plan)
    assert len({c.output for c in plan}) == len(plan)
    assert plan[0].output == Path("out/nightly/h100_full")


def test_defaults_and_storage(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.name == "run" and cfg.output == Path("out/run")
    assert cfg.storage_url.startswith("sqlite:///") and cfg.storage_url.endswith("out/run/study.db")
    assert cfg.runner.kind == "local" and cfg.objectives == "per_shape"
    assert [t.key for t in cfg.shapes.targets] == ["N=1024,B=16", "N=4096,B=4"]


def test_explicit_heads_and_batch(tmp_path):
    cfg = load_config(write(tmp_path, GOOD.replace("  model: llama2-7b\n",
                                                   "  heads_q: 8\n  heads_kv: 2\n  head_dim: 64\n  batch: 3\n")))
    assert [(t.batch, t.heads_q, t.heads_kv, t.head_dim) for t in cfg.shapes.targets] == [(3, 8, 2, 64)] * 2


def test_spec_path_is_relative_to_the_config(tmp_path):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "mine.py").write_text((REPO_DIR / "cubridge/specs/causal.py").read_text())
    cfg = load_config(write(tmp_path, GOOD.replace("spec: prefixlm", "spec: specs/mine.py")))
    assert Path(cfg.spec) == (tmp_path / "specs" / "mine.py").resolve()


def test_search_key_changes_with_the_search_not_the_budget(tmp_path):
    a = load_config(write(tmp_path, GOOD))
    b = load_config(write(tmp_path, GOOD.replace("trials: 8", "trials: 9"), "b.yaml"))
    c = load_config(write(tmp_path, GOOD.replace("[1024, 4096]", "[1024, 8192]"), "c.yaml"))
    assert a.search_key == b.search_key != c.search_key


# ------------------------------------------------------------------ bad inputs
def test_typo_in_a_key(tmp_path):
    e = rejected(tmp_path, GOOD.replace("reference:", "referense:"))
    assert "run.yaml:2: referense" in str(e)
    assert "did you mean 'reference'" in str(e) and "allowed keys:" in str(e)


def test_typo_in_a_nested_key(tmp_path):
    e = rejected(tmp_path, GOOD.replace("  lengths:", "  lenghts:"))
    assert "run.yaml:7: shapes.lenghts" in str(e) and "did you mean 'lengths'" in str(e)


def test_wrong_type(tmp_path):
    e = rejected(tmp_path, GOOD.replace("trials: 8", "trials: eight"))
    assert "run.yaml:11: budget.trials" in str(e) and "expected an integer" in str(e)
    e = rejected(tmp_path, GOOD.replace("[1024, 4096]", "[1024, 4k]"))
    assert "shapes.lengths[1]" in str(e) and "'4k'" in str(e)
    e = rejected(tmp_path, GOOD.replace("dtype: bf16", "dtype: float32"))
    assert "run.yaml:4: dtype" in str(e) and "bf16, fp16" in str(e)


def test_missing_spec_file(tmp_path):
    e = rejected(tmp_path, GOOD.replace("spec: prefixlm", "spec: specs/nope.py"))
    assert "run.yaml:1: spec" in str(e) and "not found" in str(e)
    assert e.hint and "relative to the config file" in e.hint


def test_unknown_builtin_spec(tmp_path):
    e = rejected(tmp_path, GOOD.replace("spec: prefixlm", "spec: prefixml"))
    assert "run.yaml:1: spec" in str(e) and "prefixlm" in str(e)


def test_unknown_spec_param(tmp_path):
    e = rejected(tmp_path, GOOD + "spec_params: {prefx: 3}\n")
    assert "spec_params" in str(e) and "prefx" in str(e) and "prefix" in e.hint


def test_unknown_reference_kernel(tmp_path):
    e = rejected(tmp_path, GOOD.replace("reference: fa3_sm90", "reference: fa4_sm100"))
    assert "run.yaml:2: reference" in str(e) and "unknown reference kernel 'fa4_sm100'" in str(e)
    assert "fa2_sm80" in e.hint and "fa3_sm90" in e.hint


def test_reference_that_cannot_run_on_the_arch(tmp_path):
    e = rejected(tmp_path, GOOD.replace("arch: sm_90a", "arch: sm_80"))
    assert "run.yaml:3: arch" in str(e) and "fa3_sm90 does not run on sm_80" in str(e)


@pytest.mark.parametrize("shapes, field, problem", [
    ("heads_q: 6\n  heads_kv: 4\n  head_dim: 128\n  lengths: [1024]", "shapes.heads_q", "not a multiple of heads_kv 4"),
    ("heads_q: 8\n  heads_kv: 2\n  head_dim: 96\n  lengths: [1024]", "shapes.head_dim",
     "head dim 96 is not built by fa3_sm90"),
    ("model: llama2-7b\n  batch: 2\n  lengths: [0, 1024]", "shapes.lengths[0]", "expected an integer >= 1, got 0"),
    ("model: llama2-7b\n  lengths: [1024, 32768]", "shapes.lengths", "N = 32768 > tokens = 16384 gives batch 0"),
    ("model: llama2-7b\n  heads_q: 8\n  lengths: [1024]", "shapes.heads_q", "given together with shapes.model"),
    ("model: llama9\n  lengths: [1024]", "shapes.model", "expected one of llama2-7b"),
    ("model: llama2-7b", "shapes.lengths", "missing"),
])
def test_impossible_shapes(tmp_path, shapes, field, problem):
    e = rejected(tmp_path, GOOD.replace("  model: llama2-7b\n  lengths: [1024, 4096]\n", f"  {shapes}\n"))
    assert f": {field}:" in str(e) and problem in str(e)


def test_invalid_yaml_and_duplicate_keys(tmp_path):
    e = rejected(tmp_path, GOOD.replace("arch: sm_90a", "arch: [sm_90a"))
    assert "not valid YAML" in str(e) and "run.yaml:" in str(e)
    e = rejected(tmp_path, GOOD + "dtype: fp16\n")
    assert "given twice" in str(e) and "dtype" in str(e)


def test_a_plan_names_the_file_of_each_error(tmp_path):
    write(tmp_path, GOOD, "a.yaml")
    plan = write(tmp_path, "runs: [a.yaml, missing.yaml]\n", "plan.yaml")
    with pytest.raises(ConfigError, match=r"plan.yaml:1: runs\[1\]: config file .*missing.yaml not found"):
        load_plan(plan)
    plan = write(tmp_path, "runs: [a.yaml]\noverrides:\n  budget: {trials: -1}\n", "plan.yaml")
    with pytest.raises(ConfigError, match=r"plan.yaml:3: budget.trials: expected an integer >= 1"):
        load_plan(plan)


def test_command_line_overrides(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    cfg2 = with_overrides(cfg, output=str(tmp_path / "o"), trials=3, runner="ray", address="auto")
    assert (cfg2.budget.trials, cfg2.runner.kind, cfg2.runner.address, cfg2.output) == (3, "ray", "auto", tmp_path / "o")
    with pytest.raises(ConfigError, match="--trials 0"):
        with_overrides(cfg, trials=0)
    with pytest.raises(ConfigError, match="--runner replay needs --replay FILE"):
        with_overrides(cfg, runner="replay")


def test_cli_rejects_a_bad_config_before_any_work(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("reference: fa3_sm90", "reference: fa9") + f"output: {tmp_path / 'out'}\n")
    assert tune_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "run.yaml:2: reference: unknown reference kernel 'fa9'" in err
    assert "hint: reference kernels" in err
    assert not (tmp_path / "out").exists()
