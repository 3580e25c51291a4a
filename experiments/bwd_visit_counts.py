"""How many (KV tile, query tile) steps the Hopper variant backward visits, against the steps that
hold an attended pair, and how many it runs masked (issue 17; ref_kernels/fa3_bwd_sm90/NOTES.md
"Session 12 (variant backward)"). Host only: the lowered kernel's regions extra_io, q_range and
mask_pred compiled with g++ (FA3B_HOST_SCAN, as tests/cpu/test_fa3_bwd_variant_range.py), one
(batch, kv head) = (0, 0), MHA, Nq = Nk = N. Per variant and N:
- visited: steps the scan schedules (per CTA: its count), summed over KV tiles;
- exact: query tiles whose tile predicate / block class says "may attend" (an exact list's count);
- attended: (KV tile, query tile) steps with an attended pair (brute force, pair by pair);
- masked: consumer half-steps (64 keys x 64 queries) q_step_partial sends down the masked path,
  against the visited half-steps that need it (some pair masked: partial or empty halves);
- max_steps / mean_steps: the CTA with the most steps vs the mean (load balance).
With CUBRIDGE_BWD_Q_LIST=1 the region is the exact list (cubridge.lower.fa3_bwd_sm90).

    PYTHONPATH=. python3 experiments/bwd_visit_counts.py [--n 8192] [--variants ...] [--out x.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cubridge.lower import regions
from cubridge.runtime.variant_bwd import VariantBackward

VARIANTS = ["causal", "prefixlm", "causal_blockwise", "global_sliding_window", "share_question", "relative_pos",
            "sigmoid", "relu", "composite", "document"]

HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#define FA3B_HOST_SCAN
#define __device__
#define __shared__
#define __forceinline__ inline
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
constexpr int kBlockM = 64, kBlockN = 128, kWgRows = 64;
%(regions)s
%(tiles)s
int main() {
  int B, Hq, Hkv, Nq, Nk;
  if (scanf("%%d %%d %%d %%d %%d", &B, &Hq, &Hkv, &Nq, &Nk) != 5) return 2;
  VariantArgs va{};
%(read)s
  const int shift = Nk - Nq, num_m = (Nq + kBlockM - 1) / kBlockM, G = Hq / Hkv;
  long visited = 0, exact = 0, attended = 0, masked = 0, partial = 0, ctas = 0, max_steps = 0;
  std::vector<long> per_cta;
  const int b = 0, hk = 0;
  for (int n0 = 0; n0 < Nk; n0 += kBlockN, ++ctas) {
    std::vector<int> tiles = scan_tiles(va, b, hk, G, n0, Nq, Nk);
    visited += (long)tiles.size();
    per_cta.push_back((long)tiles.size());
    if ((long)tiles.size() > max_steps) max_steps = (long)tiles.size();
    const QScan r{b, hk, G, n0 / kBlockN, n0, min(n0 + kBlockN, Nk) - 1, Nq, Nk, Nk - Nq};
    for (int m = 0; m < num_m; ++m) exact += q_tile_visit(va, r, m);
    std::vector<char> seen(num_m, 0);
    for (int m : tiles) seen[m] = 1;
    for (int m = 0; m < num_m; ++m) {
      bool any_tile = false;
      for (int c = 0; c < kBlockN / kWgRows; ++c) {
        const int kv_lo = n0 + c * kWgRows;
        bool any = false, all = true;
        for (int hq = hk * G; hq < hk * G + G; ++hq)
          for (int q = m * kBlockM; q < m * kBlockM + kBlockM && q < Nq; ++q)
            for (int j = kv_lo; j < kv_lo + kWgRows; ++j) {
              const bool att = j < Nk && mask_pred(va, b, hq, q + shift, j);
              any |= att;
              all &= att;
            }
        any_tile |= any;
        if (seen[m] && !all) ++partial;   // the mask is needed: a masked pair (or an empty half)
        if (seen[m] && q_step_partial(va, b, hk, G, n0, kv_lo, m, Nq, Nk)) ++masked;
        if (any && !seen[m]) { printf("missed tile\n"); return 1; }
      }
      attended += any_tile;
    }
  }
  printf("%%ld %%ld %%ld %%ld %%ld %%ld %%ld\n", visited, exact, attended, masked, partial, ctas, max_steps);
  for (long s : per_cta) printf("%%ld ", s);
  printf("\n");
  return 0;
}
"""

# The visited tiles of one CTA, in order: the runs (kRangeRuns, kernel.cu's q_runs_tile) or the list.
RUN_TILES = r"""
std::vector<int> scan_tiles(const VariantArgs& va, int b, int hk, int G, int n0, int Nq, int Nk) {
  int runs[1 + 2 * kQRuns] = {};
  q_scan(va, b, hk, G, n0, Nq, Nk, runs);
  std::vector<int> t;
  for (int k = 0; k < kQRuns; ++k)
    for (int i = 0; i < runs[2 + 2 * k]; ++i) t.push_back(runs[1 + 2 * k] + i);
  return t;
}
"""
LIST_TILES = r"""
std::vector<int> scan_tiles(const VariantArgs& va, int b, int hk, int G, int n0, int Nq, int Nk) {
  q_scan(va, b, hk, G, n0, Nq, Nk, g_qruns);
  std::vector<int> t;
  for (int i = 0; i < q_runs_count(); ++i) t.push_back(q_runs_tile(i));
  return t;
}
"""
_TANH_PTX = 'asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;'


def harness_source(bwd: VariantBackward, head: str) -> str:
    """`head` (C++ with the regions, main's prologue) filled with this variant's regions."""
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
    tiles = LIST_TILES if "#define FA3B_Q_TILE_LIST" in text else RUN_TILES
    return head % {"regions": text, "read": "\n".join(read), "tiles": tiles}


def harness_input(bwd: VariantBackward, shape) -> str:
    """The harness's stdin: the shape, then the VariantArgs a launch would pass, field by field."""
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


def build(bwd: VariantBackward, head: str, workdir: Path, tag: str) -> Path:
    cpp, exe = workdir / f"{tag}.cpp", workdir / tag
    cpp.write_text(harness_source(bwd, head))
    proc = subprocess.run(["g++", "-O2", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return exe


def count(name: str, n: int, workdir: Path) -> dict:
    bwd = VariantBackward(name)
    exe = build(bwd, HARNESS, workdir, Path(name).stem)
    run = subprocess.run([str(exe)], input=harness_input(bwd, (1, 1, 1, n, n)), capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{name} {n}: {run.stdout[-500:]}")
    head, steps = run.stdout.strip().split("\n")
    visited, exact, attended, masked, partial, ctas, max_steps = map(int, head.split())
    return {"variant": Path(name).stem, "n": n, "visited": visited, "exact": exact, "attended": attended,
            "masked_half_steps": masked, "partial_half_steps": partial, "ctas": ctas, "max_steps": max_steps,
            "mean_steps": round(visited / ctas, 1),
            "cta_steps": [int(x) for x in steps.split()], "waste": round(visited / max(attended, 1) - 1, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            for n in args.n:
                rows.append(count(name, n, Path(tmp)))
                r = rows[-1]
                print(f"{name:22s} {n:6d} visited {r['visited']:6d} exact {r['exact']:6d} attended {r['attended']:6d} "
                      f"waste {100 * r['waste']:5.1f}%  masked {r['masked_half_steps']:6d} / needed "
                      f"{r['partial_half_steps']:6d}  steps max {r['max_steps']} mean {r['mean_steps']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
