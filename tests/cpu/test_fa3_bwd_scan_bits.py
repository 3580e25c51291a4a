"""Session 17's run-at-a-time q_scan (CUBRIDGE_BWD_SCAN_BITS=1, cubridge.lower.fa3_bwd_sm90 q_range): on the host (the
g++ harness of test_fa3_bwd_variant_range.py), for every built-in variant and the corpus's block tables at its shapes,
the runs it writes for every CTA are exactly the tile-at-a-time scan's (count, and each run's start and length), and
the knob rejects other values. No GPU."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cubridge.lower.cexpr import LowerError
from cubridge.lower.fa3_bwd_sm90 import SCAN_BITS_ENV
from cubridge.runtime.variant_bwd import VariantBackward
from test_fa3_bwd_variant_range import BUILTINS, CORPUS, CORPUS_TABLES, SHAPES, _harness, _inputs

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")

SCAN = "  q_scan(va, b, hk, G, n0, Nq, Nk, runs);\n  std::vector<int> t;\n"
PRINT = SCAN + ('  printf("%%d %%d %%d:", b, hk, n0);\n  for (int k = 0; k < 1 + 2 * kQRuns; ++k) printf(" %%d", runs[k]);\n'
                '  printf("\\n");\n')


def _runs_output(name: str, params: dict, bits: bool, shapes, tmp_path: Path, monkeypatch) -> list[str]:
    monkeypatch.setenv(SCAN_BITS_ENV, "1" if bits else "0")
    bwd = VariantBackward(str(CORPUS / f"{name}.py") if params is not None else name, **(params or {}))
    text = _harness(bwd)
    assert ("q_ffs(rest)" in text) == bits and text.count(SCAN % ()) == 1
    cpp, exe = tmp_path / f"{name}_{int(bits)}.cpp", tmp_path / f"{name}_{int(bits)}"
    cpp.write_text(text.replace(SCAN % (), PRINT % ()))
    proc = subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = []
    for shape in shapes:
        run = subprocess.run([str(exe)], input=_inputs(bwd, shape), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), f"{name} {shape}:\n{run.stdout[-2000:]}"
        outs.append(run.stdout)
    return outs


@pytest.mark.parametrize("name", BUILTINS)
def test_scan_bits_writes_the_same_runs(name, tmp_path, monkeypatch):
    loop = _runs_output(name, None, False, SHAPES, tmp_path, monkeypatch)
    bits = _runs_output(name, None, True, SHAPES, tmp_path, monkeypatch)
    assert bits == loop and all(o.count("\n") > 1 for o in loop)


@pytest.mark.parametrize("case", CORPUS_TABLES, ids=lambda c: c[0] + "".join(f"-{k}{v}" for k, v in c[1].items()))
def test_scan_bits_writes_the_same_runs_on_tables(case, tmp_path, monkeypatch):
    """Block tables with more runs than the 3 hold (the last absorbs the rest) and gaps across chunk ends."""
    name, params = case
    shapes = [(2, 4, 2, 700, 1300), (1, 2, 1, 2200, 2200)]
    assert _runs_output(name, params, True, shapes, tmp_path, monkeypatch) == \
        _runs_output(name, params, False, shapes, tmp_path, monkeypatch)


def test_scan_bits_knob(monkeypatch):
    monkeypatch.setenv(SCAN_BITS_ENV, "2")
    with pytest.raises(LowerError, match=SCAN_BITS_ENV):
        VariantBackward("sigmoid").hopper.source
