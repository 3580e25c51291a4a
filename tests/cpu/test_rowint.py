"""Row-interval masks (cubridge/lower/rowint.py): which masks the analysis proves to keep one
interval of keys per row and which it must refuse, and, compiled with g++ from each lowered
variant's generated mask region, that mask_rows' [lo, hi) equals mask_pred on every pair of a
range of rows and keys (prefix, block-causal, sliding windows, chunks). No GPU."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower, regions, rowint
from cubridge.lower.fa3_sm90 import MASK_ROWS_ENV, mask_rows_enabled
from cubridge.lower.cexpr import LowerError
from cubridge.runtime.kernels import reference_kernel
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer
from cubridge.transfer.trace import trace_mask

NAMES = {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int"), "b": ("b", "int"), "h": ("h", "int"),
         "C0": ("va.C0", "int")}


def _rows(fn):
    return rowint.row_interval(trace_mask(fn).expr, NAMES, {})


@pytest.mark.parametrize("fn", [
    lambda b, h, q, kv: (kv <= q) | (kv < 100),                     # prefix LM
    lambda b, h, q, kv: q // 256 >= kv // 256,                      # block causal
    lambda b, h, q, kv: (kv <= q) & (q - kv < 256),                 # sliding window
    lambda b, h, q, kv: ~(kv > q),                                  # negated atom
    lambda b, h, q, kv: (q < 64) | (kv <= q),                       # a key-free term in a union
    lambda b, h, q, kv: (kv >= q - 8) & ~((kv > q + 8) | (h > 3)),  # De Morgan, a head term
    lambda b, h, q, kv: kv == q,
])
def test_proves_interval(fn):
    rows = _rows(fn)
    assert rows is not None and rows.hi is not None


@pytest.mark.parametrize("fn", [
    lambda b, h, q, kv: ((kv <= q) & (q - kv < 256)) | (kv < 64) | (q < 64),   # global_sliding_window
    lambda b, h, q, kv: (kv < 10) | (kv > 20),                     # two pieces
    lambda b, h, q, kv: kv != q,
    lambda b, h, q, kv: 2 * kv < q,                                 # not +-ik
    lambda b, h, q, kv: kv % 64 < 32,
    lambda b, h, q, kv: q < 64,                                     # key-free: nothing per key to save
])
def test_refuses(fn):
    assert _rows(fn) is None


def test_builtin_variants():
    """prefixlm and causal_blockwise get mask_rows; global_sliding_window (two pieces past row 320)
    and share_question (a gathered key) do not, and their lowered source has no CUIR_MASK_ROWS."""
    for name, proved in (("prefixlm", True), ("causal_blockwise", True), ("global_sliding_window", False),
                         ("share_question", False)):
        src = _lowered(name)[1].source
        assert ("#define CUIR_MASK_ROWS 0" in src) == proved, name
        assert "#define CUIR_MASK_ROWS 1" not in src, name          # off by default


def test_env_switch(monkeypatch):
    monkeypatch.setenv(MASK_ROWS_ENV, "1")
    assert mask_rows_enabled() and "#define CUIR_MASK_ROWS 1" in _lowered("prefixlm")[1].source
    monkeypatch.setenv(MASK_ROWS_ENV, "yes")
    with pytest.raises(LowerError, match=MASK_ROWS_ENV):
        mask_rows_enabled()


HARNESS = r"""
#include <cstdio>
#define __device__
#define __forceinline__ inline
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fmaf_rn(float a, float b, float c) { return a * b + c; }
%(regions)s
int main() {
  int Nk;
  if (scanf("%%d", &Nk) != 1) return 2;
  VariantArgs va{};
%(read)s
  long errors = 0, kept = 0;
  for (int q = 0; q < Nk + 300; ++q) {            // positions past Nk too (Nq > Nk)
    int lo, hi;
    mask_rows(va, 0, 0, q, lo, hi);
    if (!kMaskRowLo && lo > 0) { printf("q %%d: lo %%d but kMaskRowLo false\n", q, lo); ++errors; }
    for (int k = 0; k < Nk; ++k) {
      const bool want = mask_pred(va, 0, 0, q, k), got = lo <= k && k < hi;
      kept += want;
      if (want != got && ++errors < 10) printf("q %%d k %%d: rows %%d vs mask %%d\n", q, k, got, want);
    }
  }
  printf("%%ld\n%%s\n", kept, errors ? "errors" : "ok");
  return errors ? 1 : 0;
}
"""

# Specs whose mask the analysis proves, with scalar VariantArgs only (the harness reads them in).
PROVED = ["prefixlm", "causal_blockwise", "composite", "tests/corpus/ag_prefix_lm.py",
          "tests/corpus/ag_sliding_window.py", "tests/corpus/fa_local_softcap.py",
          "tests/corpus/gemma2_local.py", "tests/corpus/llama4_chunked.py",
          "tests/corpus/mistral_sliding_window.py", "tests/corpus/phi3_sliding_window.py"]


def _lowered(spec_name: str):
    cand = transfer(parse_file(reference_kernel("fa3_sm90").cuir_path()), load_spec(spec_name))
    return cand, lower(cand.program, "fa3_sm90")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")
@pytest.mark.parametrize("spec_name", PROVED)
def test_mask_rows_equal_the_mask(spec_name, tmp_path):
    cand, kern = _lowered(spec_name)
    assert all(kind in ("int", "float") for _, kind in kern.fields), kern.fields
    text = "\n".join(regions.body(kern.source, n) for n in ("extra_io", "mask"))
    assert "mask_rows(" in text, spec_name
    read = [f"  if (scanf(\"{'%d' if kind == 'int' else '%f'}\", &va.{name}) != 1) return 2;" for name, kind in kern.fields]
    cpp, exe = tmp_path / "h.cpp", tmp_path / "h"
    cpp.write_text(HARNESS % {"regions": text.replace('asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;',
                                                      "y = x; return y;"), "read": "\n".join(read)})
    proc = subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for nk in (1000, 9000, 20000):               # past the corpus's 1024-8192 windows and chunks
        inputs = cand.bind(Nq=nk, Nk=nk, Hq=2, Hkv=2, B=1, params={"BLOCK_M": 128, "BLOCK_N": 128}, device="cpu")
        values = " ".join(repr(float(inputs[n]) if kind == "float" else int(inputs[n])) for n, kind in kern.fields)
        run = subprocess.run([str(exe)], input=f"{nk}\n{values}\n", capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), f"{spec_name} {nk}:\n{run.stdout[-2000:]}"
        assert int(run.stdout.split()[0]) > 0                     # the mask keeps something
