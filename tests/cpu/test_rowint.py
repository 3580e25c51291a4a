"""Row-interval masks (cubridge/lower/rowint.py): which masks the analysis proves to keep one
interval (or two pieces) of keys per row and which it must refuse; and, compiled with g++ from each
lowered variant's generated mask region and kernel.cu's tile_row_interval, that mask_rows' pieces
equal mask_pred on every pair of a range of rows and keys, and that the kernel's per-tile interval
of each thread's columns equals the mask (prefix, block-causal, sliding windows, chunks,
global_sliding_window at three KV tiles). No GPU."""
from __future__ import annotations

import shutil
from pathlib import Path
import subprocess

import pytest
import torch

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
    lambda b, h, q, kv: ((kv <= q) & (q - kv < 256)) | (kv < 64) | (q < 64),   # two pieces: row_pieces
    lambda b, h, q, kv: (kv < 10) | (kv > 20),                     # two pieces
    lambda b, h, q, kv: kv != q,
    lambda b, h, q, kv: 2 * kv < q,                                 # not +-ik
    lambda b, h, q, kv: kv % 64 < 32,
    lambda b, h, q, kv: q < 64,                                     # key-free: nothing per key to save
])
def test_refuses(fn):
    assert _rows(fn) is None


def test_pieces():
    """global_sliding_window is two pieces (window, global columns); three pieces are refused."""
    gsw = trace_mask(lambda b, h, q, kv: ((kv <= q) & (q - kv < 256)) | (kv < 64) | (q < 64)).expr
    assert len(rowint.row_pieces(gsw, NAMES, {})) == 2
    three = trace_mask(lambda b, h, q, kv: (kv < 10) | ((kv > 20) & (kv < 30)) | (kv > q)).expr
    assert rowint.row_pieces(three, NAMES, {}) is None
    # unbounded below on both sides: one piece
    assert len(rowint.row_pieces(trace_mask(lambda b, h, q, kv: (kv <= q) | (kv < 64)).expr, NAMES, {})) == 1


def test_builtin_variants(monkeypatch):
    """prefixlm and causal_blockwise get one piece, global_sliding_window two; share_question (a
    gathered key) gets no mask_rows. By default (auto) on for two pieces only (session 12 mid call:
    global_sliding_window +5-7%, one-piece masks -0.8..+0.2%)."""
    monkeypatch.delenv(MASK_ROWS_ENV, raising=False)
    for name, pieces in (("prefixlm", 1), ("causal_blockwise", 1), ("global_sliding_window", 2),
                         ("share_question", 0)):
        src = _lowered(name)[1].source
        assert ("#define CUIR_MASK_ROWS" in src) == (pieces > 0), name
        assert (f"constexpr int kMaskPieces = {pieces};" in src) == (pieces > 0), name
        assert ("#define CUIR_MASK_ROWS 1" in src) == (pieces == 2), name


def test_env_switch(monkeypatch):
    monkeypatch.setenv(MASK_ROWS_ENV, "1")
    assert mask_rows_enabled(1) and "#define CUIR_MASK_ROWS 1" in _lowered("prefixlm")[1].source
    monkeypatch.setenv(MASK_ROWS_ENV, "0")
    assert not mask_rows_enabled(2) and "#define CUIR_MASK_ROWS 0" in _lowered("global_sliding_window")[1].source
    monkeypatch.setenv(MASK_ROWS_ENV, "yes")
    with pytest.raises(LowerError, match=MASK_ROWS_ENV):
        mask_rows_enabled(1)


def test_wide_tile_and_codegen_choice(monkeypatch):
    """With the scanned range (CUBRIDGE_ROW_RANGE=0) the measured family takes 128 x 176 from 8k:
    softmax, no score_mod, no block table, one interval per row; with the arithmetic range (the
    default) it takes 128 x 128. Session 10's codegen: softmax without a block table (score_mod too)."""
    from cubridge.lower.fa3_sm90 import session10_codegen, wide_tile
    from cubridge.lower.rowrange import ROW_RANGE_ENV
    from cubridge.runtime.fa3_sm90 import default_config
    from cubridge.lower.fa3_sm90 import RANGE_WIDE_ENV
    monkeypatch.delenv(ROW_RANGE_ENV, raising=False)
    monkeypatch.setenv(RANGE_WIDE_ENV, "0")      # (from 16k under CUBRIDGE_RANGE_WIDE=1: tests/cpu/test_tileshare.py)
    assert not wide_tile(_lowered("prefixlm")[1].ir)
    monkeypatch.setenv(ROW_RANGE_ENV, "0")
    for name, wide, codegen in (("prefixlm", True, True), ("causal_blockwise", True, True),
                                ("global_sliding_window", False, True), ("share_question", False, False),
                                ("relative_pos", False, True), ("composite", False, False)):
        kern = _lowered(name)[1]
        assert (wide_tile(kern.ir), session10_codegen(kern.ir)) == (wide, codegen), name
        assert ("#define CUIR_VARIANT_CODEGEN 1" in kern.source) == codegen, name
        assert default_config(128, False, True, 8192, variant=True, wide=wide_tile(kern.ir)).block_n == (176 if wide else 128)
    assert default_config(128, False, True, 4096, variant=True, wide=True).block_n == 128


HARNESS = r"""
#include <cstdio>
#define __device__
#define __forceinline__ inline
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fmaf_rn(float a, float b, float c) { return a * b + c; }
constexpr int kBlockN = BN;
%(regions)s
%(merge)s
int main() {
  int Nk;
  if (scanf("%%d", &Nk) != 1) return 2;
  VariantArgs va{};
%(read)s
  long errors = 0, kept = 0, one = 0, two = 0;
  for (int q = 0; q < Nk + 300; ++q) {            // positions past Nk too (Nq > Nk)
    int lo[kMaskPieces], hi[kMaskPieces];
    mask_rows(va, 0, 0, q, lo, hi);
    for (int k = 0; k < Nk; ++k) {                 // the pieces are the mask
      bool got = false;
      for (int i = 0; i < kMaskPieces; ++i) got |= lo[i] <= k && k < hi[i];
      const bool want = mask_pred(va, 0, 0, q, k);
      kept += want;
      if (want != got && ++errors < 10) printf("q %%d k %%d: rows %%d vs mask %%d\n", q, k, got, want);
    }
    if (Nk > TILE_CHECK_MAX) continue;
    for (int n = 0; n * kBlockN < Nk; ++n)         // kernel.cu's per-tile interval, each thread's columns
      for (int f = 0; f < 8; f += 2) {
        const int kv_col0 = n * kBlockN + f;
        int row_lo, row_hi;
        if (!tile_row_interval(lo, hi, kv_col0, Nk, row_lo, row_hi)) { ++two; continue; }
        ++one;
        for (int j = 0; j < kBlockN / 8; ++j)
          for (int e = 0; e < 2; ++e) {
            const int c = 8 * j + e, k = kv_col0 + c;
            const bool want = (k < Nk) & mask_pred(va, 0, 0, q, k);
            const bool got = ((!kMaskRowLo) | (c >= row_lo)) & (c < row_hi);
            if (want != got && ++errors < 20) printf("q %%d tile %%d col0 %%d c %%d: %%d vs %%d\n", q, n, kv_col0, c, got, want);
          }
      }
  }
  printf("%%ld %%ld %%ld\n%%s\n", kept, one, two, errors ? "errors" : "ok");
  return errors ? 1 : 0;
}
"""
TILE_CHECK_MAX = 9000
KERNEL = Path(__file__).resolve().parents[2] / "ref_kernels" / "fa3_sm90" / "kernel.cu"


def _merge_fn() -> str:
    """kernel.cu's tile_row_interval, as the kernel compiles it."""
    text = KERNEL.read_text()
    start = text.index("// (tile_row_interval: tests/cpu/test_rowint.py")
    return text[start:text.index("// (end tile_row_interval)", start)]


# Specs whose mask the analysis proves, with scalar VariantArgs only (the harness reads them in).
PROVED = ["prefixlm", "causal_blockwise", "composite", "tests/corpus/ag_prefix_lm.py",
          "tests/corpus/ag_sliding_window.py", "tests/corpus/fa_local_softcap.py",
          "tests/corpus/gemma2_local.py", "tests/corpus/llama4_chunked.py",
          "tests/corpus/mistral_sliding_window.py", "tests/corpus/phi3_sliding_window.py"]


def _lowered(spec_name: str):
    cand = transfer(parse_file(reference_kernel("fa3_sm90").cuir_path()), load_spec(spec_name))
    return cand, lower(cand.program, "fa3_sm90")


def _compile(kern, block_n: int, tmp_path) -> Path:
    text = "\n".join(regions.body(kern.source, n) for n in ("extra_io", "mask"))
    assert "mask_rows(" in text
    read = [f"  if (scanf(\"{'%d' if kind == 'int' else '%f'}\", &va.{name}) != 1) return 2;" for name, kind in kern.fields]
    cpp, exe = tmp_path / f"h{block_n}.cpp", tmp_path / f"h{block_n}"
    cpp.write_text(HARNESS % {"regions": text.replace('asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;',
                                                      "y = x; return y;"),
                              "merge": _merge_fn(), "read": "\n".join(read)})
    proc = subprocess.run(["g++", "-O1", "-std=c++17", f"-DBN={block_n}", f"-DTILE_CHECK_MAX={TILE_CHECK_MAX}",
                           "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def _check(spec_name: str, block_n: int, tmp_path, lengths=(1000, 9000, 20000)) -> list:
    """Per length: (pairs kept, tile rows as one interval, tile rows in two pieces); asserts the
    harness found no pair where the pieces or the kernel's per-tile interval differ from the mask."""
    cand, kern = _lowered(spec_name)
    assert all(kind in ("int", "float") for _, kind in kern.fields), kern.fields
    exe = _compile(kern, block_n, tmp_path)
    out = []
    for nk in lengths:
        inputs = cand.bind(Nq=nk, Nk=nk, Hq=2, Hkv=2, B=1, params={"BLOCK_M": 128, "BLOCK_N": block_n}, device="cpu")
        values = " ".join(repr(float(inputs[n]) if kind == "float" else int(inputs[n])) for n, kind in kern.fields)
        run = subprocess.run([str(exe)], input=f"{nk}\n{values}\n", capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), f"{spec_name} {nk}:\n{run.stdout[-2000:]}"
        out.append(tuple(int(x) for x in run.stdout.split("\n")[-3].split()))
        assert out[-1][0] > 0                                   # the mask keeps something
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")
@pytest.mark.parametrize("spec_name", PROVED)
def test_mask_rows_equal_the_mask(spec_name, tmp_path):
    _check(spec_name, 128, tmp_path)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")
@pytest.mark.parametrize("block_n", [64, 128, 176])
def test_two_pieces_global_sliding_window(block_n, tmp_path):
    """global_sliding_window keeps two pieces per row (global columns, window); the kernel's per-tile
    merge gives one interval on most tile rows and falls back (two pieces) on a few of tile 0."""
    counts = _check("global_sliding_window", block_n, tmp_path, lengths=(300, 2500, 9000))
    one, two = sum(c[1] for c in counts), sum(c[2] for c in counts)
    assert one > 0 and 0 < two < one / 20, (one, two)


SELECT_HARNESS = r"""
#define __device__
#define __forceinline__ inline
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
struct VariantArgs {};
%(region)s
int main() {
  VariantArgs va{};
  long errors = 0, kept = 0;
  for (int h = 0; h < 4; ++h)
    for (int q_idx = 0; q_idx < 700; ++q_idx) {
      int lo[kMaskPieces], hi[kMaskPieces];
      mask_rows(va, 0, h, q_idx, lo, hi);
      for (int kv_idx = 0; kv_idx < 700; ++kv_idx) {
        bool got = false;
        for (int i = 0; i < kMaskPieces; ++i) got |= lo[i] <= kv_idx && kv_idx < hi[i];
        const bool want = %(pred)s;
        kept += want;
        errors += want != got;
      }
    }
  printf("%%d %%ld %%ld\n", kMaskPieces, kept, errors);
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")
def test_row_select_one_piece_per_head(tmp_path):
    """A head's choice between a window and causal (ag_head_mask's shape) is two pieces under
    CUIR_ROW_SELECT 0 and one under 1 (knob row_select; rowint.ROW_SELECT_DEFAULT the default); both
    equal the mask on every (h, q, kv)."""
    from cubridge.lower.cexpr import to_c
    expr = trace_mask(lambda b, h, q, kv: torch.where(h < 2, (kv <= q) & (q - kv <= 64), kv <= q)).expr
    assert len(rowint.row_pieces(expr, NAMES, {})) == 2
    assert len(rowint.row_pieces(expr, NAMES, {}, select=True)) == 1
    region = rowint.mask_rows_region(expr, NAMES, {}, False)
    assert f"#define CUIR_ROW_SELECT {int(rowint.ROW_SELECT_DEFAULT)}\n" in region
    cpp = tmp_path / "sel.cpp"
    cpp.write_text("#include <cstdio>\n" + SELECT_HARNESS % {"region": region, "pred": to_c(expr, NAMES, {})})
    for define, pieces in ((["-DCUIR_ROW_SELECT=0"], 2), (["-DCUIR_ROW_SELECT=1"], 1)):
        exe = tmp_path / f"sel{pieces}"
        proc = subprocess.run(["g++", "-O1", "-std=c++17", *define, "-o", str(exe), str(cpp)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split()
        assert got[0] == str(pieces) and int(got[1]) > 0 and got[2] == "0", got


def test_row_select_needs_complementary_choices():
    """Two guarded pieces whose guards are not each other's negation stay two pieces."""
    expr = trace_mask(lambda b, h, q, kv: ((h < 2) & (kv <= q) & (q - kv <= 64)) | ((h > 2) & (kv <= q))).expr
    assert len(rowint.row_pieces(expr, NAMES, {}, select=True)) == 2


def _range(fn):
    return rowint.row_range(trace_mask(fn).expr, NAMES, {})


@pytest.mark.parametrize("fn", [
    lambda b, h, q, kv: kv <= q,                                    # causal
    lambda b, h, q, kv: (kv <= q) | (kv < 100),                     # prefix LM: max(q + 1, 100)
    lambda b, h, q, kv: q // 256 >= kv // 256,                      # block causal
    lambda b, h, q, kv: (kv <= q) & (q - kv < 256),                 # sliding window
    lambda b, h, q, kv: (kv >= q - 8) & (kv <= q + 8) & (h < 3),    # both sides, a head term
    lambda b, h, q, kv: (kv <= q) & (kv // 96 == q // 96),          # chunks
    lambda b, h, q, kv: kv < 2 * q + 1,                             # a positive factor
])
def test_row_range_proves_nondecreasing_bounds(fn):
    rows = _range(fn)
    assert rows is not None and all(rows.up)


@pytest.mark.parametrize("fn", [
    lambda b, h, q, kv: kv < 100 - q,                               # the bound falls as q grows
    lambda b, h, q, kv: (kv <= q) & (kv >= -2 * q + 50),            # a falling lower bound
    lambda b, h, q, kv: (q < 64) | (kv <= q),                       # a query-dependent whole row
    lambda b, h, q, kv: kv < q % 64,                                # modulo: not proven
    lambda b, h, q, kv: ((kv <= q) & (q - kv < 256)) | (kv < 64),   # two pieces
])
def test_row_range_refuses(fn):
    assert _range(fn) is None
