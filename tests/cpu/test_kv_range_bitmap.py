"""The forward's generated iteration space of a block-table variant (cubridge.lower.itspace
bitmap_region), run on the host: the regions extra_io, kv_range and mask of the lowered kernel.cu
(fa3_sm90 and fa2_sm80) are compiled with g++ into a harness that, for every (batch, head, query
tile), expands kv_count / tile_at and checks against mask_pred pair by pair that
- the visited tiles are distinct, in range and in the kernel's order (fa3 highest first, fa2 lowest);
- every tile holding an attended pair (row < Nq, key < Nk) is visited;
- within the bitmap's window no empty tile is visited (tail == 0: visited iff attended); beyond it
  at most `tail` tiles are, the tail's;
- a tile tile_partial calls unmasked has every pair attended and every key below Nk.
Small tiles (16 x 16) at 2500 keys give 157 tiles, more than the 128-tile window, so the tail runs.
The VariantArgs (tables, block table) come from Candidate.bind at those tiles. No GPU."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower, regions
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
NAMES = {"fa3_sm90": ("kBlockM", "kBlockN", True), "fa2_sm80": ("BLOCK_M", "BLOCK_N", False)}

HARNESS = r"""
#include <cstdio>
#include <vector>
#define __device__
#define __forceinline__ inline
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __fmaf_rn(float a, float b, float c) { return a * b + c; }
constexpr int %(bm)s = %(block_m)d, %(bn)s = %(block_n)d;
constexpr bool kDescending = %(desc)s;
constexpr int kWgRows = 64;   // fa3_sm90: one consumer warpgroup's rows (the mask-class helpers read it)
%(regions)s
int main() {
  int B, H, Nq, Nk;
  if (scanf("%%d %%d %%d %%d", &B, &H, &Nq, &Nk) != 4) return 2;
  VariantArgs va{};
%(read)s
  const int shift = Nk - Nq, num_m = (Nq + %(bm)s - 1) / %(bm)s, num_n = (Nk + %(bn)s - 1) / %(bn)s;
  long errors = 0, tails = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int m = 0; m < num_m; ++m) {
        const KvRange r = kv_range(va, b, h, m, m * %(bm)s + shift, Nk, Nk);
        std::vector<int> seen(num_n, 0);
        int prev = kDescending ? num_n : -1, empty = 0;
        for (int i = 0; i < kv_count(r); ++i) {
          const int n = tile_at(r, i);
          if (n < 0 || n >= num_n || seen[n]++ || (kDescending ? n >= prev : n <= prev)) {
            printf("bad tile %%d (i %%d) b%%d h%%d m%%d\n", n, i, b, h, m); ++errors; break;
          }
          prev = n;
        }
        tails += r.tail > 0;
        for (int n = 0; n < num_n; ++n) {
          bool any = false, all = (n + 1) * %(bn)s <= Nk;
          for (int q = m * %(bm)s; q < (m + 1) * %(bm)s && q < Nq; ++q)
            for (int k = n * %(bn)s; k < (n + 1) * %(bn)s && k < Nk; ++k) {
              const bool a = mask_pred(va, b, h, q + shift, k);
              any |= a;
              all &= a;
            }
          if (any && !seen[n]) { printf("missed tile m%%d n%%d b%%d h%%d\n", m, n, b, h); ++errors; }
          if (seen[n] && !any) ++empty;
          if (seen[n] && !all && !tile_partial(va, r, n)) {
            printf("unmasked tile with a masked pair m%%d n%%d b%%d h%%d\n", m, n, b, h); ++errors;
          }
        }
        if (empty > r.tail) { printf("%%d empty tiles visited, tail %%d: m%%d b%%d h%%d\n", empty, r.tail, m, b, h); ++errors; }
        if (errors > 20) return 1;
      }
  printf("ok tails %%ld\n", tails);
  return errors ? 1 : 0;
}
"""


def _harness(kernel, ref: str, block_m: int, block_n: int) -> str:
    bm, bn, desc = NAMES[ref]
    text = "\n".join(regions.body(kernel.source, name) for name in ("extra_io", "kv_range", "mask"))
    text = text.replace('asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;', "return 0.f;")
    kinds = {n: t for n, t, _ in kernel.ir.tables}
    read = []
    for name, kind in kernel.fields:
        if kind == "ptr":
            ctype, fmt = ("int", "%d") if kinds[name] == "int" else ("float", "%f")
            read.append(f"  static std::vector<{ctype}> t_{name}; {{ long n; if (scanf(\"%ld\", &n) != 1) return 2; "
                        f"t_{name}.resize(n); for (auto& x : t_{name}) if (scanf(\"{fmt}\", &x) != 1) return 2; }} "
                        f"va.{name} = t_{name}.data();")
        else:
            read.append(f"  if (scanf(\"{'%d' if kind == 'int' else '%f'}\", &va.{name}) != 1) return 2;")
    return HARNESS % {"regions": text, "read": "\n".join(read), "bm": bm, "bn": bn, "block_m": block_m,
                      "block_n": block_n, "desc": "true" if desc else "false"}


def _inputs(kernel, inputs: dict, shape) -> str:
    B, H, Nq, Nk = shape
    out = [f"{B} {H} {Nq} {Nk}"]
    for name, kind in kernel.fields:
        if kind == "ptr":
            flat = inputs[name].flatten().tolist()
            out.append(f"{len(flat)} " + " ".join(repr(x) for x in flat))
        elif name in inputs:
            out.append(repr(inputs[name]))
        else:                                       # a table's size: name_n<d>
            table, dim = name.rsplit("_n", 1)
            out.append(str(inputs[table].shape[int(dim)]))
    return "\n".join(out) + "\n"


# (spec file or built-in, its parameters, block_m, block_n, (B, Hq, Hkv, Nq, Nk)):
# scattered 16-key blocks at 16 x 16 (157 tiles: the window's tail runs) and at 16 x 24 (blocks
# across tiles: partial tiles), fewer queries than keys; a per-(b, h) table; a built-in's table.
CASES = [
    ("bitpacked_blocks", {"block": 16}, 16, 16, (1, 1, 1, 2500, 2500)),
    ("bitpacked_blocks", {"block": 16, "density": 0.6}, 16, 24, (1, 1, 1, 700, 1500)),
    ("ag_head_mask", {"window": 24}, 16, 16, (2, 4, 2, 300, 300)),
    ("share_question", {}, 32, 16, (1, 2, 1, 600, 600)),
]


@pytest.mark.parametrize("ref", sorted(NAMES))
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}x{c[3]}" for c in CASES])
def test_bitmap_range_covers_the_mask(ref, case, tmp_path):
    name, params, block_m, block_n, (B, Hq, Hkv, Nq, Nk) = case
    path = CORPUS / f"{name}.py"
    spec = load_spec(str(path) if path.exists() else name)
    cand = transfer(parse_file(ref_kernel_dir(ref) / "kernel.cuir"), spec, spec_params=params)
    kernel = lower(cand.program, ref)
    assert kernel.ir.table and "int first, nbits, tail;" in kernel.source
    inputs = cand.bind(Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": block_m, "BLOCK_N": block_n})
    cpp, exe = tmp_path / "h.cpp", tmp_path / "h"
    cpp.write_text(_harness(kernel, ref, block_m, block_n))
    proc = subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.run([str(exe)], input=_inputs(kernel, inputs, (B, Hq, Nq, Nk)), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().startswith("ok"), f"{name} {ref}:\n{run.stdout[-2000:]}"
    if Nk // block_n > 128:       # the case meant to exceed the window did
        assert run.stdout.split()[-1] != "0", run.stdout
