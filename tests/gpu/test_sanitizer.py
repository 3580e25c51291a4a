"""compute-sanitizer racecheck and synccheck over every reference kernel and a sample of lowered
variants (issue 20, Deliver 2): the cases of experiments/sanitize_variants.py (fa2_sm80, fa3_sm90 and
lowered variants on each) and experiments/sanitize_bwd.py (fa2_bwd_sm80, fa3_bwd_sm90 at its default
option, the variant backwards on both), run as child processes under the tool. Each case is also
checked under the verification rule inside the child (exit 1 on a wrong answer).

A run passes when the child exits 0 and the tool's summary reports no error: racecheck's
"RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" needs E == 0 and N == 0 (a
"potential" hazard counts: session 9's write-after-read hazard on fa3_bwd_sm90's LSE slot was one),
synccheck's "ERROR SUMMARY: 0 errors". Racecheck slows a kernel ~100x: the cases are tiny, each
child gets 600 s."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TOOL = shutil.which("compute-sanitizer") or next(iter(sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))), None)
if TOOL is None:
    pytest.skip("compute-sanitizer is not on PATH nor under /usr/local/cuda*/bin", allow_module_level=True)

RUNS = [("sanitize_variants.py", "fa2_sm80"), ("sanitize_variants.py", "fa3_sm90"),
        ("sanitize_bwd.py", "fa2_bwd_sm80"), ("sanitize_bwd.py", "variants"),
        ("sanitize_bwd.py", "fa3_bwd_sm90"), ("sanitize_bwd.py", "hopper_variants")]


def _summary_errors(tool: str, text: str) -> str | None:
    """None when the tool's summary line says clean, else that line (or why there is none)."""
    if tool == "racecheck":
        m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
        return None if m and m.group(1) == "0" and m.group(2) == "0" else (m.group(0) if m else "no RACECHECK SUMMARY")
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    return None if m and m.group(1) == "0" else (m.group(0) if m else "no ERROR SUMMARY")


@pytest.mark.parametrize("tool", ["racecheck", "synccheck"])
@pytest.mark.parametrize("script, only", RUNS, ids=[f"{s.removesuffix('.py')}-{o}" for s, o in RUNS])
def test_sanitizer_is_clean(tool, script, only):
    import torch
    if only.startswith(("fa3", "hopper")) and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{only} needs an sm_90 GPU")
    cmd = [str(TOOL), "--tool", tool, "--error-exitcode", "9", "--print-limit", "12"]
    cmd += ["--racecheck-report", "hazard"] if tool == "racecheck" else []
    cmd += [sys.executable, str(ROOT / "experiments" / script), "--only", only]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    text = proc.stdout + proc.stderr
    bad = _summary_errors(tool, text)
    assert proc.returncode == 0 and bad is None, \
        f"{tool} {script} --only {only}: exit {proc.returncode}, {bad}\n{text[-4000:]}"


def test_summary_parsing_can_fail():
    """The pass condition itself: a displayed hazard, an error count or a missing summary fails."""
    assert _summary_errors("racecheck", "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)") is None
    assert _summary_errors("racecheck", "RACECHECK SUMMARY: 12 hazards displayed (10240 errors, 0 warnings)")
    assert _summary_errors("racecheck", "RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)")
    assert _summary_errors("racecheck", "Traceback ...")
    assert _summary_errors("synccheck", "ERROR SUMMARY: 0 errors") is None
    assert _summary_errors("synccheck", "ERROR SUMMARY: 3 errors")
