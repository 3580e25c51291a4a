"""The Hopper backward's generated iteration space (cubridge.lower.fa3_bwd_sm90 q_range), run on
the host: the regions extra_io, q_range and mask_pred of each built-in variant's lowered kernel.cu
are compiled with g++ into a harness that, for every CTA (batch, kv head, 128-key tile), runs
q_scan, expands its runs and checks against mask_pred pair by pair, over every query head of the
kv head's GQA group, that
- every query tile holding an attended pair (row < Nq, key < Nk) of the tile is visited, once;
- a (consumer, query tile) step that q_step_partial calls unmasked has every pair of every head
  attended and every key below Nk (what lets the kernel skip the mask there).
The same for the exact list (q_list_range, CUBRIDGE_BWD_Q_LIST=1), at 32 listed tiles so that the
tail past the list runs too, and further: below the list's end a tile is listed iff it holds an
attended pair (no empty step), each step's stored mask flag equals the predicate's answer, and
listed steps plus tail = the count. Built-ins and the corpus's block-table specs.
The VariantArgs (scalars, tables, block table at 64 x 128) come from VariantBackward.launchable,
as a launch would pass them. No GPU."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cubridge.lower import regions
from cubridge.lower.fa3_bwd_sm90 import q_list_range
from cubridge.runtime.variant_bwd import VariantBackward

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")

BUILTINS = ["causal", "prefixlm", "causal_blockwise", "global_sliding_window", "share_question", "relative_pos",
            "sigmoid", "relu", "composite", "document"]
# (B, Hq, Hkv, Nq, Nk): ragged, GQA, fewer queries than keys (end-aligned), one short tile, more
# query tiles than one 32-lane ballot scans.
SHAPES = [(2, 4, 2, 700, 1300), (1, 2, 1, 1000, 1000), (1, 2, 2, 77, 300), (1, 1, 1, 1, 129), (1, 2, 1, 2200, 4200)]
CORPUS = Path(__file__).resolve().parents[1] / "corpus"
# The corpus's block-table specs (their masks read tensors), with parameters whose structure shows
# at these lengths: more runs per key tile than the 3 runs hold (bitpacked_blocks, documents).
CORPUS_TABLES = [("bitpacked_blocks", {"block": 64}), ("bitpacked_blocks", {"block": 64, "density": 0.6}),
                 ("ag_document_causal", {}), ("ag_document_sliding", {}), ("ag_head_mask", {"window": 100}),
                 ("packed_sequences", {})]
LIST_TILES = 32   # the list's length in the q_list cases: SHAPES' 2200 queries (35 tiles) reach its tail

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
#ifdef FA3B_Q_TILE_LIST
std::vector<int> scan_tiles(const VariantArgs& va, int b, int hk, int G, int n0, int Nq, int Nk) {
  q_scan(va, b, hk, G, n0, Nq, Nk, g_qruns);
  std::vector<int> t;
  for (int i = 0; i < q_runs_count(); ++i) t.push_back(q_runs_tile(i));
  if (g_qruns[1] > kQListTiles) { printf("listed %%d > %%d\n", g_qruns[1], kQListTiles); t.push_back(-1); }
  return t;
}
// Below the list's end a tile is listed iff it holds an attended pair (the predicates are exact
// at these shapes), and a listed step's stored flag is the predicate's answer.
int check_list_tile(int m, int n0, bool seen, bool any) {
  if (m >= kQListTiles || seen == any) return 0;
  printf("listed %%d != attended %%d: m %%d n0 %%d\n", seen, any, m, n0);
  return 1;
}
int check_list_flag(const VariantArgs& va, int b, int hk, int G, int n0, int kv_lo, int m, int Nq, int Nk, bool seen) {
  if (!seen || q_step_partial(va, b, hk, G, n0, kv_lo, m, Nq, Nk) == q_partial_at(va, b, hk, G, n0, kv_lo, m, Nq, Nk))
    return 0;
  printf("stored flag differs: m %%d kv_lo %%d\n", m, kv_lo);
  return 1;
}
#else
std::vector<int> scan_tiles(const VariantArgs& va, int b, int hk, int G, int n0, int Nq, int Nk) {
  int runs[1 + 2 * kQRuns] = {};
  q_scan(va, b, hk, G, n0, Nq, Nk, runs);
  std::vector<int> t;
  for (int k = 0; k < kQRuns; ++k)
    for (int i = 0; i < runs[2 + 2 * k]; ++i) t.push_back(runs[1 + 2 * k] + i);
  if ((int)t.size() != runs[0]) { printf("count %%d != %%d\n", runs[0], (int)t.size()); t.push_back(-1); }
  return t;
}
int check_list_tile(int, int, bool, bool) { return 0; }
int check_list_flag(const VariantArgs&, int, int, int, int, int, int, int, int, bool) { return 0; }
#endif
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
        std::vector<int> tiles = scan_tiles(va, b, hk, G, n0, Nq, Nk);
        std::vector<int> seen(num_m, 0);
        for (int m : tiles)
          if (m < 0 || m >= num_m || seen[m]++) {
            printf("bad tile %%d b%%d hkv%%d n0 %%d\n", m, b, hk, n0);
            ++errors;
          }
        for (int m = 0; m < num_m; ++m) {
          bool any_tile = false;
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
            errors += check_list_flag(va, b, hk, G, n0, kv_lo, m, Nq, Nk, seen[m] != 0);
            any_tile |= any;
            if (seen[m] && !all && !q_step_partial(va, b, hk, G, n0, kv_lo, m, Nq, Nk)) {
              printf("unmasked step with a masked pair: m %%d c %%d b%%d hkv%%d n0 %%d\n", m, c, b, hk, n0); ++errors;
            }
          }
          errors += check_list_tile(m, n0, seen[m] != 0, any_tile);
        }
        if (errors > 20) return 1;
      }
  printf("ok\n");
  return errors ? 1 : 0;
}
"""
_TANH_PTX = 'asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;'


def _harness(bwd: VariantBackward, q_list: bool = False) -> str:
    src = bwd.hopper.source
    parts = [regions.body(src, name) for name in ("extra_io", "q_range", "mask_pred")]
    if q_list:
        parts[1] = q_list_range(bwd.ir, LIST_TILES)
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


def _check(bwd: VariantBackward, q_list: bool, shapes, tmp_path, label: str) -> None:
    cpp, exe = tmp_path / "h.cpp", tmp_path / "h"
    cpp.write_text(_harness(bwd, q_list))
    proc = subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for shape in shapes:
        run = subprocess.run([str(exe)], input=_inputs(bwd, shape), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), f"{label} {shape}:\n{run.stdout[-2000:]}"


@pytest.mark.parametrize("q_list", [False, True], ids=["runs", "list"])
@pytest.mark.parametrize("name", BUILTINS)
def test_q_range_covers_the_mask(name, q_list, tmp_path):
    bwd = VariantBackward(name)
    assert "constexpr bool kRangeRuns = true;" in bwd.hopper.source
    _check(bwd, q_list, SHAPES, tmp_path, name)


@pytest.mark.parametrize("q_list", [False, True], ids=["runs", "list"])
@pytest.mark.parametrize("case", CORPUS_TABLES, ids=lambda c: c[0] + "".join(f"-{k}{v}" for k, v in c[1].items()))
def test_q_range_covers_corpus_tables(case, q_list, tmp_path):
    name, params = case
    bwd = VariantBackward(str(CORPUS / f"{name}.py"), **params)
    assert bwd.ir.table, f"{name} has no block table"
    _check(bwd, q_list, [(2, 4, 2, 700, 1300), (1, 2, 1, 2200, 2200)], tmp_path, name)


def test_q_list_knob(monkeypatch):
    """CUBRIDGE_BWD_Q_LIST picks the region (default: the runs); another value is a clear error."""
    from cubridge.errors import CubridgeError
    from cubridge.lower.fa3_bwd_sm90 import Q_LIST_ENV, lower_source
    from cubridge.runtime.fa3_bwd_sm90 import KERNEL_SOURCE
    ir, ref = VariantBackward("prefixlm").ir, KERNEL_SOURCE.read_text()
    monkeypatch.delenv(Q_LIST_ENV, raising=False)
    assert "FA3B_Q_TILE_LIST" not in regions.body(lower_source(ref, ir), "q_range")
    monkeypatch.setenv(Q_LIST_ENV, "1")
    assert "#define FA3B_Q_TILE_LIST" in lower_source(ref, ir)
    assert "#define FA3B_Q_TILE_LIST" not in lower_source(ref, ir, q_list=False)
    monkeypatch.setenv(Q_LIST_ENV, "yes")
    with pytest.raises(CubridgeError, match="CUBRIDGE_BWD_Q_LIST='yes'"):
        lower_source(ref, ir)
    with pytest.raises(CubridgeError, match="multiple of 32"):
        q_list_range(ir, 48)


def test_q_list_auto_picks_the_list_where_the_runs_are_not_exact(monkeypatch):
    """CUBRIDGE_BWD_Q_LIST=auto: the list's source only for a block table with more than 3 runs in a
    KV-tile column (bitpacked_blocks at 8k: its runs visit 3226 steps for 1356 attended), the runs'
    elsewhere; per-head tables count the union over a kv head's group."""
    from cubridge.lower.fa3_bwd_sm90 import Q_LIST_ENV, wants_q_list
    shape = (1, 2, 1, 8192, 8192, 128, torch.device("cpu"))
    monkeypatch.setenv(Q_LIST_ENV, "auto")
    picks = {name: "#define FA3B_Q_TILE_LIST" in VariantBackward(spec).launchable(*shape, hopper=True).source
             for name, spec in [("bitpacked", str(CORPUS / "bitpacked_blocks.py")), ("share_question", "share_question"),
                                ("prefixlm", "prefixlm"), ("document", "document")]}
    assert picks == {"bitpacked": True, "share_question": False, "prefixlm": False, "document": False}, picks
    monkeypatch.setenv(Q_LIST_ENV, "0")
    assert "#define FA3B_Q_TILE_LIST" not in VariantBackward(str(CORPUS / "bitpacked_blocks.py")).launchable(
        *shape, hopper=True).source
    col = torch.tensor([1, 0, 1, 0, 1, 0, 0, 0])[:, None]            # 3 runs: exact
    assert not wants_q_list(col, 1) and wants_q_list(torch.tensor([1, 0, 1, 0, 1, 0, 2, 0])[:, None], 1)
    a, b = torch.tensor([1, 0, 1, 0, 0, 0, 1, 0]), torch.tensor([0, 0, 0, 0, 1, 0, 0, 0])
    per_head = torch.stack([a, b])[None, :, :, None]                 # [B 1, H 2, M 8, N 1]: 3 runs each
    assert not wants_q_list(per_head, 1) and wants_q_list(per_head.clone(), 2)   # their union: 4 runs
