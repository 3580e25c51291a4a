"""The forward's arithmetic iteration space (cubridge/lower/rowrange.py, CUIR_ROW_RANGE 1), run on
the host: the regions extra_io, kv_range and mask of the lowered fa3_sm90 kernel.cu compiled with
g++ into a harness that, for every (batch, head, query tile), expands kv_count / tile_at and checks
against mask_pred pair by pair that
- the visited tiles are distinct, in range and highest first;
- every tile holding an attended pair (row < Nq, key < Nk) is visited, and no other (for these
  masks the rows' intervals overlap, so the range is exact);
- a tile tile_partial calls unmasked has every pair attended and every key below Nk.
Tiles from 16 x 16 to 32 x 24, fewer queries than keys, ragged lengths; windows, chunks, prefixes,
keys past the diagonal (fa_local_softcap) and a per-head choice of interval (ag_head_mask). The
analysis side (which masks qualify) is tests/cpu/test_rowint.py. No GPU."""
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

HARNESS = r"""
#include <cstdio>
#include <vector>
#define __device__
#define __forceinline__ inline
#define CUIR_ROW_RANGE 1
#define CUIR_TABLE_RANGE 1
#define EXACT %(exact)d
%(kind)s
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fmaf_rn(float a, float b, float c) { return a * b + c; }
static unsigned g_ballot[8];   // CUIR_FULL_BITS: the ballots of a warp's 32 lanes, taken in word order
static int g_call;
inline unsigned __ballot_sync(unsigned, bool) { return g_ballot[g_call++]; }
constexpr int kBlockM = %(block_m)d, kBlockN = %(block_n)d;
constexpr int kWgRows = 64;
%(regions)s
int main() {
  int B, H, Nq, Nk;
  if (scanf("%%d %%d %%d %%d", &B, &H, &Nq, &Nk) != 4) return 2;
  VariantArgs va{};
%(read)s
  const int shift = Nk - Nq, num_m = (Nq + kBlockM - 1) / kBlockM, num_n = (Nk + kBlockN - 1) / kBlockN;
  long errors = 0, visited = 0, r_only = 0, full_bits_full = 0, table_rows_tiles = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int m = 0; m < num_m; ++m) {
        KvRange r = kv_range(va, b, h, m, m * kBlockM + shift, Nk, Nk);
#if CUIR_FULL_BITS
        {  // the consumers' bitmap: full_bits_issue in each of a warp's 32 lanes, full_bits_take's ballots
          for (int w = 0; w < kFullWords; ++w) g_ballot[w] = 0;
          for (int lane = 0; lane < 32; ++lane) {
            int c[kFullWords];
            full_bits_issue(va, r, lane, c);
            for (int w = 0; w < kFullWords; ++w) g_ballot[w] |= unsigned(full_bits_pred(c[w])) << lane;
          }
          int unused[kFullWords] = {};
          g_call = 0;
          full_bits_take(r, unused);
        }
#endif
        if (kv_count(r) < 0) { printf("negative kv_count b%%d h%%d m%%d\n", b, h, m); return 1; }
        std::vector<int> seen(num_n, 0);
        int prev = num_n;
        for (int i = 0; i < kv_count(r); ++i) {
          const int n = tile_at(r, i);
          if (n < 0 || n >= num_n || seen[n]++ || n >= prev) {
            printf("bad tile %%d (i %%d) b%%d h%%d m%%d\n", n, i, b, h, m); ++errors; break;
          }
          prev = n;
          ++visited;
        }
        for (int n = 0; n < num_n; ++n) {
          bool any = false, all = (n + 1) * kBlockN <= Nk;
          for (int q = m * kBlockM; q < (m + 1) * kBlockM && q < Nq; ++q)
            for (int k = n * kBlockN; k < (n + 1) * kBlockN && k < Nk; ++k) {
              const bool a = mask_pred(va, b, h, q + shift, k);
              any |= a;
              all &= a;
            }
          if (EXACT ? any != bool(seen[n]) : any && !seen[n]) { printf("tile m%%d n%%d b%%d h%%d: attended %%d visited %%d\n", m, n, b, h, any, seen[n]); ++errors; }
          if (seen[n] && !all && !tile_partial(va, r, n)) {
            printf("unmasked tile with a masked pair m%%d n%%d b%%d h%%d\n", m, n, b, h); ++errors;
          }
#ifdef CUIR_TABLE_ROWS_HOOKS
          // kernel.cu's score_and_mask_x on every partial tile: R's row interval (the key bound applied) and X,
          // X taken as all-true on the tile r_only
          if (seen[n] && tile_partial(va, r, n)) {
            const bool x_all = n == r.r_only;
            table_rows_tiles += x_all;
            for (int q = m * kBlockM; q < (m + 1) * kBlockM && q < Nq; ++q)
              for (int k = n * kBlockN; k < (n + 1) * kBlockN; ++k) {
                const int qq = q + shift;
                const bool keep = ((!kTableRowLo) | (k >= row_key_lo(va, b, h, qq)))
                                  & (k < min(row_key_hi(va, b, h, qq), Nk)) & (x_all || x_pred(va, b, h, qq, k));
                if (keep != (k < Nk && mask_pred(va, b, h, qq, k))) {
                  printf("table rows m%%d n%%d b%%d h%%d q%%d k%%d x_all %%d\n", m, n, b, h, q, k, x_all); ++errors;
                  q = Nq; break;
                }
              }
          }
#endif
#if CUIR_FULL_BITS
          // the bit test is the class load's answer inside the bitmap, partial past it
          const bool past = n - r.full_begin >= 32 * kFullWords;   // past the bitmap: the class (table rows) or partial
          const bool want = n < r.full_begin || n >= r.full_end || (past && !CUIR_TABLE_ROWS)
                            || tile_class(va, r, n) != 2;
          if (seen[n] && tile_partial(va, r, n) != want) {
            printf("bitmap against the class m%%d n%%d b%%d h%%d\n", m, n, b, h); ++errors;
          }
          if (seen[n] && !tile_partial(va, r, n)) ++full_bits_full;
#endif
#ifdef CUIR_TABLE_KIND
          // knob table_kind: kind 0 = tile_partial false; kind 1 = the mask is R alone on the tile
          const int kind = seen[n] ? tile_mask_kind(va, r, n) : 0;
          if (seen[n] && (kind == 0) != !tile_partial(va, r, n)) {
            printf("kind %%d against tile_partial m%%d n%%d b%%d h%%d\n", kind, m, n, b, h); ++errors;
          }
          if (kind == 1) {
            ++r_only;
            for (int q = m * kBlockM; q < (m + 1) * kBlockM && q < Nq; ++q)
              for (int k = n * kBlockN; k < (n + 1) * kBlockN && k < Nk; ++k)
                if (mask_pred(va, b, h, q + shift, k) != table_r_pred(va, b, h, q + shift, k)) {
                  printf("kind 1 tile where X masks (m%%d n%%d b%%d h%%d q%%d k%%d)\n", m, n, b, h, q, k); ++errors;
                  q = Nq; break;
                }
          }
#endif
        }
        if (errors > 20) return 1;
      }
  printf("ok visited %%ld r_only %%ld full %%ld rows_only %%ld\n", visited, r_only, full_bits_full, table_rows_tiles);
  return errors ? 1 : 0;
}
"""


def _harness(kernel, block_m: int, block_n: int, exact: bool = True, table_kind: bool = False,
             mutate: tuple = ()) -> str:
    text = "\n".join(regions.body(kernel.source, name) for name in ("extra_io", "kv_range", "mask"))
    for old, new in mutate:
        assert old in text, old
        text = text.replace(old, new)
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
    return HARNESS % {"regions": text, "read": "\n".join(read), "block_m": block_m, "block_n": block_n,
                      "exact": int(exact), "kind": "#define CUIR_TABLE_KIND 1\n#define CUIR_CLASS_HEAD0 1" if table_kind else ""}


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


# (spec, its parameters, block_m, block_n, (B, Hq, Hkv, Nq, Nk))
CASES = [
    ("causal", {}, 16, 24, (1, 1, 1, 300, 430)),
    ("prefixlm", {"prefix": 100}, 16, 16, (1, 1, 1, 333, 333)),
    ("causal_blockwise", {"block": 40}, 32, 24, (1, 1, 1, 500, 500)),
    ("ag_prefix_lm", {"prefix": 70}, 32, 16, (1, 1, 1, 257, 400)),
    ("llama4_chunked", {"chunk": 96}, 16, 24, (1, 1, 1, 400, 400)),
    ("ag_sliding_window", {"window": 50}, 16, 24, (1, 1, 1, 300, 350)),
    ("mistral_sliding_window", {"window": 64}, 32, 16, (1, 1, 1, 400, 400)),
    ("fa_local_softcap", {"left": 40, "right": 20, "softcap": 30.0}, 16, 24, (1, 1, 1, 300, 300)),
    ("ag_head_mask", {"window": 24}, 16, 16, (2, 4, 2, 300, 300)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}x{c[3]}" for c in CASES])
def test_row_range_is_the_mask_s_tiles(case, tmp_path):
    _check_range(case, tmp_path, "#if CUIR_ROW_RANGE")


# Block-table masks R & X (cubridge/lower/tablerange.py, CUIR_TABLE_RANGE 1): exact where X keeps one
# run of tiles per query tile (padding, packed sequences, documents); share_question (other answers
# between the question and its own) and bitpacked_blocks (dropped blocks) visit empty tiles, masked.
TABLE_CASES = [
    ("padded_causal", {}, 16, 24, (3, 2, 1, 300, 300), True),
    ("padded_causal", {}, 32, 16, (8, 1, 1, 250, 400), True),
    ("packed_sequences", {}, 16, 16, (8, 2, 2, 320, 320), True),
    ("share_question", {}, 16, 24, (1, 1, 1, 300, 300), False),
    ("bitpacked_blocks", {}, 128, 128, (1, 1, 1, 1000, 1000), False),
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=[f"{c[0]}-{c[2]}x{c[3]}" for c in TABLE_CASES])
def test_table_range_visits_every_attended_tile(case, tmp_path):
    _check_range(case[:5], tmp_path, "#if CUIR_TABLE_RANGE", exact=case[5])


# Knobs table_kind and class_head0 (session 16): R's top tile is masked by R alone where the block table's class one
# query tile below says X keeps it whole; a key table only (padding), the other kinds never (r_only -1); the classes
# of a mask that reads no h come from head 0 (the (3, 2, ...) and (8, 2, 2, ...) cases have two heads).
@pytest.mark.parametrize("case", TABLE_CASES[:3] + [("padded_causal", {}, 16, 16, (8, 1, 1, 333, 333), True)],
                         ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}-{c[4][3]}")
def test_table_kind_r_alone_only_where_x_keeps_the_tile(case, tmp_path):
    out = _check_range(case[:5], tmp_path, "#if CUIR_TABLE_RANGE", exact=case[5], kind=True)
    r_only = int(out.split("r_only")[1].split()[0])
    # (queries end-aligned with 150 keys more, 32 x 16: the next query tile still cuts the diagonal tile)
    assert (r_only > 0) == (case[0] == "padded_causal" and case[4][3] == case[4][4]), out


# Rows that attend nothing: batch 1's keys are all padding, batch 2 keeps a third (the trim empties a
# range whose first top and bottom chunks overlap, and one that needs more round trips).
EMPTY_ROWS = '''"""Causal over a padded batch whose second sequence is all padding (a test mask)."""
import torch
from cubridge.spec import Hooks
PARAMS = {}


def _pad(n, device=None):
    pad = torch.ones(3, n, dtype=torch.bool)
    pad[1] = False
    pad[2, n // 3:] = False
    return pad.to(device)


def hooks(Nq, Nk, Hq, Hkv, device):
    pad = _pad(Nk, device)
    return Hooks(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & pad[b, kv_idx])


def reference(q, k, v):
    raise NotImplementedError("host harness only")
'''


@pytest.mark.parametrize("tiles", [(16, 16, 3, 200), (16, 8, 3, 700)], ids=lambda t: "x".join(map(str, t)))
def test_table_range_empties_rows_without_keys(tiles, tmp_path):
    block_m, block_n, B, N = tiles
    spec = tmp_path / "empty_rows.py"
    spec.write_text(EMPTY_ROWS)
    _check_range((str(spec), {}, block_m, block_n, (B, 1, 1, N, N)), tmp_path, "#if CUIR_TABLE_RANGE")


def _check_range(case, tmp_path, branch: str, exact: bool = True, kind: bool = False, mutate: tuple = (),
                 expect_ok: bool = True) -> str:
    name, params, block_m, block_n, (B, Hq, Hkv, Nq, Nk) = case
    path = CORPUS / f"{name}.py"
    spec = load_spec(str(path) if path.exists() else name)     # a built-in, a corpus stem or a path
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec, spec_params=params)
    kernel = lower(cand.program, "fa3_sm90")
    assert branch in kernel.source and "row_key_hi" in kernel.source
    inputs = cand.bind(Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": block_m, "BLOCK_N": block_n})
    cpp, exe = tmp_path / "h.cpp", tmp_path / "h"
    cpp.write_text(_harness(kernel, block_m, block_n, exact, kind, mutate))
    proc = subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.run([str(exe)], input=_inputs(kernel, inputs, (B, Hq, Nq, Nk)), capture_output=True,
                         text=True, timeout=120)
    ok = run.returncode == 0 and run.stdout.strip().startswith("ok")
    assert ok == expect_ok, f"{name} (expected {'ok' if expect_ok else 'a failure'}):\n{run.stdout[-2000:]}"
    return run.stdout


@pytest.mark.parametrize("name", ["global_sliding_window", "share_question", "tests/corpus/padded_causal.py",
                                  "tests/corpus/streaming_sinks.py"])
def test_masks_without_a_monotone_interval_keep_the_scan(name):
    """Two pieces, a query-dependent whole-row test, gathered keys: no arithmetic range."""
    root = Path(__file__).resolve().parents[2]
    spec = load_spec(str(root / name) if name.startswith("tests/") else name)
    kernel = lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program, "fa3_sm90")
    assert "CUIR_ROW_RANGE" not in kernel.source


@pytest.mark.parametrize("value, define", [("0", "0"), ("1", "1"), ("auto", "(HEAD_DIM == 128)")])
def test_env_sets_the_default(value, define, monkeypatch):
    from cubridge.lower.rowrange import ROW_RANGE_ENV
    monkeypatch.setenv(ROW_RANGE_ENV, value)
    kernel = lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), load_spec("causal")).program,
                   "fa3_sm90")
    assert f"#define CUIR_ROW_RANGE {define}\n" in kernel.source


def test_bad_env_value_names_the_variable(monkeypatch):
    from cubridge.errors import CubridgeError
    from cubridge.lower.rowrange import ROW_RANGE_ENV
    monkeypatch.setenv(ROW_RANGE_ENV, "yes")
    with pytest.raises(CubridgeError, match=ROW_RANGE_ENV):
        lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), load_spec("causal")).program, "fa3_sm90")


@pytest.mark.parametrize("value, name, define", [
    (None, "padded_causal", "(HEAD_DIM == 128)"), (None, "packed_sequences", "(HEAD_DIM == 128)"),
    (None, "share_question", "0"), ("auto", "bitpacked_blocks", "0"), ("1", "share_question", "1"),
    ("0", "padded_causal", "0")])
def test_table_range_env_and_kinds(value, name, define, monkeypatch):
    """The default, auto, takes key and document tables (padding, packed sequences: session 15 mid
    call) at head dim 128; 1 / 0 every qualifying mask / none."""
    from cubridge.lower.tablerange import TABLE_RANGE_ENV
    if value is None:
        monkeypatch.delenv(TABLE_RANGE_ENV, raising=False)
    else:
        monkeypatch.setenv(TABLE_RANGE_ENV, value)
    path = CORPUS / f"{name}.py"
    spec = load_spec(str(path) if path.exists() else name)
    kernel = lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program, "fa3_sm90")
    assert f"#define CUIR_TABLE_RANGE {define}\n" in kernel.source


def test_table_range_bad_env_value_names_the_variable(monkeypatch):
    from cubridge.errors import CubridgeError
    from cubridge.lower.tablerange import TABLE_RANGE_ENV
    spec = load_spec(str(CORPUS / "padded_causal.py"))
    monkeypatch.setenv(TABLE_RANGE_ENV, "yes")
    with pytest.raises(CubridgeError, match=TABLE_RANGE_ENV):
        lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program, "fa3_sm90")


@pytest.mark.parametrize("name, kind", [("padded_causal", "key"), ("packed_sequences", "doc"), ("document", "doc"),
                                        ("share_question", "other"), ("bitpacked_blocks", "other")])
def test_table_range_kind_of_the_table_factor(name, kind):
    from cubridge.lower.fa3_sm90 import _mask_names
    from cubridge.lower.hooks import c_tables
    from cubridge.lower.tablerange import table_rows
    from cubridge.lower.variant import extract
    path = CORPUS / f"{name}.py"
    spec = load_spec(str(path) if path.exists() else name)
    ir = extract(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program)
    assert table_rows(ir, _mask_names(ir), c_tables(ir))[1] == kind


@pytest.mark.parametrize("name, head0", [("tests/corpus/padded_causal.py", True), ("tests/corpus/packed_sequences.py", True),
                                         ("tests/corpus/ag_head_mask.py", False), ("share_question", False)])
def test_class_head0_only_for_per_head_tables_blind_to_h(name, head0, monkeypatch):
    """CUIR_CLASS_HEAD0 (off by default: the index is today's) is emitted where the block table is per (b, h) and
    the mask reads no h; ag_head_mask reads h, share_question's table is not per (b, h). CUBRIDGE_CLASS_HEAD0=1
    turns it on."""
    from cubridge.lower.cexpr import LowerError
    from cubridge.lower.itspace import HEAD0_ENV
    monkeypatch.delenv(HEAD0_ENV, raising=False)
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), load_spec(name), spec_params={})
    src = lower(cand.program, "fa3_sm90").source
    assert ("#define CUIR_CLASS_HEAD0 0" in src) == head0
    assert ("(CUIR_CLASS_HEAD0 ? 0 : r.h)" in src) == head0
    monkeypatch.setenv(HEAD0_ENV, "1")
    assert ("#define CUIR_CLASS_HEAD0 1" in lower(cand.program, "fa3_sm90").source) == head0
    if head0:
        monkeypatch.setenv(HEAD0_ENV, "yes")
        with pytest.raises(LowerError, match=HEAD0_ENV):
            lower(cand.program, "fa3_sm90")


# CUBRIDGE_FULL_BITS=1 (session 17, tablerange.py CUIR_FULL_BITS): the consumers' bitmap of class-2 tiles, read by a
# warp's 32 lanes (full_bits_issue) and balloted (full_bits_take): tile_partial is the class load's answer inside
# the bitmap's 32 * kFullWords tiles, past them the class (with CUIR_TABLE_ROWS) or partial; every visited tile
# checked against the mask pair by pair.
# Block 8 columns at 700 / 1200 keys: 88 / 150 tiles (every word, and tiles past the bitmap).
FULL_BITS_CASES = [
    ("padded_causal", {}, 16, 24, (3, 2, 1, 300, 300), True),
    ("padded_causal", {}, 32, 16, (8, 1, 1, 250, 400), True),
    ("padded_causal", {}, 16, 8, (3, 2, 1, 1200, 1200), True),
    ("packed_sequences", {}, 16, 8, (8, 2, 2, 700, 700), True),
    ("document", {}, 16, 8, (2, 2, 1, 900, 900), True),
]


@pytest.mark.parametrize("case", FULL_BITS_CASES, ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}-{c[4][3]}")
def test_full_bits_equal_the_class_load(case, tmp_path, monkeypatch):
    from cubridge.lower.tablerange import FULL_BITS_ENV
    monkeypatch.setenv(FULL_BITS_ENV, "1")
    out = _check_range(case[:5], tmp_path, "#define CUIR_FULL_BITS 1", exact=case[5])
    assert int(out.split(" full ")[1].split()[0]) > 0, out         # some tiles run unmasked through the bitmap


# Mutants that must fail: a partial class taken as full, a bit of the wrong word, a lane's tile off by one.
FULL_BITS_MUTANTS = [
    ("cls == 2; }", "cls != 0; }"),
    ("(j >> 5) == 1 ? r.full_bits1", "(j >> 5) == 1 ? r.full_bits2"),
    ("r.full_begin + 32 * w + lane", "r.full_begin + 32 * w + lane + 1"),
]


@pytest.mark.parametrize("mutant", FULL_BITS_MUTANTS, ids=["partial-as-full", "word", "lane"])
def test_full_bits_mutants_fail(mutant, tmp_path, monkeypatch):
    from cubridge.lower.tablerange import FULL_BITS_ENV
    monkeypatch.setenv(FULL_BITS_ENV, "1")
    _check_range(FULL_BITS_CASES[2][:5], tmp_path, "#define CUIR_FULL_BITS 1", mutate=(mutant,), expect_ok=False)


def test_full_bits_off_by_default_and_bad_value(monkeypatch):
    from cubridge.errors import CubridgeError
    from cubridge.lower.tablerange import FULL_BITS_ENV
    monkeypatch.delenv(FULL_BITS_ENV, raising=False)
    spec = load_spec(str(CORPUS / "padded_causal.py"))
    src = lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program, "fa3_sm90").source
    assert "#define CUIR_FULL_BITS 0\n" in src
    monkeypatch.setenv(FULL_BITS_ENV, "yes")
    with pytest.raises(CubridgeError, match=FULL_BITS_ENV):
        lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program, "fa3_sm90")


# CUBRIDGE_TABLE_ROWS=1 (session 17, tablerange.py CUIR_TABLE_ROWS; kernel.cu score_and_mask_x): every partial tile by
# R's row interval and X, X skipped on the tile r_only (R's top tile where the class one query tile below is 2: key
# tables only), checked pair by pair against mask_pred on every partial tile; with the bitmap too.
@pytest.mark.parametrize("full_bits", ["0", "1"])
@pytest.mark.parametrize("case", FULL_BITS_CASES + [("padded_causal", {}, 16, 16, (8, 1, 1, 333, 333), True)],
                         ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}-{c[4][3]}")
def test_table_rows_equal_the_mask(case, full_bits, tmp_path, monkeypatch):
    from cubridge.lower.tablerange import FULL_BITS_ENV, TABLE_ROWS_ENV
    monkeypatch.setenv(FULL_BITS_ENV, full_bits)
    monkeypatch.setenv(TABLE_ROWS_ENV, "1")
    out = _check_range(case[:5], tmp_path, "#define CUIR_TABLE_ROWS 1", exact=case[5])
    rows_only = int(out.split("rows_only")[1].split()[0])
    # R alone only on key tables (padding), and there on the diagonal tiles of full query tiles (Nq = Nk)
    assert (rows_only > 0) == (case[0] == "padded_causal" and case[4][3] == case[4][4]), out


# Mutants that must fail: a partial class below taken as keeping the tile; R's bound without the key bound.
TABLE_ROWS_MUTANTS = [
    ("tile_class(va, w, n_top) == 2", "tile_class(va, w, n_top) != 0"),
    ("w.m_block = r.m_block + 1;", "w.m_block = r.m_block + 1; if (r.b == 4) return n_top;"),
]


@pytest.mark.parametrize("mutant", TABLE_ROWS_MUTANTS, ids=["class-below", "b4-always"])
def test_table_rows_mutants_fail(mutant, tmp_path, monkeypatch):
    from cubridge.lower.tablerange import TABLE_ROWS_ENV
    monkeypatch.setenv(TABLE_ROWS_ENV, "1")
    _check_range(("padded_causal", {}, 16, 16, (8, 1, 1, 333, 333)), tmp_path, "#define CUIR_TABLE_ROWS 1",
                 mutate=(mutant,), expect_ok=False)
