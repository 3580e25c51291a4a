"""`cubridge lower` and `transfer --out` write only what passed its check and its verification
(exit 2 with the reason otherwise; --force writes it under a warning header), and a spec's
reference() that never returns is stopped with a message naming it."""
from __future__ import annotations

import textwrap

import pytest

from cubridge import verify
from cubridge.cli import main
from cubridge.paths import ref_kernel_dir

FA2 = ref_kernel_dir("fa2_sm80") / "kernel.cuir"

# A spec whose mask (what the transfer lowers) disagrees with its reference (what is verified).
LYING_SPEC = '''\
"""Says causal in its mask, computes full attention in its reference."""
import math
import torch
PARAMS = {}
def mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx
def reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
'''

HANGING_SPEC = '''\
"""A reference that never returns."""
import time
PARAMS = {}
def mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx
def reference(q, k, v):
    while True:
        time.sleep(0.01)
'''


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def lying(tmp_path):
    p = tmp_path / "lying.py"
    p.write_text(LYING_SPEC)
    return p


def test_transfer_out_refuses_a_failing_program_and_force_marks_it(capsys, tmp_path, lying):
    out = tmp_path / "t.cuir"
    code, stdout, err = run(capsys, "transfer", lying, "--ref", "fa2_sm80", "--quick", "--head-dim", 64, "--out", out)
    assert code == 2 and not out.exists(), stdout + err
    assert err.startswith("error: refusing to write") and "verification failed" in err and "--force" in err
    assert "FAIL" in stdout        # the table says which cases failed
    code, stdout, err = run(capsys, "transfer", lying, "--ref", "fa2_sm80", "--quick", "--head-dim", 64,
                            "--out", out, "--force")
    assert code == 1, stdout + err          # written on request, still reported as failing
    text = out.read_text()
    assert text.startswith("# WARNING: NOT VERIFIED - written with --force") and "verification failed" in text


def test_lower_refuses_a_spec_that_fails_verification(capsys, tmp_path, lying):
    out = tmp_path / "v.cu"
    code, _, err = run(capsys, "lower", lying, "--ref", "fa2_sm80", "--quick", "--head-dim", 32, "--out", out)
    assert code == 2 and not out.exists(), err
    assert "error: refusing to write the CUDA of spec" in err and "exceeds bound" in err
    code, _, err = run(capsys, "lower", lying, "--ref", "fa2_sm80", "--quick", "--head-dim", 32, "--out", out,
                       "--force")
    assert code == 0, err
    assert out.read_text().startswith("// WARNING: NOT VERIFIED - written with --force")


def test_lower_of_a_cuir_file_needs_its_spec_and_a_passing_check(capsys, tmp_path):
    code, _, err = run(capsys, "lower", FA2, "--ref", "fa2_sm80", "--out", tmp_path / "a.cu")
    assert code == 2 and "names no spec" in err and "--spec" in err
    code, _, err = run(capsys, "lower", FA2, "--ref", "fa2_sm80", "--spec", "full", "--quick", "--head-dim", 32,
                       "--out", tmp_path / "b.cu")          # fa2_sm80 defaults to CAUSAL=1
    assert code == 2 and "against spec full" in err and not (tmp_path / "b.cu").exists()
    code, _, err = run(capsys, "lower", FA2, "--ref", "fa2_sm80", "--spec", "causal", "--quick", "--head-dim", 32,
                       "--out", tmp_path / "c.cu")
    assert code == 0 and "WARNING" not in (tmp_path / "c.cu").read_text(), err
    broken = tmp_path / "broken.cuir"
    broken.write_text(FA2.read_text().replace("            wait_group(STAGES - 2)\n", "", 1))
    code, _, err = run(capsys, "lower", broken, "--ref", "fa2_sm80", "--spec", "causal", "--out", tmp_path / "d.cu")
    assert code == 2 and "static check failed" in err and "broken.cuir:" in err


def test_a_reference_that_never_returns_is_stopped_and_named(capsys, tmp_path, monkeypatch):
    spec = tmp_path / "hangs.py"
    spec.write_text(HANGING_SPEC)
    monkeypatch.setattr(verify, "REFERENCE_TIMEOUT_S", 0.5)
    code, out, _ = run(capsys, "verify-ir", FA2, "--spec", spec, "--shape", "1,1,1,20,16", "--seeds", 1)
    assert code == 1
    assert "spec reference failed" in out and "reference() at B=1" in out and "did not return within 0.5 s" in out


def test_time_limit_off_the_main_thread():
    import threading
    import time
    from cubridge.timelimit import TimeLimitError, call_with_limit
    box = {}

    def worker():
        try:
            call_with_limit(lambda: time.sleep(30), 0.2, "reference()")
        except TimeLimitError as e:
            box["e"] = str(e)
        box["value"] = call_with_limit(lambda: 7, 5.0, "x")
    t = threading.Thread(target=worker)
    t.start()
    t.join(20)
    assert box == {"e": "reference() did not return within 0.2 s\n  hint: make it finish (it runs at every "
                        "verification shape), or raise the limit", "value": 7}


@pytest.mark.parametrize("argv, where, what", [
    (["lower", "causal", "--out", "{tmp}"], "--out", "is a directory"),
    (["transfer", "causal", "--out", "{tmp}/nope/x.cuir"], "--out", "does not exist"),
    (["lower", "causal", "--spec-param", "x=abc"], "--spec-param", "'abc' is not a number"),
    (["lower", "causal", "--spec-param", "x"], "--spec-param", "is not NAME=VALUE"),
    (["analyze", "fa2_sm80", "--shape", "1,2,3"], "--shape", "is not five positive integers"),
    (["verify-ir", "fa2_sm80", "--spec", "causal", "--shape", "1,3,2,64,32"], "--shape",
     "Hq = 3 is not a multiple of Hkv = 2"),
    (["transfer", "causal", "--shape", "1,4,0,64,32", "--no-verify"], "--shape", "positive integers"),
])
def test_bad_cli_input_is_a_located_error(capsys, tmp_path, argv, where, what):
    code, _, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2, err
    assert err.startswith(f"error: {where}: ") and what in err, err
    assert "Traceback" not in err


def test_transfer_to_a_read_only_folder_is_a_located_error(capsys, tmp_path, monkeypatch):
    # Tests may run as root, for whom chmod 500 does not stop a write: the permission is faked.
    import os
    from cubridge import gate
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(gate.os, "access", lambda p, mode: not str(p).startswith(str(ro)) and os.access(p, mode))
    code, _, err = run(capsys, "transfer", "causal", "--no-verify", "--out", ro / "x.cuir")
    assert code == 2 and err.startswith("error: --out: ") and "not writable" in err, err
    assert not (ro / "x.cuir").exists()


def test_one_dtype_vocabulary_and_head_dim_default_with_configs(capsys):
    from cubridge.cli import HEAD_DIM, build_parser
    from cubridge.config import DTYPES, MODELS
    assert set(DTYPES) == {"bf16", "fp16"}
    assert {hd for _, _, hd in MODELS.values()} == {HEAD_DIM}
    for cmd in (["check-ir", "fa2_sm80"], ["transfer", "causal"], ["lower", "causal"]):
        assert build_parser().parse_args(cmd).head_dim == HEAD_DIM
    assert build_parser().parse_args(["verify-ir", "fa2_sm80", "--spec", "causal", "--dtype", "f16"]).dtype == "fp16"


def test_check_ir_says_when_the_kernel_is_not_built_at_that_head_dim(capsys):
    code, out, _ = run(capsys, "check-ir", "fa3_sm90", "--head-dim", 100)
    assert code == 1 and "fa3_sm90: CuIR ok, but NOT BUILDABLE: the fa3_sm90 kernel builds head dims" in out
    code, out, _ = run(capsys, "check-ir", "fa3_sm90")
    assert code == 0 and "fa3_sm90: ok (D=128;" in out


def test_a_long_analyze_says_so_and_reports_progress(capsys, monkeypatch):
    """analyze at 8k ran 4 minutes without a word: from ANALYZE_SAYS_FROM it says it will take
    minutes, and the interpreter reports blocks done (printed every ANALYZE_PROGRESS_S; a fake
    clock here, no wall-clock bound)."""
    from cubridge import cli
    monkeypatch.setattr(cli, "ANALYZE_SAYS_FROM", 100)
    code, out, err = run(capsys, "analyze", "fa2_sm80", "--shape", "1,2,1,130,16")
    assert code == 0 and "KV tiles visited" in out
    assert err.startswith("analyze: interpreting every tile on the CPU at N=130: minutes"), err
    ticks = iter([0.0, 4.0, 11.0, 15.0, 23.0])
    report = cli._progress_printer(clock=lambda: next(ticks))
    for done in (1, 2, 3, 4):
        report(done, 8)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["analyze: 2/8 blocks interpreted (11 s, about 33 s left)",
                     "analyze: 4/8 blocks interpreted (23 s, about 23 s left)"]


def test_the_interpreter_reports_each_block_it_runs():
    from cubridge.analysis import analyze
    from cubridge.cuir.parser import parse_file
    from cubridge.paths import ref_kernel_dir
    from cubridge.verify import Case
    seen = []
    analyze(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), Case(2, 2, 1, 200, 200, 16),
            progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == list(range(1, len(seen) + 1))


def test_transfer_refuses_a_head_dim_the_kernel_is_not_built_for(capsys):
    """The interpreter verifies CuIR at any D, so without this a transfer at D = 100 "passed" and
    nothing downstream could lower or tune it; --force studies the CuIR there anyway, with a note."""
    code, stdout, err = run(capsys, "transfer", "causal", "--ref", "fa2_sm80", "--quick", "--head-dim", 32)
    assert code == 2 and "head dim 32 is not built for fa2_sm80" in err and "--force" in err, stdout + err
    code, stdout, err = run(capsys, "transfer", "causal", "--ref", "fa2_sm80", "--quick", "--head-dim", 32, "--force")
    assert code == 0 and "note: head dim 32 is not built" in err and "cases passed" in stdout, stdout + err
