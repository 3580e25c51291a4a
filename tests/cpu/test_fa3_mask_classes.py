"""Mask classes of the fa3_sm90 forward (cubridge/lower/maskclass.py), run on the host: the
generated regions extra_io, kv_range and mask of each lowered variant are compiled with g++ into a
harness that, for every query tile, walks the KV tiles kv_range visits and checks pair by pair that
- class 0 (no mask) is exactly !tile_partial, and every pair of such a tile is attended;
- a class C >= 1 tile's mask_pred_class<C> (with the key bound) equals mask_pred (with the key
  bound) on every row below Nq and every key of the tile.
It also counts each class, so the single-atom classes are seen to be used (global_sliding_window
has four: the diagonal, the window's first tile, the global columns, the global rows). No GPU."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower, regions
from cubridge.runtime.kernels import reference_kernel
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")

# (spec, BLOCK_N): specs whose VariantArgs are scalars (the binding's values are read in).
CASES = [("global_sliding_window", 128), ("global_sliding_window", 64), ("global_sliding_window", 176),
         ("prefixlm", 128), ("composite", 80), ("causal", 128), ("causal_blockwise", 96),
         ("tests/corpus/modernbert_local.py", 128), ("tests/corpus/streaming_sinks.py", 112),
         ("tests/corpus/longformer_global.py", 128), ("tests/corpus/ag_dilated_sliding_window.py", 128),
         ("tests/corpus/ag_natten.py", 64), ("tests/corpus/llama4_chunked.py", 160),
         ("tests/corpus/fa_local_softcap.py", 128)]
# (Nq, Nk): ragged, fewer queries than keys (end-aligned), one short tile, several windows, and
# longer than the corpus's 1024-4096 windows and 8192 chunks.
SHAPES = [(1000, 1000), (700, 1300), (77, 300), (1, 129), (2500, 2500), (9000, 9000)]

HARNESS = r"""
#include <cmath>
#include <cstdio>
#define __device__
#define __forceinline__ inline
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
constexpr int kBlockM = 128, kBlockN = BN, kWgRows = 64;
%(regions)s
template <int C = 1>
bool pred_of_class(int cls, const VariantArgs& va, int q, int k) {
  if constexpr (C + 1 < kMaskClasses) {
    if (cls != C) return pred_of_class<C + 1>(cls, va, q, k);
  }
  return mask_pred_class<C>(va, 0, 0, q, k);
}
int main() {
  int Nq, Nk;
  if (scanf("%%d %%d", &Nq, &Nk) != 2) return 2;
  VariantArgs va{};
%(read)s
  long errors = 0, seen[16] = {};
  const int shift = Nk - Nq, num_m = (Nq + kBlockM - 1) / kBlockM;
  for (int m = 0; m < num_m; ++m) {
    const KvRange r = kv_range(va, 0, 0, m, m * kBlockM + shift, Nk, Nk);
    for (int i = 0; i < kv_count(r); ++i) {
      const int n = tile_at(r, i), cls = tile_mask_class(va, r, n);
      if (cls < 0 || cls >= kMaskClasses) { printf("class %%d out of range\n", cls); return 1; }
      ++seen[cls];
      if ((cls == 0) == tile_partial(va, r, n)) { printf("m %%d n %%d: class %%d vs tile_partial\n", m, n, cls); ++errors; }
      for (int row = m * kBlockM; row < (m + 1) * kBlockM && row < Nq; ++row)
        for (int k = n * kBlockN; k < (n + 1) * kBlockN; ++k) {
          const int q = row + shift;
          const bool want = (k < Nk) & mask_pred(va, 0, 0, q, k);
          const bool got = cls == 0 || ((k < Nk) & pred_of_class(cls, va, q, k));
          if (want != got && ++errors < 10) printf("m %%d n %%d class %%d q %%d k %%d: %%d vs %%d\n", m, n, cls, q, k, got, want);
        }
      for (int c = 0; c < kBlockM / kWgRows; ++c) {          // each consumer's rows: its own class
        const int wcls = tile_mask_class_wg(va, r, n, c);
        if (wcls < -1 || wcls >= kMaskClasses) { printf("wg class %%d out of range\n", wcls); return 1; }
        ++seen[kMaskClasses + 1 + wcls];
        for (int row = m * kBlockM + c * kWgRows; row < m * kBlockM + (c + 1) * kWgRows && row < Nq; ++row)
          for (int k = n * kBlockN; k < (n + 1) * kBlockN; ++k) {
            const int q = row + shift;
            const bool want = (k < Nk) & mask_pred(va, 0, 0, q, k);
            const bool got = wcls == 0 || (wcls > 0 && ((k < Nk) & pred_of_class(wcls, va, q, k)));
            if (want != got && ++errors < 10) printf("m %%d n %%d wg %%d class %%d q %%d k %%d: %%d vs %%d\n", m, n, c, wcls, q, k, got, want);
          }
      }
    }
  }
  for (int c = 0; c < 2 * kMaskClasses + 1; ++c) printf("%%ld ", seen[c]);   // tiles, then warpgroups from -1
  printf("\n%%s\n", errors ? "errors" : "ok");
  return errors ? 1 : 0;
}
"""
_TANH_PTX = 'asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;'


def _lowered(spec_name: str):
    cand = transfer(parse_file(reference_kernel("fa3_sm90").cuir_path()), load_spec(spec_name))
    return cand, lower(cand.program, "fa3_sm90")


def _harness(kern) -> str:
    text = "\n".join(regions.body(kern.source, n) for n in ("extra_io", "kv_range", "mask"))
    read = [f"  if (scanf(\"{'%d' if kind == 'int' else '%f'}\", &va.{name}) != 1) return 2;" for name, kind in kern.fields]
    return HARNESS % {"regions": text.replace(_TANH_PTX, "y = std::tanh(x); return y;"), "read": "\n".join(read)}


def _run(spec_name: str, block_n: int, tmp_path) -> list[list[int]]:
    """Per shape, the count of each tile class, then of each warpgroup class from -1 (nothing
    attended); asserts the harness passed."""
    cand, kern = _lowered(spec_name)
    assert all(kind in ("int", "float") for _, kind in kern.fields), kern.fields
    cpp, exe = tmp_path / "h.cpp", tmp_path / "h"
    cpp.write_text(_harness(kern))
    proc = subprocess.run(["g++", "-O1", "-std=c++17", f"-DBN={block_n}", "-o", str(exe), str(cpp)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = []
    for nq, nk in SHAPES:
        inputs = cand.bind(Nq=nq, Nk=nk, Hq=2, Hkv=2, B=1, params={"BLOCK_M": 128, "BLOCK_N": block_n}, device="cpu")
        values = " ".join(repr(float(inputs[n]) if kind == "float" else int(inputs[n])) for n, kind in kern.fields)
        run = subprocess.run([str(exe)], input=f"{nq} {nk}\n{values}\n", capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), f"{spec_name} {(nq, nk)}:\n{run.stdout[-2000:]}"
        counts.append([int(x) for x in run.stdout.split("\n")[-3].split()])
    return counts


@pytest.mark.parametrize("spec_name,block_n", CASES)
def test_mask_classes_equal_the_mask(spec_name, block_n, tmp_path):
    _run(spec_name, block_n, tmp_path)


def test_global_sliding_window_uses_every_atom_class(tmp_path):
    """Its four atoms each get tiles of their own at 2500 tokens (so the classes are not a no-op),
    and the whole mask is left to few tiles (query tile 0's near tiles, where rows < 64 meet the
    window)."""
    total = [sum(c) for c in zip(*_run("global_sliding_window", 128, tmp_path))]
    assert len(total) == 15 and all(total[c] > 0 for c in (0, 3, 4, 5, 6)), total
    assert total[1] < sum(total[3:7]), total
    assert total[7] > 0, total    # query tile 0's rows 64-127 past the window: a warpgroup skips


def test_isolate_key_and_atoms():
    from cubridge.cuir.printer import expr
    from cubridge.lower.maskclass import atoms, isolate_key, substitute
    from cubridge.transfer.trace import trace_mask
    mask = trace_mask(lambda b, h, q, kv: ((kv <= q) & (q - kv < 256)) | (kv < 64) | (q < 64)).expr
    found = atoms(mask)
    assert [expr(a) for a in found] == ["ik <= iq", "iq - ik < 256", "ik < 64", "iq < 64"]
    assert expr(isolate_key(found[1])) == "ik > iq - 256"
    assert expr(isolate_key(trace_mask(lambda b, h, q, kv: kv - q < 7).expr)) == "ik < iq + 7"
    assert expr(isolate_key(found[0])) == "ik <= iq"                 # already alone: unchanged
    from cubridge.cuir import nodes as N
    assert expr(substitute(mask, [N.Const(True), N.Name("m1"), N.Const(False), N.Const(False)])) \
        == "True & m1 | False | False"
