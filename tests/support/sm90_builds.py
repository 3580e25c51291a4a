"""nvcc builds of sm_90a kernels for the CPU tests, and the ptxas report check they share
(tests/cpu/test_fa3_bwd_fuse.py, tests/cpu/test_fa3_bwd_gqa.py): every entry spill-free, no stack frame, no ignored setmaxnreg, no serialised wgmma, no
wgmma wait injected by ptxas."""
from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

PTXAS_WARNINGS = ("C7508", "C7510", "C7515", "C7517", "serializ")


def build(label: str, source: str, flags: list[str], tmp_path) -> tuple[str, subprocess.CompletedProcess]:
    """(label, nvcc's process): `source` (kernel text, written to tmp_path) compiled to an sm_90a cubin, -Xptxas -v."""
    cu = tmp_path / f"{label}.cu"
    cu.write_text(source)
    proc = subprocess.run([shutil.which("nvcc"), "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", *flags,
                           "-Xptxas", "-v", "-o", str(tmp_path / f"{label}.cubin"), str(cu)],
                          capture_output=True, text=True)
    return label, proc


def build_all(jobs, tmp_path, workers: int = 2):
    """build() of every (label, source, flags) job, `workers` nvcc processes at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda j: build(*j, tmp_path), jobs))


def assert_clean(label: str, proc, entry: str, *, reports: int | None = None, min_reports: int = 1) -> None:
    """nvcc succeeded, `entry` was compiled, and ptxas reported no spill (exactly `reports` reports if given, else at
    least min_reports), no stack frame and none of PTXAS_WARNINGS."""
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{label}: nvcc failed\n{log[-3000:]}"
    assert entry in log, f"{label}: no {entry} entry\n{log}"
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    count_ok = len(found) == reports if reports is not None else len(found) >= min_reports
    assert count_ok and all(r == ("0", "0") for r in found), f"{label}: spills\n{log}"
    assert log.count("bytes stack frame") == log.count("0 bytes stack frame"), f"{label}: stack frame\n{log}"
    for warning in PTXAS_WARNINGS:
        assert warning not in log, f"{label}: ptxas warning {warning}\n{log}"
