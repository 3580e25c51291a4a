"""The arithmetic KV range for a block-table mask with an index-only factor (fa3_sm90, knob table_range).

A mask `R & X` whose factor R reads only the query / key indices (and scalars) and keeps one
interval [lo(q), hi(q)) per row with both bounds nondecreasing in q (rowint.row_range: causal,
windows, prefixes), X reading captured tables (padded_causal's `pad[b, kv]`, packed_sequences'
`ids[b, q] == ids[b, kv]`), gets R's range (rowrange.py: a query tile attends keys in
[lo(q_lo), hi(q_hi)) only) trimmed at both ends by the block table, kScanChunk classes per end
and round trip, the first round trip reading both ends' chunks. Every tile in between is visited;
a tile is unmasked only where R's range says so and the table's class is full (2).

Why: the block-table scan (itspace.bitmap_region) reads every tile's class below the diagonal in
chunks of 8 (8 dependent round trips for the longest query tile at 8k / 128) and hands 15 ints over
through shared memory, under a 56 / 224 register split; session 14 measured what replacing such
a scan by the arithmetic range gains on the one table mask that lost it, ag_head_mask: 0.820 ->
0.945 of our dense causal (+15%, cubridge/lower/NOTES.md). Here the trim reads one round trip for a
row with a nonempty tile at each end of R's range (every row of a full sequence), two for a
right-padded row past its length.

Exact (the visited tiles are those holding an attended pair) where X keeps, per query tile, one
run of tiles: padding (a prefix of keys per batch), contiguous documents. Interior holes (a table
that drops a middle block of keys: share_question's other answers, bitpacked_blocks) are visited
as partial tiles with every pair masked: correct, slower than the bitmap. So the default (auto)
takes it only for the kinds of X in AUTO_KINDS (a key table: padding; document ids: packed
sequences), at head dim 128 (measured there); CUBRIDGE_TABLE_RANGE=1
takes it for every qualifying mask, 0 for none; the knob experiments/patches/knobs/table_range.patch
sets it in a lowered source (variant_tiles.py CONFIG+table_range).
"""
from __future__ import annotations

import os

from cubridge.cuir import nodes as N
from cubridge.errors import env_switch
from cubridge.lower import rowint
from cubridge.lower.cexpr import LowerError, to_c
from cubridge.lower.hooks import c_names, c_tables
from cubridge.lower.itspace import Target, predicates
from cubridge.lower.rowint import Rows
from cubridge.lower.variant import VariantIR

TABLE_RANGE_ENV = "CUBRIDGE_TABLE_RANGE"
# Session 15 mid call (H100, variant_tiles, 8k, MHA 32 heads, B 2, 128 x 128, every check passed; x = Flex-FLASH ms /
# ours in the same run): padded_causal 0.954 -> 1.008 (+5.8%), packed_sequences 0.985 -> 1.065 (+8.2%);
# tests/gpu/test_table_range.py 16 passed. auto: key and document tables (AUTO_KINDS) at head dim 128.
TABLE_RANGE_DEFAULT = "auto"
SCAN_CHUNK = 8
# Session 17 (pad17): the consumers' full-tile bitmap (CUIR_FULL_BITS; knob full_bits, CUBRIDGE_FULL_BITS=1). Each
# consumer warp reads the work tile's block classes over [full_begin, full_begin + 32 * FULL_WORDS) in one round trip
# (lane l: tiles full_begin + l + 32 w) at the tile's start and ballots them into FULL_WORDS words of "class 2" bits;
# tile_partial is then a bit test, no global load per KV tile (session 16 mid call: that load cost padded_full 1.7%).
# The producer prefetches the row's middle line into L2 when it computes the range. Tiles past the bitmap: the
# class load with CUIR_TABLE_ROWS, else masked as partial (exact).
FULL_BITS_ENV = "CUBRIDGE_FULL_BITS"
FULL_BITS_DEFAULT = "0"
# Session 17 (pad17): partial tiles in one pass, R's row interval (kMaskRows' compare pair) and X's column bits
# (CUIR_TABLE_ROWS; CUBRIDGE_TABLE_ROWS=1): each thread evaluates X for its 32 columns and two rows into two words
# once per partial tile, skipped on the tile R cuts and X keeps whole (r_only: R's top tile where the class one
# query tile below is 2, key tables only, read in the trim's first round trip): there R alone, no table read.
TABLE_ROWS_ENV = "CUBRIDGE_TABLE_ROWS"
TABLE_ROWS_DEFAULT = "0"
FULL_WORDS = 4          # 128 KV tiles: a whole 16k row at BLOCK_N 128 (past it: see tile_partial)


def _conjuncts(e) -> list:
    """The factors of a top-level conjunction (`a & b`, `a and b`), nested ones flattened."""
    if isinstance(e, N.BinOp) and e.op == "&":
        return _conjuncts(e.left) + _conjuncts(e.right)
    if isinstance(e, N.BoolOp) and e.op == "and":
        return [x for v in e.values for x in _conjuncts(v)]
    return [e]


def _reads_table(e) -> bool:
    return any(isinstance(x, N.Call) and x.op == "gather" for x in N.walk_expr(e))


def split(mask) -> tuple | None:
    """(R, X): the mask's index-only factors and its table-reading ones (each conjoined), or None
    where either is missing."""
    if mask is None:
        return None
    parts = _conjuncts(mask)
    index = [p for p in parts if not _reads_table(p)]
    table = [p for p in parts if _reads_table(p)]
    if not index or not table:
        return None
    conj = lambda ps: ps[0] if len(ps) == 1 else N.BoolOp("and", tuple(ps))  # noqa: E731
    return conj(index), conj(table)


# What X is (table_rows): "key" reads no query index (a key table: padding), "doc" is one equality
# of two table reads, one at the query index and one at the key (document / packed-sequence ids:
# holes only where a document is split), "other" anything else (share_question, bitpacked_blocks:
# holes by design, they keep the bitmap scan).
AUTO_KINDS = ("key", "doc")


def _kind(x) -> str:
    if not rowint.reads_index(x, rowint.QUERY):
        return "key"
    sides = (x.left, x.right) if isinstance(x, N.Compare) and x.op == "==" else ()
    if (sides and all(isinstance(s, N.Call) and s.op == "gather" for s in sides)
            and {rowint.reads_index(s, rowint.QUERY) for s in sides} == {True, False}
            and {rowint.reads_index(s) for s in sides} == {True, False}):
        return "doc"
    return "other"


def table_rows(ir: VariantIR, names: dict, tables: dict) -> tuple[Rows, str] | None:
    """(R's monotone row interval, X's kind: key / doc / other) for a block-table variant of the
    form R & X, else None."""
    if not ir.table:
        return None
    parts = split(ir.mask)
    if parts is None:
        return None
    rows = rowint.row_range(parts[0], names, tables)
    if rows is None:
        return None
    return rows, _kind(parts[1])


def define(kind: str) -> str:
    """CUIR_TABLE_RANGE's default in the generated source: 1 / 0, or auto (X of a kind in
    AUTO_KINDS, head dim 128)."""
    value = os.environ.get(TABLE_RANGE_ENV, TABLE_RANGE_DEFAULT)
    if value not in ("0", "1", "auto"):
        raise LowerError(f"{TABLE_RANGE_ENV}={value!r} is neither 0, 1 nor auto",
                         hint=f"unset {TABLE_RANGE_ENV} (default {TABLE_RANGE_DEFAULT}) or set it to 0 / 1 / auto")
    if value == "auto":
        return "(HEAD_DIM == 128)" if kind in AUTO_KINDS else "0"
    return value


def full_bits_define() -> str:
    """CUIR_FULL_BITS's default in the generated source (CUBRIDGE_FULL_BITS, default FULL_BITS_DEFAULT)."""
    on = env_switch(FULL_BITS_ENV, FULL_BITS_DEFAULT,
                    f"unset {FULL_BITS_ENV} (default {FULL_BITS_DEFAULT}) or set it to 0 / 1", LowerError)
    return (f"#ifndef CUIR_FULL_BITS   // 1: the consumers' full-tile bitmap (lower/tablerange.py)\n"
            f"#define CUIR_FULL_BITS {int(on)}\n#endif\n")


def table_rows_define() -> str:
    """CUIR_TABLE_ROWS's default in the generated source (CUBRIDGE_TABLE_ROWS, default TABLE_ROWS_DEFAULT)."""
    on = env_switch(TABLE_ROWS_ENV, TABLE_ROWS_DEFAULT,
                    f"unset {TABLE_ROWS_ENV} (default {TABLE_ROWS_DEFAULT}) or set it to 0 / 1", LowerError)
    return (f"#ifndef CUIR_TABLE_ROWS   // 1: partial tiles by R's rows and X's column bits (lower/tablerange.py)\n"
            f"#define CUIR_TABLE_ROWS {int(on)}\n#endif\n")


def table_rows_fns(ir: VariantIR, rows: Rows) -> str:
    """x_pred (the table factor X alone) and kTableRowLo (R has a lower bound) for kernel.cu's score_and_mask_x."""
    x = split(ir.mask)[1]
    names = c_names(ir, {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int"), "b": ("b", "int"), "h": ("h", "int")})
    return f"""\
#if CUIR_TABLE_ROWS && BLOCK_N <= 128   // (a thread's columns of a tile in 32 bits; wider tiles keep mask_pred)
#define CUIR_TABLE_ROWS_HOOKS 1   // kernel.cu's score_and_mask_x (consumer.cuh: every partial tile)
constexpr bool kTableRowLo = {"true" if rows.lo else "false"};   // R bounds its keys from below
__device__ __forceinline__ bool x_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx) {{
  return {to_c(x, names, c_tables(ir))};
}}
#endif
"""


def region(ir: VariantIR, t: Target, rows: Rows, kind: str, scan: str) -> str:
    """The kv_range region with both ranges: the trimmed arithmetic one where CUIR_TABLE_RANGE is 1,
    `scan` (the bitmap region) otherwise."""
    return (f"#ifndef CUIR_TABLE_RANGE   // 1: R's range trimmed by the block table (cubridge/lower/tablerange.py)\n"
            f"#define CUIR_TABLE_RANGE {define(kind)}\n#endif\n#if CUIR_TABLE_RANGE\n"
            + trimmed(ir, t, rows, kind) + "#else\n" + scan + "#endif\n")


def mask_kind(t: Target, kind: str) -> str:
    """r_only_tile (computed in kv_range's first round trip) and tile_mask_kind (both used by the knob
    table_kind only; dead code otherwise). tile_mask_kind: 0 a tile without a mask, 1 a tile R cuts but X
    keeps whole (masked by R alone: table_r_pred, no table read per element), 2 the whole mask. The one
    such tile is R's top tile (causal: the diagonal) where the block table's class one query tile below
    is full: R & X keep every pair there, so X keeps every key of the tile, and where X reads no query
    index (kind "key") it keeps them for this query tile's rows too; other kinds have none (-1)."""
    bm, lq = t.block_m, t.len_q
    if kind != "key":
        only = "  return -1;"
    else:       # class 2 there: R & X keep every pair of the tile's valid rows, so X keeps all its keys
        only = f"""\
  if (n_top < r.full_end || n_top < r.n_begin || r.q_lo + {bm} >= r.{lq}) return -1;   // R keeps it / none below
  KvRange w = r;                                   // the next query tile down
  w.{t.q_tile} = r.{t.q_tile} + 1;
  return tile_class(va, w, n_top) == 2 ? n_top : -1;"""
    return f"""\
#ifdef CUIR_R_ONLY
__device__ __forceinline__ int r_only_tile(const VariantArgs& va, const KvRange& r, int n_top) {{
{only}
}}
#endif
"""


def mask_kind_fn() -> str:
    return """\
#ifdef CUIR_TABLE_KIND
__device__ __forceinline__ int tile_mask_kind(const VariantArgs& va, const KvRange& r, int n) {
  if (n >= r.full_begin && n < r.full_end) return tile_class(va, r, n) != 2 ? 2 : 0;
  return n == r.r_only ? 1 : 2;
}
#endif
"""


def trimmed(ir: VariantIR, t: Target, rows: Rows, kind: str = "other") -> str:
    cls, may, must, _ = predicates(ir, t)
    bm, bn, lk, lq = t.block_m, t.block_n, t.len_k, t.len_q
    # the bitmap's words as scalar fields (an array member put the whole TileMsg on the stack: 80 bytes)
    words = ", ".join(f"full_bits{w}" for w in range(FULL_WORDS))
    zero = " ".join(f"r.full_bits{w} = 0u;" for w in range(FULL_WORDS))
    select = "r.full_bits0"
    for w in range(1, FULL_WORDS):
        select = f"((j >> 5) == {w} ? r.full_bits{w} : {select})"
    take = "\n  ".join(f"r.full_bits{w} = __ballot_sync(0xffffffffu, full_bits_pred(cls[{w}]));"
                        for w in range(FULL_WORDS))
    lo = rows.lo or "-(1 << 30)"
    hi = rows.hi or "(1 << 30)"
    return full_bits_define() + table_rows_define() + f"""\
#if CUIR_TABLE_ROWS || defined(CUIR_TABLE_KIND)
#define CUIR_R_ONLY 1   // r_only: the tile R cuts and X keeps whole
#endif
#if CUIR_FULL_BITS
#define CUIR_FULL_BITS_HOOKS 1   // kernel.cu's producer and consumer.cuh call the full_bits_* functions below
constexpr int kFullWords = {FULL_WORDS};
#endif
// Generated by cubridge.lower (tablerange.py): the mask is R & X, R's row q keeps the keys
// [row_key_lo(q), row_key_hi(q)), both nondecreasing in q, X reads a table. Query rows [q_lo, q_hi]
// visit the KV tiles over [lo(q_lo), hi(q_hi)) less the empty tiles (block table class 0) at both
// ends, highest first; a tile needs no mask inside [lo(q_hi), hi(q_lo)) where its class is 2.
// Computed once per work tile by the producer (the trim reads the table) and handed over.
struct KvRange {{
  int b, h, {t.q_tile}, q_lo, q_hi, {lq}, {lk};
  int n_begin, n_end, full_begin, full_end;
#ifdef CUIR_R_ONLY
  int r_only;       // the tile R cuts and X keeps whole (knob table_kind, CUIR_TABLE_ROWS), else -1
#endif
#if CUIR_FULL_BITS
  unsigned {words};   // bit j of word w: tile full_begin + 32 w + j has class 2 (set by the consumers)
#endif
}};
constexpr bool kRangeViaSmem = true;
// The trim's two chunks of classes fit the 40-register producer (so the consumers keep 232 and the
// uniform warpgroup index): nvcc 13.0, 128 x 128, padded_causal 0 bytes spilled (S2R 30 -> 4 against
// 56 / 224), packed_sequences 4 (6 with 56 / 224, and with the scan).
constexpr bool kProducerReadsTable = false;
__device__ __forceinline__ int row_key_lo(const VariantArgs& va, int b, int h, int q_idx) {{
  return {lo};
}}
__device__ __forceinline__ int row_key_hi(const VariantArgs& va, int b, int h, int q_idx) {{
  return {hi};
}}
// A tile's class in the variant's block table (0 empty, 1 partial, 2 full).
__device__ __forceinline__ int tile_class(const VariantArgs& va, const KvRange& r, int n) {{
  return {cls};
}}
__device__ __forceinline__ bool tile_may(const VariantArgs& va, const KvRange& r, int n, int k_lo, int k_hi,
                                         int cls) {{
  return {may};
}}
__device__ __forceinline__ bool tile_must(const VariantArgs& va, const KvRange& r, int n, int k_lo, int k_hi) {{
  return {must};
}}
constexpr int kScanChunk = {SCAN_CHUNK};
""" + mask_kind(t, kind) + table_rows_fns(ir, rows) + f"""\
// Experiment hooks (off: no code), set by experiments/patches/knobs/table_diag_*.patch: CUIR_TABLE_NOTRIM
// (R's range untrimmed), CUIR_TABLE_NOCLASS (tile_partial from R's range only, no class read), and the
// knob table_diag_nox's kernel.cu hunk (partial tiles masked by R alone, table_r_pred). Each is exact only
// where X keeps every key of R's range (a table without padding: experiments/specs/padded_full.py): they
// measure what the table costs, they are not a product path.
#ifndef CUIR_TABLE_NOTRIM
#define CUIR_TABLE_NOTRIM 0
#endif
#ifndef CUIR_TABLE_NOCLASS
#define CUIR_TABLE_NOCLASS 0
#endif
__device__ __forceinline__ bool table_r_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx) {{
  return (kv_idx >= row_key_lo(va, b, h, q_idx)) & (kv_idx < row_key_hi(va, b, h, q_idx));
}}
__device__ __forceinline__ KvRange kv_range(const VariantArgs& va, int b, int h, int {t.q_tile}, int {t.q_begin},
                                            int {lq}, int {lk}) {{
  KvRange r;
  r.b = b; r.h = h; r.{t.q_tile} = {t.q_tile}; r.{lq} = {lq}; r.{lk} = {lk};
  r.q_lo = {t.q_begin};
  r.q_hi = min({t.q_begin} + {bm}, {lq}) - 1;
  const int lo = max(row_key_lo(va, b, h, r.q_lo), 0), hi = min(row_key_hi(va, b, h, r.q_hi), {lk});
  r.n_begin = lo / {bn};
  r.n_end = hi > lo ? (hi + {bn} - 1) / {bn} : r.n_begin;
  const int full_lo = max(row_key_lo(va, b, h, r.q_hi), 0), full_hi = min(row_key_hi(va, b, h, r.q_lo), {lk});
  r.full_begin = (full_lo + {bn} - 1) / {bn};
  r.full_end = max(full_hi, 0) / {bn};            // whole tiles below both hi(q_lo) and the key bound
#ifdef CUIR_R_ONLY
  r.r_only = -1;
#endif
#if CUIR_FULL_BITS
  {zero}
#endif
  if (CUIR_TABLE_NOTRIM) return r;
  // Trim the empty tiles at both ends, kScanChunk classes per end and round trip; the first round
  // trip reads the top and the bottom chunk together (a row with no empty end tile needs no more).
  const int t0 = max(r.n_end - kScanChunk, r.n_begin), b1 = min(r.n_begin + kScanChunk, r.n_end);
  int top_cls[kScanChunk], bottom_cls[kScanChunk];
#pragma unroll
  for (int j = 0; j < kScanChunk; ++j) {{
    top_cls[j] = t0 + j < r.n_end ? tile_class(va, r, t0 + j) : 0;
    bottom_cls[j] = r.n_begin + j < b1 ? tile_class(va, r, r.n_begin + j) : 0;
  }}
  int top = t0, bottom = b1;   // one past the highest nonempty tile of the top chunk; the lowest of the bottom one
#pragma unroll
  for (int j = 0; j < kScanChunk; ++j) top = top_cls[j] != 0 ? t0 + j + 1 : top;
#pragma unroll
  for (int j = kScanChunk - 1; j >= 0; --j) bottom = bottom_cls[j] != 0 ? r.n_begin + j : bottom;
  const bool top_found = top > t0, bottom_found = bottom < b1;
  // A nonempty tile found at one end lies outside the other end's empty chunk: the order holds.
#ifdef CUIR_R_ONLY
  r.r_only = r_only_tile(va, r, r.n_end - 1);   // (read with the first round trip: independent of it)
#endif
  r.n_end = top;
  r.n_begin = bottom;
  while (!top_found && r.n_end > r.n_begin) {{
    const int n0 = max(r.n_end - kScanChunk, r.n_begin);
    int cls[kScanChunk];
#pragma unroll
    for (int j = 0; j < kScanChunk; ++j) cls[j] = n0 + j < r.n_end ? tile_class(va, r, n0 + j) : 0;
    int hi = n0;
#pragma unroll
    for (int j = 0; j < kScanChunk; ++j) hi = cls[j] != 0 ? n0 + j + 1 : hi;
    r.n_end = hi;
    if (hi > n0) break;
  }}
  while (!bottom_found && r.n_begin < r.n_end) {{
    const int n1 = min(r.n_begin + kScanChunk, r.n_end);
    int cls[kScanChunk];
#pragma unroll
    for (int j = 0; j < kScanChunk; ++j) cls[j] = r.n_begin + j < n1 ? tile_class(va, r, r.n_begin + j) : 0;
    int lo = n1;
#pragma unroll
    for (int j = kScanChunk - 1; j >= 0; --j) lo = cls[j] != 0 ? r.n_begin + j : lo;
    const bool found = lo < n1;
    r.n_begin = lo;
    if (found) break;
  }}
  r.n_begin = min(r.n_begin, r.n_end);            // both first chunks empty and overlapping: nothing to visit
  return r;
}}
__device__ __forceinline__ int kv_count(const KvRange& r) {{ return r.n_end - r.n_begin; }}
__device__ __forceinline__ int tile_at(const KvRange& r, int i) {{ return r.n_end - 1 - i; }}
// R's range decides without the table where R masks the tile; inside it the class does (one
// global load per tile, asked a tile ahead by the consumer).
__device__ __forceinline__ bool tile_partial(const VariantArgs& va, const KvRange& r, int n) {{
  if (CUIR_TABLE_NOCLASS) return n < r.full_begin || n >= r.full_end;
#if CUIR_FULL_BITS
  // a bit test, no load. A tile past the bitmap (more than 32 kFullWords full-range tiles: past 16k at 128): with
  // CUIR_TABLE_ROWS the class load (spill-free then), without it masked as partial (exact, slower; the class load
  // spilled the consumers 12-20 bytes: nvcc 13.0, 128 x 128)
  const int j = n - r.full_begin;
  const unsigned word = {select};
#if CUIR_TABLE_ROWS
  if (j >= 32 * kFullWords) return n >= r.full_end || tile_class(va, r, n) != 2;
#else
  if (j >= 32 * kFullWords) return true;
#endif
  return n < r.full_begin || n >= r.full_end || !((word >> (j & 31)) & 1u);
#else
  return n < r.full_begin || n >= r.full_end || tile_class(va, r, n) != 2;
#endif
}}
#if CUIR_FULL_BITS
// The full-tile bitmap (CUIR_FULL_BITS): full_bits_issue at a work tile's start in every consumer lane (its
// loads in flight through the waits for the first K and Q), full_bits_take (a ballot per word) under the first QK.
__device__ __forceinline__ bool full_bits_pred(int cls) {{ return cls == 2; }}
__device__ __forceinline__ void full_bits_issue(const VariantArgs& va, const KvRange& r, int lane,
                                                int (&cls)[kFullWords]) {{
#pragma unroll
  for (int w = 0; w < kFullWords; ++w) {{
    const int n = r.full_begin + 32 * w + lane;
    cls[w] = n < r.full_end && n < r.n_end ? tile_class(va, r, n) : 0;
  }}
}}
__device__ __forceinline__ void full_bits_take(KvRange& r, const int (&cls)[kFullWords]) {{
  {take}
}}
// The producer, with the range: the middle line of the row's classes into L2 (the trim's first round trip read
// both ends; a row of up to 64 classes, 256 bytes, spans at most three 128-byte lines: an 8k row at 128 x 128).
__device__ __forceinline__ void full_bits_prefetch(const VariantArgs& va, const KvRange& r) {{
  const int n = (r.full_begin + min(r.full_end, r.n_end)) >> 1;
#ifdef __CUDA_ARCH__
  if (n > r.full_begin) asm volatile("prefetch.global.L2 [%0];" :: "l"(&({cls})));
#endif
}}
#endif
// Knob table_kind (experiments/patches/knobs/table_kind.patch, CUIR_TABLE_KIND): the consumer asks
// tile_mask_kind instead of tile_partial and masks kind-1 tiles with table_r_pred. Exact for every table
// (the kind-1 test reads X's class), not only for padded_full.
// Session 16 mid call (H100, padded_causal 8k MHA): -1.8% (its third score pass costs more than the table
// reads it saves; table_diag_nox, R alone on every partial tile of padded_full, +1.3%): a knob only.
"""  + mask_kind_fn()
