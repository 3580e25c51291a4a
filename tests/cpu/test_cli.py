"""`cubridge` command line: verify-ir, check-ir, print-ir, analyze, specs; exit codes 0 (ok),
1 (verification failed), 2 (a usage or program error, with a message naming the file)."""
from __future__ import annotations

import pytest

from cubridge.cli import main
from cubridge.cuir.parser import parse, parse_file
from cubridge.paths import ref_kernel_dir

FA2_PATH = ref_kernel_dir("fa2_sm80") / "kernel.cuir"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ verify-ir
def test_verify_ir_passes(capsys):
    code, out, err = run(capsys, "verify-ir", "fa2_sm80", "--spec", "causal", "--quick", "--head-dim", "32")
    assert code == 0, out + err
    assert "verify fa2_sm80 against spec causal" in out
    assert "3/3 cases passed" in out


def test_verify_ir_fails_on_the_wrong_spec(capsys):
    code, out, _ = run(capsys, "verify-ir", "fa2_sm80", "--spec", "full", "--param", "CAUSAL=1", "--quick",
                       "--head-dim", "32")
    assert code == 1
    assert "CAUSAL=1" in out and "FAIL" in out and "exceeds bound" in out


def test_verify_ir_one_shape_by_path_f16(capsys):
    code, out, _ = run(capsys, "verify-ir", str(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), "--spec", "full",
                       "--param", "CAUSAL=0", "--shape", "1,4,2,70,16", "--seeds", "2", "--dtype", "fp16")
    assert code == 0, out
    assert "(fp16;" in out and "2/2 cases passed" in out


def test_verify_ir_reports_a_broken_program(capsys, tmp_path):
    text = FA2_PATH.read_text()
    old = "            wait_group(STAGES - 2)\n"
    assert old in text
    bad = tmp_path / "bad.cuir"
    bad.write_text(text.replace(old, ""))
    code, out, _ = run(capsys, "verify-ir", str(bad), "--spec", "causal", "--shape", "1,1,1,70,16", "--seeds", "1")
    assert code == 1
    assert "static check" in out and "bad.cuir" in out


# ------------------------------------------------------------------ check-ir, print-ir
@pytest.mark.parametrize("name, D, smem", [("fa2_sm80", 128, 98304), ("fa3_sm90", 64, 82008)])
def test_check_ir(capsys, name, D, smem):
    code, out, _ = run(capsys, "check-ir", name, "--head-dim", str(D))
    assert code == 0
    assert f"{name}: ok (D={D}" in out
    assert f"shared memory: {smem} B" in out


def test_check_ir_roles_and_params(capsys):
    code, out, _ = run(capsys, "check-ir", "fa3_sm90", "--param", "STAGES=3")
    assert code == 0
    assert "STAGES=3" in out
    assert "producer x1 (4 warps), consumer x2 (4 warps)" in out


def test_check_ir_rejects_with_file_and_line(capsys, tmp_path):
    text = FA2_PATH.read_text()
    old = "s = mma(Qs, transpose(Ks[st]))"
    assert text.count(old) == 1
    bad = tmp_path / "bad.cuir"
    bad.write_text(text.replace(old, "s = mma(Qs, Ks[st])"))
    line = text[: text.index(old)].count("\n") + 1
    code, _, err = run(capsys, "check-ir", str(bad), "--head-dim", "128")
    assert code == 2
    assert f"{bad}:{line}: mma(): inner dims differ" in err


def test_check_ir_over_smem_limit(capsys):
    code, _, err = run(capsys, "check-ir", "fa3_sm90", "--head-dim", "128", "--param", "STAGES=8")
    assert code == 2
    assert "exceeds the sm_90a limit" in err


@pytest.mark.parametrize("name", ["fa2_sm80", "fa3_sm90"])
def test_print_ir_reparses_to_the_same_program(capsys, name):
    code, out, _ = run(capsys, "print-ir", name)
    assert code == 0
    assert parse(out) == parse_file(ref_kernel_dir(name) / "kernel.cuir")
    code, again, _ = run(capsys, "print-ir", str(ref_kernel_dir(name) / "kernel.cuir"))
    assert again == out


# ------------------------------------------------------------------ analyze, specs
def test_analyze(capsys):
    code, out, _ = run(capsys, "analyze", "fa2_sm80", "--shape", "1,2,1,256,32", "--param", "CAUSAL=0",
                       "--spec", "full")
    assert code == 0
    flops = 4 * 2 * 256 * 256 * 32
    rows = dict(line.split("  ", 1) for line in out.splitlines() if "  " in line)
    assert rows["MMA FLOPs executed"].strip() == f"{flops:,}"
    assert rows["useful FLOPs (attended pairs)"].strip() == f"{flops:,}"
    assert rows["KV tiles visited"].strip() == "16" and rows["KV tiles skipped"].strip() == "0"


def test_analyze_causal_skips_tiles(capsys):
    code, out, _ = run(capsys, "analyze", "fa2_sm80", "--shape", "1,1,1,256,16")
    assert code == 0
    rows = dict(line.split("  ", 1) for line in out.splitlines() if "  " in line)
    assert rows["KV tiles visited"].strip() == "6" and rows["KV tiles skipped"].strip() == "2"


def test_specs_list(capsys):
    code, out, _ = run(capsys, "specs")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert "causal" in names and "full" in names and len(names) >= 10


def test_specs_show_one(capsys):
    code, out, _ = run(capsys, "specs", "causal", "-n", "6")
    assert code == 0
    assert out.startswith("Spec('causal'")
    picture = out.splitlines()[1:7]
    assert picture == ["#" * (i + 1) + "." * (5 - i) for i in range(6)]


# ------------------------------------------------------------------ errors: exit 2 with a message
def test_bad_program_path(capsys, tmp_path):
    missing = tmp_path / "nope" / "prog.cuir"
    for cmd in ("check-ir", "print-ir"):
        code, out, err = run(capsys, cmd, str(missing))
        assert code == 2
        assert str(missing) in err and "cannot read" in err
        assert out == ""


def test_unknown_reference_kernel(capsys):
    code, _, err = run(capsys, "check-ir", "fa9_sm99")
    assert code == 2
    assert "fa9_sm99" in err and "fa2_sm80" in err


def test_syntax_error_names_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.cuir"
    bad.write_text('kernel("k")\nimport os\n')
    code, _, err = run(capsys, "print-ir", str(bad))
    assert code == 2
    assert f"{bad}:2: forbidden construct: Import" in err


def test_bad_param_and_spec(capsys):
    code, _, err = run(capsys, "check-ir", "fa2_sm80", "--param", "STAGES")
    assert code == 2 and "NAME=VALUE" in err
    code, _, err = run(capsys, "check-ir", "fa2_sm80", "--param", "NOPE=1")
    assert code == 2 and "unknown parameter(s) ['NOPE']" in err
    code, _, err = run(capsys, "verify-ir", "fa2_sm80", "--spec", "no_such_spec", "--quick")
    assert code == 2 and "no_such_spec" in err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as ei:
        main(["verify-ir", "fa2_sm80"])          # --spec is required
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        main([])
    assert ei.value.code == 2


def test_lower_writes_cuda_from_a_transfer_file_or_a_spec(tmp_path, capsys):
    from cubridge.cli import main
    cuir = tmp_path / "p.cuir"
    assert main(["transfer", "prefixlm", "--ref", "fa3_sm90", "--no-verify", "--out", str(cuir)]) == 0
    out = tmp_path / "p.cu"
    assert cuir.read_text().startswith("# WARNING: NOT VERIFIED - written with --no-verify")
    assert main(["lower", str(cuir), "--ref", "fa3_sm90", "--spec", "prefixlm", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "mask_pred" in text and "va.C0" in text and "// @cuir-region kv_range" in text
    assert main(["lower", "relative_pos", "--ref", "fa2_sm80", "--out", str(tmp_path / "r.cu")]) == 0
    assert "va.SLOPES" in (tmp_path / "r.cu").read_text()
    assert main(["lower", "no_such_spec"]) == 2
    assert "not found" in capsys.readouterr().err


def test_tune_logging_levels(tmp_path, capsys):
    """-q keeps the run's steps out of the output (only the exit status speaks); -v adds a line per
    trial; the default says the run's steps. Replayed results: no GPU needed."""
    import json
    import textwrap

    from cubridge.cli import tune_main
    from cubridge.config import load_config
    from cubridge.search.testing_jobs import synthetic_recording

    def run(flag, name):
        cfg_path = tmp_path / f"{name}.yaml"
        cfg_path.write_text(textwrap.dedent(f"""\
            spec: causal
            reference: fa3_sm90
            arch: sm_90a
            shapes: {{heads_q: 8, heads_kv: 2, head_dim: 128, lengths: [1024]}}
            budget: {{trials: 3, minutes: 1}}
            output: {tmp_path / name}
            """))
        cfg = load_config(cfg_path)
        rec = tmp_path / f"{name}.json"
        rec.write_text(json.dumps(synthetic_recording("fa3_sm90", 128, "sm_90a", cfg.shapes.targets)))
        code = tune_main([str(cfg_path), "--runner", "replay", "--replay", str(rec), *flag])
        out = capsys.readouterr()
        return code, out.out + out.err

    code, quiet = run(["-q"], "quiet")
    assert code == 0 and "screened" not in quiet and "trials" not in quiet
    code, default = run([], "default")
    assert code == 0 and "screened 1 candidate" in default and "trial #" not in default
    code, verbose = run(["-v"], "verbose")
    assert code == 0 and "trial #" in verbose
