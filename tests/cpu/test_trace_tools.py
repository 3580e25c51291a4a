"""The tools around a transferred program (issue 19): verify-ir and analyze take programs with
extra inputs (bound from the spec as the tuner binds them), analyze counts the spec's iteration
space, baked-in spec parameters are recorded and a mismatch is reported as such, and a head dim
no kernel is built for is refused by every tool, naming the supported ones."""
from __future__ import annotations

import pytest

from cubridge.cli import main
from cubridge.analysis import analyze
from cubridge.cuir.parser import parse, parse_file
from cubridge.paths import built_head_dims, ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.transfer.binding import recorded
from cubridge.transfer.rules import transfer
from cubridge.verify import Case


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture(scope="module")
def fa2():
    return parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")


@pytest.mark.parametrize("name", ["share_question", "relative_pos"])
def test_verify_ir_and_analyze_bind_extra_inputs(capsys, tmp_path, name):
    path = tmp_path / f"{name}.cuir"
    code, _ = run(capsys, "transfer", name, "--ref", "fa2_sm80", "--no-verify", "--out", str(path))
    assert code == 0
    code, out = run(capsys, "verify-ir", str(path), "--spec", name, "--shape", "1,2,1,130,64", "--seeds", "1")
    assert code == 0 and "1/1 cases passed" in out, out
    code, out = run(capsys, "analyze", str(path), "--spec", name, "--shape", "1,2,1,256,64")
    assert code == 0 and "useful / executed" in out, out


def test_analyze_uses_the_spec_iteration_space(fa2):
    case = Case(1, 2, 1, 512, 512, 64)
    a = analyze(fa2, case, spec=load_spec("full"))    # the reference is transferred to the spec first
    causal = analyze(fa2, case)                       # the kernel's own (causal) iteration space
    assert causal.kv_tiles_visited < a.kv_tiles_visited == a.kv_tiles_total
    assert a.useful_flops == a.mma_flops             # was 1.939x with the causal space (issue 19)
    w = analyze(fa2, case, spec=load_spec("global_sliding_window"), spec_params={"window": 40, "global_tokens": 16})
    assert w.kv_tiles_visited < w.kv_tiles_total and w.useful_flops <= w.mma_flops


def test_spec_parameters_are_recorded_and_a_mismatch_is_named(capsys, tmp_path, fa2):
    cand = transfer(fa2, load_spec("prefixlm"), spec_params={"prefix": 40})
    assert recorded(parse(cand.text)) == ("prefixlm", {"prefix": 40})
    path = tmp_path / "p.cuir"
    path.write_text(cand.text)
    code, out = run(capsys, "verify-ir", str(path), "--spec", "prefixlm", "--spec-param", "prefix=50", "--quick")
    assert code == 1 and "spec parameter mismatch" in out and "--spec-param prefix=40" in out, out
    code, out = run(capsys, "verify-ir", str(path), "--spec", "prefixlm", "--spec-param", "prefix=40", "--quick")
    assert code == 0, out
    code, out = run(capsys, "verify-ir", str(path), "--spec", "causal", "--quick")
    assert code == 1 and "transferred for spec 'prefixlm'" in out, out


def test_shape_dependent_constants_stay_inputs(fa2):
    cand = transfer(fa2, load_spec("prefixlm"))          # prefix None: N // 2, bound at call time
    assert cand.slots and recorded(cand.program) == ("prefixlm", {"prefix": None})


@pytest.mark.parametrize("argv", [
    ("check-ir", "fa3_sm90", "--head-dim", "256"),      # was "shared memory ... exceeds" (issue 19)
    ("verify-ir", "fa3_sm90", "--spec", "causal", "--shape", "1,2,1,64,256"),
    ("transfer", "causal", "--head-dim", "256", "--quick"),
    ("lower", "causal", "--ref", "fa3_sm90", "--compile", "--head-dim", "256"),
])
def test_unbuilt_head_dim_is_refused_naming_the_supported_ones(capsys, argv):
    code, out = run(capsys, *argv)
    built = built_head_dims("fa2_sm80" if "fa2_sm80" in argv else "fa3_sm90")
    assert code == 2 and "head dim 256 is not built" in out, out
    assert ", ".join(map(str, built)) in out
