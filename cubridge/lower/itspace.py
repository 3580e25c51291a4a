"""The iteration-space region (kv_range) shared by both reference kernels' generators.

A query tile visits the runs of KV tiles that may hold an attended pair (interval analysis of the
mask, or its block table for masks that read tensors). The scan goes chunk by chunk (a chunk that
cannot hold an attended pair is skipped whole) and keeps MAX_RUNS runs exactly; the last run
absorbs any further ones, its empty tiles then running as partial (fully masked): correct, a
little slower. Runs are plain fields, not arrays, so that the range stays in registers. The
skeleton of each kernel only calls kv_count, tile_at and tile_partial.
"""
from __future__ import annotations

from dataclasses import dataclass

from cubridge.cuir import nodes as N
from cubridge.errors import env_switch
from cubridge.lower.cexpr import LowerError, to_c
from cubridge.lower.variant import VariantIR

MAX_RUNS = 3
SCAN_CHUNK = 8
# Bitmap words of a block-table range: 128 tiles exact (16k keys at BLOCK_N 128). The range travels
# to the consumers through a 128-byte tile slot (fa3): 14 ints with the four words.
MASK_WORDS = 4


@dataclass(frozen=True)
class Target:
    """How one reference kernel names things around its kv_range region."""
    block_m: str        # compile-time tile sizes
    block_n: str
    q_tile: str         # the query-tile index parameter of kv_range (and its KvRange field)
    q_begin: str        # the first query row of the tile
    len_q: str          # sequence lengths
    len_k: str
    descending: bool    # visit order: highest KV tile first (fa3: masked tiles lead) or lowest
    handover: str = ""  # C++ appended after KvRange (fa3: the producer hands the range over);
    #                     {table} becomes true / false: does the range read a block table
    class_head0: bool = False   # a per-(b, h) block table of a mask that does not read h: read head 0's
    #                             classes where CUIR_CLASS_HEAD0 (the kernel's region defines it: head_zero_define)


FA3 = Target("kBlockM", "kBlockN", "m_block", "m0", "seqlen_q", "seqlen_k", descending=True,
             handover="constexpr bool kRangeViaSmem = true;   // a scan: computed once, by the producer\n"
                      "constexpr bool kProducerReadsTable = {table};\n", class_head0=True)
FA2 = Target("BLOCK_M", "BLOCK_N", "q_tile", "q_begin", "len_q", "len_k", descending=False)


def region_names(ir: VariantIR, t: Target) -> dict:
    """CuIR name -> (C text, type) inside the kv_range region's tile predicates."""
    names = {n: (f"va.{n}", typ) for n, typ in ir.scalars}
    names.update({"q_lo": ("r.q_lo", "int"), "q_hi": ("r.q_hi", "int"), "k_lo": ("k_lo", "int"),
                  "k_hi": ("k_hi", "int"), "b": ("r.b", "int"), "h": ("r.h", "int"),
                  "NQ": (f"r.{t.len_q}", "int"), "NK": (f"r.{t.len_k}", "int")})
    return names


def _tables(ir: VariantIR) -> dict:
    return {n: (f"va.{n}", [f"va.{n}_n{d}" for d in range(nd)], typ) for n, typ, nd in ir.tables}


# Session 16 (var16): a per-(b, h) block table of a mask that does not read h holds the same classes for every head
# (runtime.block_table copies them; transfer's host table evaluates a mask blind to h), but each (b, h, query tile)
# row of classes is read by one work tile only, so after the timing's L2 flush every trim / scan round trip and the
# first tile_partial load of a row miss L2. Head 0's rows are shared by all heads of a batch (L2 hits after the
# first). CUIR_CLASS_HEAD0 (CUBRIDGE_CLASS_HEAD0, default HEAD0_DEFAULT: off until measured; knob
# experiments/patches/knobs/class_head0.patch) reads them; off, the index is today's (the same SASS).
# Session 16 mid call (H100, variant_tiles, padded_causal 8k MHA): +0.4% (1.645 -> 1.639 ms), within noise: off.
HEAD0_ENV = "CUBRIDGE_CLASS_HEAD0"
HEAD0_DEFAULT = "0"


def head_zero(ir: VariantIR) -> bool:
    """Is the block table per (b, h) while the mask reads no h (its classes are the same for every head)?"""
    return bool(ir.table and ir.table_bh and ir.mask is not None
                and not any(isinstance(e, N.Name) and e.id == "h" for e in N.walk_expr(ir.mask)))


def head_zero_define(ir: VariantIR, t: Target) -> str:
    """CUIR_CLASS_HEAD0's default in a generated kv_range region (where the target reads head 0 at all)."""
    if not (t.class_head0 and head_zero(ir)):
        return ""
    on = env_switch(HEAD0_ENV, HEAD0_DEFAULT, f"unset {HEAD0_ENV} (default {HEAD0_DEFAULT}) or set it to 0 / 1",
                    LowerError)
    return (f"#ifndef CUIR_CLASS_HEAD0   // 1: the mask reads no h, head 0's block classes serve every head "
            f"(lower/itspace.py)\n#define CUIR_CLASS_HEAD0 {int(on)}\n#endif\n")


def predicates(ir: VariantIR, t: Target) -> tuple[str, str, str, str]:
    """C++ of (tile class, tile may given its class `cls`, tile must, chunk may)."""
    names, tables = region_names(ir, t), _tables(ir)
    if ir.table:
        h = "(CUIR_CLASS_HEAD0 ? 0 : r.h)" if t.class_head0 and head_zero(ir) else "r.h"
        idx = (f"((r.b * va.BLOCK_CLASS_n1 + {h}) * va.BLOCK_CLASS_n2 + r.{t.q_tile}) * va.BLOCK_CLASS_n3 + n"
               if ir.table_bh else f"r.{t.q_tile} * va.BLOCK_CLASS_n1 + n")
        cls = f"va.BLOCK_CLASS[{idx}]"
        # the interval bound of the mask's index-only part as well: chunks it rules out are not read
        interval = to_c(ir.may, names, tables) if ir.may is not None else "true"
        return cls, f"{interval} & (cls != 0)", f"{cls} == 2", interval
    may = to_c(ir.may, names, tables)
    # interval analysis holds for any key range; no class
    return "1", may, to_c(ir.must, names, tables), may


def kv_range_region(ir: VariantIR, t: Target) -> str:
    if ir.table:
        return bitmap_region(ir, t)
    cls, may, must, chunk = predicates(ir, t)
    R, bm, bn, lk = MAX_RUNS, t.block_m, t.block_n, t.len_k
    end = "hi" if t.descending else "lo"      # each run is [hi - len, hi) or [lo, lo + len)
    fields = " ".join(f"int {end}{k}, len{k};" for k in range(R))
    init = " ".join(f"r.{end}{k} = r.len{k} = 0;" for k in range(R))
    start, grow, at = (("n + 1", "r.hi{k} - n", "r.hi{k} - 1 - i") if t.descending
                       else ("n", "n + 1 - r.lo{k}", "r.lo{k} + i"))
    extend = "\n".join(
        f"      {'if' if k == 0 else 'else if'} (runs == {k + 1}) {{ if (r.len{k} == 0) r.{end}{k} = "
        f"{start}; r.len{k} = {grow.format(k=k)}; }}" for k in range(R))
    count = " + ".join(f"r.len{k}" for k in range(R))
    tile_at = "\n".join(f"  if (i < r.len{k}) return {at.format(k=k)};\n  i -= r.len{k};" for k in range(R))
    if t.descending:
        chunks = "for (int c = (n_tiles + kScanChunk - 1) / kScanChunk - 1; c >= 0; --c)"
        tiles = "for (int j = kScanChunk - 1; j >= 0; --j)"
    else:
        chunks = "for (int c = 0; c * kScanChunk < n_tiles; ++c)"
        tiles = "for (int j = 0; j < kScanChunk; ++j)"
    order = "highest" if t.descending else "lowest"
    handover = t.handover.format(table="true" if ir.table else "false")
    span = "[hi_k - len_k, hi_k)" if t.descending else "[lo_k, lo_k + len_k)"
    return f"""\
// Generated by cubridge.lower from the variant's iteration space (interval analysis of the mask,
// or its block table). A query tile visits the runs of KV tiles that may hold an attended pair,
// {order} tile first; the first {R - 1} runs are exact, the last absorbs any further ones. Runs are
// plain fields (no arrays) so that the range stays in registers.
struct KvRange {{
  int b, h, {t.q_tile}, q_lo, q_hi, {t.len_q}, {lk};
  {fields}   // run k: tiles {span}
}};
{handover}// A tile's class in the variant's block table (1 = partial when the variant has none).
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
// The same question for a chunk of kScanChunk tiles [k_lo, k_hi] at once: chunks that cannot hold
// an attended pair are skipped whole, so a query tile scans ~NT / kScanChunk chunks, not NT tiles.
constexpr int kScanChunk = {SCAN_CHUNK};
__device__ __forceinline__ bool chunk_may(const VariantArgs& va, const KvRange& r, int k_lo, int k_hi) {{
  return {chunk};
}}
__device__ __forceinline__ KvRange kv_range(const VariantArgs& va, int b, int h, int {t.q_tile}, int {t.q_begin},
                                            int {t.len_q}, int {lk}) {{
  KvRange r;
  r.b = b; r.h = h; r.{t.q_tile} = {t.q_tile}; r.{t.len_q} = {t.len_q}; r.{lk} = {lk};
  r.q_lo = {t.q_begin};
  r.q_hi = min({t.q_begin} + {bm}, {t.len_q}) - 1;
  {init}
  int runs = 0;
  bool open = false;
  const int n_tiles = ({lk} + {bn} - 1) / {bn};
  {chunks} {{
    const int n0 = c * kScanChunk, n1 = min(n0 + kScanChunk, n_tiles);
    if (!chunk_may(va, r, n0 * {bn}, min(n1 * {bn}, {lk}) - 1)) {{ open = false; continue; }}
    int cls[kScanChunk];                          // the chunk's classes, read all at once
#pragma unroll
    for (int j = 0; j < kScanChunk; ++j) cls[j] = n0 + j < n1 ? tile_class(va, r, n0 + j) : 0;
#pragma unroll
    {tiles} {{
      const int n = n0 + j;
      if (n >= n1) continue;
      const int k_lo = n * {bn}, k_hi = min(k_lo + {bn}, {lk}) - 1;
      if (!tile_may(va, r, n, k_lo, k_hi, cls[j])) {{ open = false; continue; }}
      if (!open && runs < {R}) ++runs;              // a new run, or the last one absorbs this one
      open = true;
{extend}
    }}
  }}
  return r;
}}
__device__ __forceinline__ int kv_count(const KvRange& r) {{ return {count}; }}
__device__ __forceinline__ int tile_at(const KvRange& r, int i) {{
{tile_at}
  return -1;
}}
__device__ __forceinline__ bool tile_partial(const VariantArgs& va, const KvRange& r, int n) {{
  const int k_lo = n * {bn}, k_hi = min(k_lo + {bn}, r.{lk}) - 1;
  return k_lo + {bn} > r.{lk} || !tile_must(va, r, n, k_lo, k_hi);
}}
"""


NTH_BIT = """\
#ifndef CUIR_NTH_BIT
#define CUIR_NTH_BIT
// The position of the i-th set bit of w (from 0, lowest bit first; i < popc(w)): halves by popc.
__device__ __forceinline__ int cuir_nth_bit(unsigned w, int i) {
  int pos = 0;
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    const int c = __popc(w & ((1u << s) - 1u));
    if (i >= c) { i -= c; pos += s; w >>= s; }
  }
  return pos;
}
#endif
"""


def bitmap_region(ir: VariantIR, t: Target) -> str:
    """The kv_range region of a block-table variant: the visited tiles as a bitmap (module doc)."""
    cls, may, must, chunk = predicates(ir, t)
    W, bm, bn, lk = MASK_WORDS, t.block_m, t.block_n, t.len_k
    sign = "-" if t.descending else "+"
    words = " ".join(f"unsigned w{k};" for k in range(W))
    init = " ".join(f"r.w{k} = 0u;" for k in range(W))
    setbit = "\n".join(f"        r.w{k} |= (off >> 5) == {k} ? bit : 0u;" for k in range(W))
    popc = " + ".join(f"__popc(r.w{k})" for k in range(W))
    tile_at = "\n".join(f"  {{ const int c = __popc(r.w{k}); if (i < c) return r.first {sign} ({32 * k} + "
                        f"cuir_nth_bit(r.w{k}, i)); i -= c; }}" for k in range(W))
    off = "r.first - n" if t.descending else "n - r.first"
    order = "highest" if t.descending else "lowest"
    if t.descending:
        chunks = "for (int c = (n_tiles + kScanChunk - 1) / kScanChunk - 1; c >= 0; --c)"
        tiles = "for (int j = kScanChunk - 1; j >= 0; --j)"
    else:
        chunks = "for (int c = 0; c * kScanChunk < n_tiles; ++c)"
        tiles = "for (int j = 0; j < kScanChunk; ++j)"
    handover = t.handover.format(table="true")
    return f"""\
// Generated by cubridge.lower from the variant's block table. A query tile visits the KV tiles
// whose class is not empty, {order} first: bit j of the words w0..w{W - 1} is the tile j places after
// `first` in that order (exact for {32 * W} tiles, however scattered), and the `tail` tiles after
// that window are all visited (their empty ones fully masked: correct, a little slower). The bits
// are plain fields (no arrays) so that the range stays in registers.
{NTH_BIT}struct KvRange {{
  int b, h, {t.q_tile}, q_lo, q_hi, {t.len_q}, {lk};
  int first, nbits, tail;   // the first tile visited; set bits; tiles visited after the window
  int dense;                // the visited tiles are one run from `first`: tile_at needs no bit search
  {words}
}};
{handover}// A tile's class in the variant's block table.
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
// The interval part of the question for a chunk of kScanChunk tiles [k_lo, k_hi] at once: chunks
// it rules out are skipped whole, their classes not read.
constexpr int kScanChunk = {SCAN_CHUNK};
__device__ __forceinline__ bool chunk_may(const VariantArgs& va, const KvRange& r, int k_lo, int k_hi) {{
  return {chunk};
}}
__device__ __forceinline__ KvRange kv_range(const VariantArgs& va, int b, int h, int {t.q_tile}, int {t.q_begin},
                                            int {t.len_q}, int {lk}) {{
  KvRange r;
  r.b = b; r.h = h; r.{t.q_tile} = {t.q_tile}; r.{t.len_q} = {t.len_q}; r.{lk} = {lk};
  r.q_lo = {t.q_begin};
  r.q_hi = min({t.q_begin} + {bm}, {t.len_q}) - 1;
  r.first = -1; r.tail = 0; {init}
  int last = -1;                                  // the offset of the last tile visited
  const int n_tiles = ({lk} + {bn} - 1) / {bn};
  {chunks} {{
    const int n0 = c * kScanChunk, n1 = min(n0 + kScanChunk, n_tiles);
    if (!chunk_may(va, r, n0 * {bn}, min(n1 * {bn}, {lk}) - 1)) continue;
    int cls[kScanChunk];                          // the chunk's classes, read all at once
#pragma unroll
    for (int j = 0; j < kScanChunk; ++j) cls[j] = n0 + j < n1 ? tile_class(va, r, n0 + j) : 0;
#pragma unroll
    {tiles} {{
      const int n = n0 + j;
      if (n >= n1) continue;
      const int k_lo = n * {bn}, k_hi = min(k_lo + {bn}, {lk}) - 1;
      if (!tile_may(va, r, n, k_lo, k_hi, cls[j])) continue;
      if (r.first < 0) r.first = n;
      const int off = {off};                 // places after the first visited tile
      last = off;
      if (off < {32 * W}) {{
        const unsigned bit = 1u << (off & 31);
{setbit}
      }} else {{
        r.tail = off - {32 * W - 1};
      }}
    }}
  }}
  r.nbits = {popc};
  r.dense = r.nbits + r.tail == last + 1;
  return r;
}}
__device__ __forceinline__ int kv_count(const KvRange& r) {{ return r.nbits + r.tail; }}
__device__ __forceinline__ int tile_at(const KvRange& r, int i) {{
  if (r.dense) return r.first {sign} i;
{tile_at}
  return r.first {sign} ({32 * W} + i);
}}
__device__ __forceinline__ bool tile_partial(const VariantArgs& va, const KvRange& r, int n) {{
  const int k_lo = n * {bn}, k_hi = min(k_lo + {bn}, r.{lk}) - 1;
  return k_lo + {bn} > r.{lk} || !tile_must(va, r, n, k_lo, k_hi);
}}
"""
