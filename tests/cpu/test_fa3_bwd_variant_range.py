"""The Hopper backward's generated iteration space (cubridge.lower.fa3_bwd_sm90 q_range), run on
the host: the regions extra_io, q_range and mask_pred of each built-in variant's lowered kernel.cu
are compiled with g++ into a harness that, for every CTA (batch, kv head, 128-key tile), runs
q_scan, expands its runs and checks against mask_pred pair by pair, over every query head of the
kv head's GQA group, that
- every query tile holding an attended pair (row < Nq, key < Nk) of the tile is visited, once;
- a (consumer, query tile) step that q_step_partial calls unmasked has every pair of every head
  attended and every key below Nk (what lets the kernel skip the mask there).
The VariantArgs (scalars, tables, block table at 64 x 128) come from VariantBackward.launchable,
as a launch would pass them. No GPU."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from cubridge.lower import regions
from cubridge.runtime.variant_bwd import VariantBackward

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")

BUILTINS = ["causal", "prefixlm", "causal_blockwise", "global_sliding_window", "share_question", "relative_pos",
            "sigmoid", "relu", "composite", "document"]
# (B, Hq, Hkv, Nq, Nk): ragged, GQA, fewer queries than keys (end-aligned), one short tile, more
# query tiles than one 32-lane ballot scans.
SHAPES = [(2, 4, 2, 700, 1300), (1, 2, 1, 1000, 1000), (1, 2, 2, 77, 300), (1, 1, 1, 1, 129), (1, 2, 1, 2200, 4200)]

HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#define FA3B_HOST_SCAN
#define __device__
#define __forceinline__ inline
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
constexpr int kBlockM = 64, kBlockN = 128, kWgRows = 64;
%(regions)s
int main() {
  int B, Hq, Hkv, Nq, Nk;
  if (scanf("%%d %%d %%d %%d %%d", &B, &Hq, &Hkv, &Nq, &Nk) != 5) return 2;
  VariantArgs va{};
%(read)s
  const int shift = Nk - Nq, num_m = (Nq + kBlockM - 1) / kBlockM, G = Hq / Hkv;
  long errors = 0;
  for (int b = 0; b < B; ++b)
    for (int hk = 0; hk < Hkv; ++hk)
      for (int n0 = 0; n0 < Nk; n0 += kBlockN) {
        int runs[1 + 2 * kQRuns] = {};
        q_scan(va, b, hk, G, n0, Nq, Nk, runs);
        std::vector<int> seen(num_m, 0);
        int count = 0;
        for (int k = 0; k < kQRuns; ++k)
          for (int i = 0; i < runs[2 + 2 * k]; ++i, ++count) {
            const int m = runs[1 + 2 * k] + i;
            if (m < 0 || m >= num_m || seen[m]++) {
              printf("bad tile %%d b%%d hkv%%d n0 %%d\n", m, b, hk, n0);
              ++errors;
            }
          }
        if (count != runs[0]) { printf("count %%d != %%d\n", runs[0], count); ++errors; }
        for (int m = 0; m < num_m; ++m)
          for (int c = 0; c < kBlockN / kWgRows; ++c) {
            const int kv_lo = n0 + c * kWgRows;
            bool any = false, all = true;
            for (int hq = hk * G; hq < hk * G + G; ++hq)
              for (int r = m * kBlockM; r < m * kBlockM + kBlockM && r < Nq; ++r)
                for (int j = kv_lo; j < kv_lo + kWgRows; ++j) {
                  const bool att = j < Nk && mask_pred(va, b, hq, r + shift, j);
                  any |= att;
                  all &= att;
                }
            if (any && !seen[m]) { printf("missed tile m %%d b%%d hkv%%d n0 %%d\n", m, b, hk, n0); ++errors; }
            if (seen[m] && !all && !q_step_partial(va, b, hk, G, n0, kv_lo, m, Nq, Nk)) {
              printf("unmasked step with a masked pair: m %%d c %%d b%%d hkv%%d n0 %%d\n", m, c, b, hk, n0); ++errors;
            }
          }
        if (errors > 20) return 1;
      }
  printf("ok\n");
  return errors ? 1 : 0;
}
"""
_TANH_PTX = 'asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;'


def _harness(bwd: VariantBackward) -> str:
    src = bwd.hopper.source
    parts = [regions.body(src, name) for name in ("extra_io", "q_range", "mask_pred")]
    text = "\n".join(parts).replace(_TANH_PTX, "y = std::tanh(x); return y;")
    read = []
    for name, kind in bwd.hopper.fields:
        if kind == "ptr":
            ctype = "int" if dict((n, t) for n, t, _ in bwd.ir.tables)[name] == "int" else "float"
            fmt = "%d" if ctype == "int" else "%f"
            read.append(f"  static std::vector<{ctype}> t_{name}; {{ long n; if (scanf(\"%ld\", &n) != 1) return 2; "
                        f"t_{name}.resize(n); for (auto& x : t_{name}) if (scanf(\"{fmt}\", &x) != 1) return 2; }} "
                        f"va.{name} = t_{name}.data();")
        else:
            fmt = "%d" if kind == "int" else "%f"
            read.append(f"  if (scanf(\"{fmt}\", &va.{name}) != 1) return 2;")
    return HARNESS % {"regions": text, "read": "\n".join(read)}


def _inputs(bwd: VariantBackward, shape) -> str:
    B, Hq, Hkv, Nq, Nk = shape
    la = bwd.launchable(B, Hq, Hkv, Nq, Nk, 128, torch.device("cpu"), hopper=True)
    tensors = dict(zip([n for n, _, _ in bwd.ir.tables], la.keep_alive))
    out = [f"{B} {Hq} {Hkv} {Nq} {Nk}"]
    for name, kind in bwd.hopper.fields:
        if kind == "ptr":
            flat = tensors[name].flatten().tolist()
            out.append(f"{len(flat)} " + " ".join(repr(x) for x in flat))
        else:
            out.append(repr(getattr(la.args, name)))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("name", BUILTINS)
def test_q_range_covers_the_mask(name, tmp_path):
    bwd = VariantBackward(name)
    assert "constexpr bool kRangeRuns = true;" in bwd.hopper.source
    cpp, exe = tmp_path / "h.cpp", tmp_path / "h"
    cpp.write_text(_harness(bwd))
    proc = subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for shape in SHAPES:
        run = subprocess.run([str(exe)], input=_inputs(bwd, shape), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), f"{name} {shape}:\n{run.stdout[-2000:]}"
