"""Reference-guided lowering of a variant onto the Hopper backward ref_kernels/fa3_bwd_sm90/kernel.cu.

The same VariantIR as cubridge.lower.fa2_bwd_sm80 (extract of the forward transfer's program),
lowered into the Hopper kernel's regions, element-wise on the wgmma accumulator fragments (S^T and
dP^T: keys are rows, queries columns):
- q_range: the forward's iteration space transposed, as fa2_bwd_sm80's (its tile predicates or
  block table over 64-query tiles of the CTA's 128-key tile), scanned once per CTA by warp 0
  into shared-memory runs (kRangeRuns: the producer and both consumers read the tile of step i
  back from there), by the 32 lanes of warp 0 (one tile predicate each per ballot). A block table
  indexed by head (document) is read for every head of the CTA's GQA group (their union).
  q_step_partial decides the mask per consumer (its 64 keys) and query tile. With
  CUBRIDGE_BWD_Q_LIST=1 the region is instead an exact list of the visited tiles with their mask
  flags (q_list_range: no empty step where a block table forms more than 3 runs, e.g. the corpus's
  bitpacked_blocks); =auto (the default since session 13) takes the list only for such a table
  (wants_q_list, at each call's bind: VariantBackward.launchable); =0 never.
- score: score_mod of the natural score s = x * scale in the kernel's log2 units, and its symbolic
  derivative (cubridge.lower.derive). kScoreGradOne (ALiBi-like biases, no score_mod) keeps the
  SCHED 1 order (P^T under the dP GEMM, dS^T from the 16-bit P^T, or from the f32 P^T on
  ISSUE 2 options such as VARIANT_OPTION); otherwise P^T and dS^T come
  from one pass after both GEMMs, which still has the f32 score the derivative needs (also relu:
  its dS tests P != 0, which an fp16 P^T fails where relu(s) c underflows).
- mask_pred: as the forward's (hooks.mask).
- softmax_bwd: softmax P = exp2(y - LSE2), dS = P (dP - Dvec); sigmoid P = sigmoid(s + bias),
  dS = dP P (1 - P); relu P = relu(s) c, dS = dP c [P != 0]. Session 13: sigmoid's bias and halving
  folded into the score region (norm_folded, default; CUBRIDGE_BWD_NORM_FOLD=0 off: sigmoid 603 -> 506
  SASS instructions per unmasked step, composite 857 -> 632; softmax's 493; H100 8k 1.058x / 1.046x);
  CUBRIDGE_BWD_RELU_SPLIT=1 (off: 0.993x on the H100) puts relu on the split passes where the dS pass
  reads the f32 P^T (ISSUE 2 options); CUBRIDGE_BWD_SOFTCAP_SPLIT=1 (session 14, off: 0.768x on the H100) a
  softcapped sigmoid (composite), its dS pass recovering the softcap's tanh from the f32 P (softcap_split).
Only the SCHED 1 / LSE_SMEM 1 options carry the hooks (cubridge.runtime.fa3_bwd_sm90.VARIANT_OPTIONS;
kernel.cu static_assert; the launcher refuses other options for a variant). The dense kernel is the reference itself (no region replaced).
"""
from __future__ import annotations

import os

from cubridge.lower import fusion, hooks, itspace, regions
from cubridge.errors import env_switch
from cubridge.lower.cexpr import LowerError, c_literal, to_c
from cubridge.lower.derive import ONE, derivative, mentions
from cubridge.lower.fa2_bwd_sm80 import q_predicates
from cubridge.lower.variant import VariantIR

MAX_RUNS = itspace.MAX_RUNS
# "auto" by default since session 13 (the list where a block table forms more than MAX_RUNS runs; its GPU
# rule tests passed with the list for every built-in, H100): 1 lowers q_range as the exact list always,
# 0 never.
Q_LIST_ENV = "CUBRIDGE_BWD_Q_LIST"
# Off (session 13 mid call, H100 8k: 0.993x, within noise; its rule tests passed): 1 lets relu take the
# split passes on ISSUE 2 options (softmax_bwd).
RELU_SPLIT_ENV = "CUBRIDGE_BWD_RELU_SPLIT"
# On by default since session 13's mid call (H100, 8k: sigmoid 1.058x, composite 1.046x, all 50 Hopper rule
# cases passing): sigmoid's bias and halving folded into the score region (norm_folded); 0 turns it off.
NORM_FOLD_ENV = "CUBRIDGE_BWD_NORM_FOLD"
# Off (session 14 mid call, H100: composite 0.768x at 8k, 0.931x at 1k; its rule tests passed): 1 puts a softcapped
# sigmoid (composite) on the split passes of ISSUE 2 options, its dS pass recovering the softcap's tanh t from the f32
# P (softcap_split) instead of the one pass after both GEMMs. The two MUFU.LG2 per element cost more than the P pass's
# overlap with the dP GEMM gains.
SOFTCAP_SPLIT_ENV = "CUBRIDGE_BWD_SOFTCAP_SPLIT"
# Session 17 (sig17), on by default (see SCAN_BITS_ENV): 1 makes a normalisation that reads no row terms
# (sigmoid, relu: dS needs neither LSE nor D = rowsum(dO * O)) say so (kRowTerms = false): the preprocess then reads no
# O / dO (only zeroes the dQ accumulator), the producer loads no LSE / Dvec rows per stage, the consumers read none.
ROWLESS_ENV = "CUBRIDGE_BWD_ROWLESS"
# Session 17 (sig17), on by default (see SCAN_BITS_ENV): 1 makes a sigmoid / relu region say kDsFactor =
# kDsFromP32: on ISSUE 2 options (VARIANT_OPTION) the P pass, under the dP GEMM, leaves dS's factor f =
# softmax_dsf(P) * score_mod' (sigmoid P - P^2, relu c [P != 0]) in the f32 P^T registers and packs P^T to 16 bits
# itself; the dS pass is one FMUL, dS = dP f. So composite (a softcap: score_mod' != 1) and relu leave the one pass
# after both GEMMs for the split passes with no extra MUFU and no extra registers (unlike SOFTCAP_SPLIT's two LG2),
# and dS keeps f32 precision (f from the f32 P).
DS_FACTOR_ENV = "CUBRIDGE_BWD_DS_FACTOR"
# Session 17 (sig17): 1 builds q_scan's runs (the runs region, not the exact list) from each
# ballot's bits a run at a time (find-first-set on the bits and on their complement) instead of a tile at a time: the
# same runs (host test), in ~1-3 iterations per 32-tile chunk instead of 32. The scan is serial work of warp 0 before
# the CTA's first barrier (~64 iterations per CTA at 8k causal, ~128 at 16k), which every other warp waits for.
# On since session 17 (H100, final call 1, experiments/results/session17_h100/final/: with the four sig17 switches, sigmoid / composite / relu 8k backward 1.069 / 1.079 / 1.075x over session 16's default in the mid call's one round-robin; eager bar 10.15 / 10.86 / 11.36x in one run); 0 restores the old code.
SCAN_BITS_ENV = "CUBRIDGE_BWD_SCAN_BITS"
# The tile sizes a block table is built at (ref_kernels/fa3_bwd_sm90/params.cuh kBlockM, kBlockN).
BLOCK_M, BLOCK_N = 64, 128


def _group_table(ir: VariantIR) -> bool:
    """A block table indexed by head whose interval part reads no head: the CTA (one kv head) takes
    the union of its GQA group's classes (visit where any head may attend, unmasked where all do)."""
    return ir.table_bh and not (ir.may is not None and mentions(ir.may, "h"))


def predicates(ir: VariantIR) -> tuple[str, str, str, str, str]:
    """C++ of (group class helper, tile class, tile may given `cls`, tile must, chunk may) over the
    query tiles of the CTA's key tile; as fa2_bwd_sm80's, except a per-head block table."""
    if not _group_table(ir):
        return ("", *q_predicates(ir))
    names = {n: (f"va.{n}", typ) for n, typ in ir.scalars}
    names.update({"q_lo": ("q_lo", "int"), "q_hi": ("q_hi", "int"), "k_lo": ("r.k_lo", "int"),
                  "k_hi": ("r.k_hi", "int"), "b": ("r.b", "int"), "NQ": ("r.len_k", "int"), "NK": ("r.len_k", "int")})
    interval = to_c(ir.may, names, hooks.c_tables(ir)) if ir.may is not None else "true"
    helper = """\
// A per-head block table ([B, Hq, query tiles, key tiles]): 2 if every head of the CTA's GQA group
// attends all of tile m, 1 if some head attends a pair of it, 0 if none does.
__device__ __forceinline__ int q_group_class(const VariantArgs& va, const QScan& r, int m) {
  bool any = false, all = true;
  for (int g = 0; g < r.group; ++g) {
    const int c = va.BLOCK_CLASS[((r.b * va.BLOCK_CLASS_n1 + r.h_kv * r.group + g) * va.BLOCK_CLASS_n2 + m) *
                                 va.BLOCK_CLASS_n3 + r.kv_tile];
    any |= c != 0;
    all &= c == 2;
  }
  return all ? 2 : any ? 1 : 0;
}
"""
    return helper, "q_group_class(va, r, m)", f"{interval} & (cls != 0)", "q_group_class(va, r, m) == 2", interval


# The mask test of one consumer's step (its keys [kv_lo, kv_lo + 64), query tile m); both ranges.
PARTIAL_AT = """\
// The mask is needed unless the consumer's keys [kv_lo, kv_lo + 64) all lie below Nk and the
// tile predicate says every (query, key) pair of tile m is attended. Rows past Nq need none:
// their Q and dO rows are TMA zero fill and their LSE +inf, so they add nothing.
__device__ __forceinline__ bool q_partial_at(const VariantArgs& va, int b, int h_kv, int group, int n0, int kv_lo,
                                             int m, int len_q, int len_k) {
  const QScan r{b, h_kv, group, n0 / kBlockN, kv_lo, min(kv_lo + kWgRows, len_k) - 1, len_q, len_k, len_k - len_q};
  const int q_lo = m * kBlockM + r.q_shift, q_hi = min(m * kBlockM + kBlockM, len_q) - 1 + r.q_shift;
  return kv_lo + kWgRows > len_k || !q_tile_must(va, r, m, q_lo, q_hi);
}"""


def _tile_predicates(ir: VariantIR) -> str:
    """The tile / chunk predicates and the lane-parallel visit ballot, shared by both ranges."""
    helper, cls, may, must, chunk = predicates(ir)
    return f"""\
struct QScan {{ int b, h_kv, group, kv_tile, k_lo, k_hi, len_q, len_k, q_shift; }};
{helper}__device__ __forceinline__ int q_tile_class(const VariantArgs& va, const QScan& r, int m) {{
  return {cls};
}}
__device__ __forceinline__ bool q_tile_may(const VariantArgs& va, const QScan& r, int m, int q_lo, int q_hi, int cls) {{
  return {may};
}}
__device__ __forceinline__ bool q_tile_must(const VariantArgs& va, const QScan& r, int m, int q_lo, int q_hi) {{
  return {must};
}}
constexpr int kQScanChunk = 32;   // one ballot: a warp's lanes
__device__ __forceinline__ bool q_chunk_may(const VariantArgs& va, const QScan& r, int q_lo, int q_hi) {{
  return {chunk};
}}
// Tile m may hold an attended pair (its chunk first: a chunk the interval rules out reads no table).
__device__ __forceinline__ bool q_tile_visit(const VariantArgs& va, const QScan& r, int m) {{
  const int q_lo = m * kBlockM + r.q_shift, q_hi = min(m * kBlockM + kBlockM, r.len_q) - 1 + r.q_shift;
  return q_tile_may(va, r, m, q_lo, q_hi, q_tile_class(va, r, m));
}}
{PARTIAL_AT}
// Bit l: tile base + l is visited. One predicate per lane of warp 0 (the table reads of a block
// table overlap instead of queueing behind one thread); the host test's harness (no warps) sets
// FA3B_HOST_SCAN and loops over the lanes.
#ifdef FA3B_HOST_SCAN
inline unsigned q_scan_ballot(const VariantArgs& va, const QScan& r, int base, int n_tiles) {{
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= (base + l < n_tiles && q_tile_visit(va, r, base + l)) ? 1u << l : 0u;
  return bits;
}}
inline bool q_scan_writer() {{ return true; }}
inline int q_ffs(unsigned x) {{ return __builtin_ffs(int(x)); }}
#else
__device__ __forceinline__ unsigned q_scan_ballot(const VariantArgs& va, const QScan& r, int base, int n_tiles) {{
  const int m = base + int(threadIdx.x % 32);
  return __ballot_sync(0xffffffffu, m < n_tiles && q_tile_visit(va, r, m));
}}
__device__ __forceinline__ bool q_scan_writer() {{ return threadIdx.x % 32 == 0; }}
__device__ __forceinline__ int q_ffs(unsigned x) {{ return __ffs(int(x)); }}
#endif
"""


def q_range(ir: VariantIR, q_list: bool = False, scan_bits: bool | None = None) -> str:
    """The q_range region: query-tile runs (MAX_RUNS) or, with q_list, the exact list (q_list_range). scan_bits: the
    runs built a run at a time from each ballot's bits (None: SCAN_BITS_ENV)."""
    if q_list:
        return q_list_range(ir)
    R = MAX_RUNS
    if scan_bits is None:
        scan_bits = scan_bits_enabled()
    if scan_bits:
        upd = "\n".join(f"      {'if' if k == 0 else 'else if'} (runs == {k + 1}) {{ if (len[{k}] == 0) lo[{k}] = base + s; "
                        f"len[{k}] = base + e - lo[{k}]; }}" for k in range(R))
        chunk_loop = f"""\
    // a run at a time ({SCAN_BITS_ENV}=1): tiles base + [s, e) are visited, e = 32 if the run reaches the chunk's end
    bool next_open = false;
    for (unsigned rest = bits; rest != 0u;) {{
      const int s = q_ffs(rest) - 1;
      const unsigned gaps = ~rest & (~0u << s);
      const int e = gaps != 0u ? q_ffs(gaps) - 1 : 32;
      if (!(open && s == 0) && runs < {R}) ++runs;   // a new run, unless it continues the open one or the last absorbs it
{upd}
      next_open = e == 32;
      rest = e == 32 ? 0u : rest & (~0u << e);
      open = false;   // a later run of this chunk starts after a gap
    }}
    open = next_open;
"""
    else:
        extend = "\n".join(f"      {'if' if k == 0 else 'else if'} (runs == {k + 1}) {{ if (len[{k}] == 0) lo[{k}] = m; "
                           f"len[{k}] = m + 1 - lo[{k}]; }}" for k in range(R))
        chunk_loop = f"""\
    for (int l = 0; l < kQScanChunk && base + l < n_tiles; ++l) {{
      const int m = base + l;
      if (!((bits >> l) & 1u)) {{ open = false; continue; }}
      if (!open && runs < {R}) ++runs;
      open = true;
{extend}
    }}
"""
    return f"""\
// Generated by cubridge.lower.fa3_bwd_sm90: the forward's iteration space transposed. The CTA's
// keys [n0, n0 + kBlockN) visit the runs of query tiles that may hold an attended pair (the
// forward's interval predicates or block table), lowest first; the first {R - 1} runs are exact, the
// last absorbs any further ones (its empty tiles then run fully masked). Query tile m holds rows
// [64 m, 64 m + 64); the predicates see positions q_lo..q_hi = row + q_shift (queries end-aligned,
// q_shift = Nk - Nq) and NQ = Nk; a block table is indexed [(b, h,) m, n0 / kBlockN]. Warp 0 scans
// (q_scan) into shared memory before the CTA's first barrier; every step reads its tile back.
struct QRange {{ int m_begin; int m_end; }};   // the dense interface: unused with kRangeRuns
__device__ __forceinline__ QRange q_range(int n0, int seqlen_q, int q_shift) {{ return QRange{{0, 0}}; }}
__device__ __forceinline__ bool step_partial(int m0, int kv_row0, int seqlen_q) {{ return true; }}
constexpr bool kRangeRuns = true;
constexpr int kQRuns = {R};
{_tile_predicates(ir)}// runs = [count, lo_0, len_0, ..., lo_{R - 1}, len_{R - 1}] (shared memory). Called by the 32 lanes
// of warp 0 together; every lane builds the same runs from the ballots, lane 0 stores them.
__device__ __forceinline__ void q_scan(const VariantArgs& va, int b, int h_kv, int group, int n0, int len_q, int len_k,
                                       int* runs_out) {{
  const QScan r{{b, h_kv, group, n0 / kBlockN, n0, min(n0 + kBlockN, len_k) - 1, len_q, len_k, len_k - len_q}};
  int lo[{R}] = {{}}, len[{R}] = {{}};
  int runs = 0;
  bool open = false;
  const int n_tiles = (len_q + kBlockM - 1) / kBlockM;
  for (int base = 0; base < n_tiles; base += kQScanChunk) {{
    if (!q_chunk_may(va, r, base * kBlockM + r.q_shift, min((base + kQScanChunk) * kBlockM, len_q) - 1 + r.q_shift)) {{
      open = false;
      continue;
    }}
    const unsigned bits = q_scan_ballot(va, r, base, n_tiles);
{chunk_loop}  }}
  int count = 0;
#pragma unroll
  for (int k = 0; k < {R}; ++k) count += len[k];
  if (q_scan_writer()) {{
#pragma unroll
    for (int k = 0; k < {R}; ++k) {{
      runs_out[1 + 2 * k] = lo[k];
      runs_out[2 + 2 * k] = len[k];
    }}
    runs_out[0] = count;
  }}
}}
__device__ __forceinline__ bool q_step_partial(const VariantArgs& va, int b, int h_kv, int group, int n0, int kv_lo,
                                               int m, int len_q, int len_k) {{
  return q_partial_at(va, b, h_kv, group, n0, kv_lo, m, len_q, len_k);
}}
"""


# Query tiles an exact list holds: m < Q_LIST_TILES (16k queries), one byte each; later tiles run as
# one range. Static shared memory: the D = 128 variant path leaves 984 bytes of the 227 KB
# (fa3_bwd_sm90.smem_bytes 231464), so 12 + 256 + 64 bytes here (an int list would not fit).
Q_LIST_TILES = 256


def q_list_range(ir: VariantIR, list_tiles: int = Q_LIST_TILES) -> str:
    """The q_range region as an exact list of the visited query tiles and their mask flags
    (list_tiles: a multiple of 32 up to 256; the host tests take fewer, to reach the tail)."""
    if list_tiles % 32 or not 0 < list_tiles <= 256:
        raise LowerError(f"list_tiles={list_tiles} is not a multiple of 32 in 32..256", where="q_list_range",
                         hint="the list holds one byte per tile and its flags one 32-bit word per ballot")
    L = list_tiles
    return f"""\
// Generated by cubridge.lower.fa3_bwd_sm90 (q_list): the forward's iteration space transposed, as
// an exact list. The CTA's keys [n0, n0 + kBlockN) visit, lowest first, exactly the query tiles
// m < {L} that may hold an attended pair (however many runs they form), then every tile from the
// first to the last such tile past {L} (their empty ones fully masked). Query tile m holds rows
// [64 m, 64 m + 64); the predicates see positions row + q_shift (q_shift = Nk - Nq) and NQ = Nk; a
// block table is indexed [(b, h,) m, n0 / kBlockN]. Warp 0 scans (q_scan) into shared memory
// before the CTA's first barrier, also each listed tile's mask flag per consumer; every step reads
// its tile (q_runs_tile) and its flag (q_step_partial) back. Replaces kernel.cu's run decoding.
#define FA3B_Q_TILE_LIST 1
struct QRange {{ int m_begin; int m_end; }};   // the dense interface: unused with kRangeRuns
__device__ __forceinline__ QRange q_range(int n0, int seqlen_q, int q_shift) {{ return QRange{{0, 0}}; }}
__device__ __forceinline__ bool step_partial(int m0, int kv_row0, int seqlen_q) {{ return true; }}
constexpr bool kRangeRuns = true;
constexpr int kQRuns = 1;            // kernel.cu's run count: unused by the list
constexpr int kQListTiles = {L};
{_tile_predicates(ir)}// g_qruns = [count, listed, tail_first]; g_qlist[i < listed] the i-th visited tile; step i >= listed
// is tile tail_first + i - listed. g_qpart[c] bit m: consumer c's step on listed tile m needs the mask.
__shared__ int g_qruns[3];
__shared__ unsigned char g_qlist[kQListTiles];
__shared__ unsigned g_qpart[2][kQListTiles / 32];
__device__ __forceinline__ int q_runs_count() {{ return *static_cast<volatile int*>(&g_qruns[0]); }}
__device__ __forceinline__ int q_runs_tile(int i) {{
  const volatile int* head = g_qruns;
  const int listed = head[1];
  return i < listed ? int(static_cast<volatile unsigned char*>(g_qlist)[i]) : head[2] + (i - listed);
}}
#ifdef FA3B_HOST_SCAN
inline int q_popc(unsigned x) {{ return __builtin_popcount(x); }}
inline int q_high_bit(unsigned x) {{ return 31 - __builtin_clz(x); }}
inline int q_low_bit(unsigned x) {{ return __builtin_ctz(x); }}
// The lanes' work of one chunk, lane by lane: list the visited tiles, ballot their mask flags.
inline void q_list_chunk(const VariantArgs& va, const QScan& r, int base, unsigned bits, int listed) {{
  unsigned part[2] = {{0u, 0u}};
  for (int l = 0; l < 32; ++l) {{
    if (!((bits >> l) & 1u)) continue;
    g_qlist[listed + q_popc(bits & ((1u << l) - 1u))] = (unsigned char)(base + l);
    for (int c = 0; c < 2; ++c)
      part[c] |= q_partial_at(va, r.b, r.h_kv, r.group, r.k_lo, r.k_lo + c * kWgRows, base + l, r.len_q, r.len_k)
                 ? 1u << l : 0u;
  }}
  g_qpart[0][base / 32] = part[0];
  g_qpart[1][base / 32] = part[1];
}}
#else
__device__ __forceinline__ int q_popc(unsigned x) {{ return __popc(x); }}
__device__ __forceinline__ int q_high_bit(unsigned x) {{ return 31 - __clz(x); }}
__device__ __forceinline__ int q_low_bit(unsigned x) {{ return __ffs(x) - 1; }}
__device__ __forceinline__ void q_list_chunk(const VariantArgs& va, const QScan& r, int base, unsigned bits,
                                             int listed) {{
  const int l = int(threadIdx.x % 32), m = base + l;
  const bool mine = (bits >> l) & 1u;
  if (mine) g_qlist[listed + __popc(bits & ((1u << l) - 1u))] = (unsigned char)m;
  const unsigned p0 = __ballot_sync(0xffffffffu, mine && q_partial_at(va, r.b, r.h_kv, r.group, r.k_lo, r.k_lo, m,
                                                                      r.len_q, r.len_k));
  const unsigned p1 = __ballot_sync(0xffffffffu, mine && q_partial_at(va, r.b, r.h_kv, r.group, r.k_lo,
                                                                      r.k_lo + kWgRows, m, r.len_q, r.len_k));
  if (l == 0) {{
    g_qpart[0][base / 32] = p0;
    g_qpart[1][base / 32] = p1;
  }}
}}
#endif
// Called by the 32 lanes of warp 0 together (the same ballots in every lane); runs_out is g_qruns.
__device__ __forceinline__ void q_scan(const VariantArgs& va, int b, int h_kv, int group, int n0, int len_q, int len_k,
                                       int* runs_out) {{
  const QScan r{{b, h_kv, group, n0 / kBlockN, n0, min(n0 + kBlockN, len_k) - 1, len_q, len_k, len_k - len_q}};
  int listed = 0, tail_first = -1, tail_last = -1;
  const int n_tiles = (len_q + kBlockM - 1) / kBlockM;
  for (int base = 0; base < n_tiles; base += kQScanChunk) {{
    if (!q_chunk_may(va, r, base * kBlockM + r.q_shift, min((base + kQScanChunk) * kBlockM, len_q) - 1 + r.q_shift))
      continue;
    const unsigned bits = q_scan_ballot(va, r, base, n_tiles);
    if (base < kQListTiles) {{   // kQListTiles is a multiple of the chunk: a chunk is all listed or all tail
      q_list_chunk(va, r, base, bits, listed);
      listed += q_popc(bits);
    }} else if (bits) {{
      if (tail_first < 0) tail_first = base + q_low_bit(bits);
      tail_last = base + q_high_bit(bits);
    }}
  }}
  if (q_scan_writer()) {{
    runs_out[0] = listed + (tail_first < 0 ? 0 : tail_last + 1 - tail_first);
    runs_out[1] = listed;
    runs_out[2] = tail_first;
  }}
}}
// Listed tiles read their flag back (one shared load instead of the tile predicate, which for a
// block table is a global load per step); tail tiles test the predicate.
__device__ __forceinline__ bool q_step_partial(const VariantArgs& va, int b, int h_kv, int group, int n0, int kv_lo,
                                               int m, int len_q, int len_k) {{
  if (m < kQListTiles)
    return (static_cast<volatile unsigned*>(g_qpart[(kv_lo - n0) / kWgRows])[m / 32] >> (m % 32)) & 1u;
  return q_partial_at(va, b, h_kv, group, n0, kv_lo, m, len_q, len_k);
}}
"""


def grad_is_one(ir: VariantIR) -> bool:
    d = None if ir.score is None else derivative(ir.score)
    return d is None or d == ONE


def score(ir: VariantIR) -> str:
    names = hooks.c_names(ir, {"s": ("s", "float"), "iq": ("q_idx", "int"), "ik": ("kv_idx", "int"),
                               "b": ("b", "int"), "h": ("h", "int")})
    tables = hooks.c_tables(ir)
    identity = ir.score is None
    mod = "x * scale_log2" if identity else f"({to_c(ir.score, names, tables)}) * kLog2e"
    grad = "1.f" if grad_is_one(ir) else to_c(derivative(ir.score), names, tables)
    head = "(const VariantArgs& va, float x, float scale_log2, int b, int h, int q_idx, int kv_idx)"
    s = "" if identity else "  const float s = x * (scale_log2 * kLn2);   // the natural score\n"
    gs = "" if grad == "1.f" else "  const float s = x * (scale_log2 * kLn2);\n"
    header = ("// Generated by cubridge.lower.fa3_bwd_sm90: score_mod of the natural score s = x * scale in log2\n"
              "// units (x = q.k), and its derivative d score_mod / d s (cubridge.lower.derive).\n")
    if norm_folded(ir):
        mod, grad, s, gs = _sigmoid_half_score(ir, names, tables, mod, grad, s, gs)
        if softcap_split(ir):   # the derivative moves into softmax_ds, recovered from P
            grad, gs = "1.f", ""
        header = ("// Generated by cubridge.lower.fa3_bwd_sm90: score_mod of the natural score s = x * scale (x = q.k)\n"
                  "// as y = (score_mod + sigmoid's bias) / 2 (norm_fold: softmax_p is one tanh and one FFMA),\n"
                  "// and its derivative d score_mod / d s (cubridge.lower.derive).\n")
    return (header +
            "constexpr float kLn2 = 0.6931471805599453f;\n"
            f"constexpr bool kScoreModIdentity = {'true' if identity else 'false'};\n"
            f"constexpr bool kScoreGradOne = {'true' if grad == '1.f' else 'false'};\n"
            f"__device__ __forceinline__ float score{head} {{\n{s}  return {mod};\n}}\n"
            f"__device__ __forceinline__ float score_grad{head} {{\n{gs}  return {grad};\n}}\n")


def softmax_bwd(ir: VariantIR, reference_body: str) -> str:
    if ir.norm == "softmax":
        return reference_body
    arg = to_c(ir.norm_arg, hooks.c_names(ir, {}), hooks.c_tables(ir))
    # y is the score in log2 units (region score): y * kLn2 is the natural score.
    dsf = None   # dS / dP as a function of P (DS_FACTOR_ENV), where the normalisation has one
    if ir.norm == "sigmoid" and norm_folded(ir):
        # y = (score + bias) / 2 from the score region: sigmoid(2 y) = 0.5 tanh(y) + 0.5; P (1 - P) as
        # the one FFMA P - P^2
        p, ds, dsf = "cuir_sigmoid_half(y)", "dp * fmaf(-p, p, p)", "fmaf(-p, p, p)"
        what = "P = sigmoid(s + bias) = 0.5 tanh(y) + 0.5 with y = (s + bias) / 2, dS = dP (P - P^2)"
        from_p16 = "true"
        if softcap_split(ir):
            ds, from_p16 = _softcap_ds_from_p(ir), "kDsFromP32"
            what += " A B (1 - t^2), t recovered from P (softcap_split)"
    elif ir.norm == "sigmoid":
        p, ds, dsf = "cuir_sigmoid(y * kLn2 + va_arg)", "dp * p * (1.f - p)", "p * (1.f - p)"
        what = "P = sigmoid(s + bias), dS = dP P (1 - P)"
        from_p16 = "true"
    elif ir.norm == "relu":
        # [s > 0] is [p != 0] when c != 0; when c == 0 both forms give dS = 0.
        p, ds, dsf = "fmaxf(y * kLn2, 0.f) * va_arg", "p != 0.f ? dp * va_arg : 0.f", "p != 0.f ? va_arg : 0.f"
        what = "P = relu(s) c, dS = dP c [s > 0]"
        # [P != 0] of an fp16 P is wrong where relu(s) c underflows (c = 1/Nk: s below ~2e-5), which
        # moved dQ by up to 1e-2 on the H100 (session 9, three fp16 cases): dS from the f32 P. ISSUE 2
        # options' dS pass reads the f32 P^T, never the 16-bit copy, so there the split passes are
        # exact: RELU_SPLIT_ENV=1 lets relu split on them (P pass under the dP GEMM; off until a GPU
        # run passes relu's rule tests and times it, session 13).
        from_p16 = "kDsFromP32" if relu_split_enabled() else "false"
    else:
        raise LowerError(f"normalisation {ir.norm!r} has no backward rule",
                         hint="add one to cubridge/lower/fa3_bwd_sm90.py")
    knob = SOFTCAP_SPLIT_ENV if ir.norm == "sigmoid" else RELU_SPLIT_ENV
    split_note = (f"// {knob}: the split passes wherever the dS pass reads the f32 P^T (ISSUE 2), "
                  "never the 16-bit one\n" if from_p16 == "kDsFromP32" else "")
    rows = "false" if rowless_enabled() else "true"
    # DS_FACTOR_ENV: the factor where the dS pass reads the f32 P^T (ISSUE 2); never with softcap_split (its factor
    # is recovered from P in softmax_ds instead)
    factor = "kDsFromP32" if dsf is not None and ds_factor_enabled() and not softcap_split(ir) else "false"
    return f"""\
// Generated by cubridge.lower.fa3_bwd_sm90: {ir.norm} normalisation, {what}, element-wise
// (a masked pair gets P = 0 and dS = 0). lse_log2 and dvec are not read (the forward saves none).
{split_note}{SOFTCAP_GRAD_FROM_P if "cuir_softcap_grad_from_p" in ds else ""}constexpr bool kDsFromP16 = {from_p16};
// kRowTerms false ({ROWLESS_ENV}=1): no LSE / Dvec loaded or computed anywhere (preprocess, producer, consumers)
constexpr bool kRowTerms = {rows};
// kDsFactor ({DS_FACTOR_ENV}=1, ISSUE 2): the P pass leaves dS / dP = softmax_dsf(P) * score_mod' in the f32 P^T
constexpr bool kDsFactor = {factor};
__device__ __forceinline__ float softmax_dsf(const VariantArgs& va, float p) {{
  const float va_arg = {arg};
  (void)va_arg;
  return {dsf or "p"};
}}
__device__ __forceinline__ float softmax_p(const VariantArgs& va, float y, float lse_log2, bool keep) {{
  const float va_arg = {arg};
  return keep ? {p} : 0.f;
}}
__device__ __forceinline__ float softmax_ds(const VariantArgs& va, float p, float dp, float dvec) {{
  const float va_arg = {arg};
  (void)va_arg;
  return {ds};
}}
__device__ __forceinline__ void softmax_bwd(const VariantArgs& va, float& p, float& ds, float lse_log2,
                                            float dvec, bool keep) {{
  p = softmax_p(va, p, lse_log2, keep);
  ds = softmax_ds(va, p, ds, dvec);
}}
"""


def q_list_mode() -> str:
    """Q_LIST_ENV: "0", the runs; "1", the exact list (q_list_range) for every variant; "auto" or unset,
    the list where a block table forms more than MAX_RUNS runs (wants_q_list, per call)."""
    value = os.environ.get(Q_LIST_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise LowerError(f"{Q_LIST_ENV}={value!r} is not 0, 1 or auto", where="environment",
                         hint=f"unset {Q_LIST_ENV} (query-tile runs), 1 (the exact list) or auto (the list "
                              "where a block table forms more runs than the runs hold)")
    return value


def relu_split_enabled() -> bool:
    """RELU_SPLIT_ENV: "0" or unset, relu's one-pass P / dS; "1", the split passes where dS reads
    the f32 P (ISSUE 2 options; the region's kDsFromP16 = kDsFromP32, read by kernel.cu's kSplitPasses)."""
    return env_switch(RELU_SPLIT_ENV, "0",
                      f"unset {RELU_SPLIT_ENV} (relu's one-pass P / dS) or 1 (split passes on ISSUE 2 options)",
                      LowerError)


def scan_bits_enabled() -> bool:
    """SCAN_BITS_ENV: "0", q_scan builds its runs a tile at a time; "1" or unset (the default), a run at a time."""
    return env_switch(SCAN_BITS_ENV, "1",
                      f"unset {SCAN_BITS_ENV} (a run at a time, the default) or 0 (a tile at a time)",
                      LowerError)


def ds_factor_enabled() -> bool:
    """DS_FACTOR_ENV: "0", as before session 17; "1" or unset (the default), sigmoid / relu regions set kDsFactor =
    kDsFromP32 (the P pass leaves dS's factor in the f32 P^T on ISSUE 2 options: split passes also for a score_mod
    with a derivative)."""
    return env_switch(DS_FACTOR_ENV, "1",
                      f"unset {DS_FACTOR_ENV} (the factor from the P pass, the default) or 0 (dS from P in the dS pass)",
                      LowerError)


def rowless_enabled() -> bool:
    """ROWLESS_ENV: "0", a non-softmax normalisation's kernel still loads the row terms it ignores; "1" or unset (the
    default), kRowTerms = false (no O / dO read in the preprocess, no LSE / Dvec rows loaded or read in the main kernel)."""
    return env_switch(ROWLESS_ENV, "1",
                      f"unset {ROWLESS_ENV} (no row terms for sigmoid / relu, the default) or 0 (loaded as before)",
                      LowerError)


def norm_fold_enabled() -> bool:
    """NORM_FOLD_ENV: "1" or unset, sigmoid's constants folded into the score region (norm_folded); "0",
    the score in log2 units for every normalisation (the A/B baseline)."""
    return env_switch(NORM_FOLD_ENV, "1",
                      f"unset {NORM_FOLD_ENV} (sigmoid's constants folded) or 0 (scores in log2 units)",
                      LowerError)


def norm_folded(ir: VariantIR) -> bool:
    """Whether the score region hands softmax_p sigmoid's (score + bias) / 2 instead of the log2-unit
    score: softmax's P = exp2(y - LSE) needs log2 units, sigmoid paid an FMUL by ln 2, one for its bias
    and one for the halving per element to undo them. (Relu's ln 2 folded the same way measured 0.989x,
    within the run's noise, session 13 mid call: not kept.)"""
    return ir.norm == "sigmoid" and norm_fold_enabled()


def _sigmoid_half_score(ir: VariantIR, names, tables, mod: str, grad: str, s: str, gs: str):
    """(mod, grad, s, gs) of the score region with sigmoid's bias and halving folded in: the score
    region returns y = (score_mod(s) + bias) / 2, so softmax_p is one tanh and one FFMA (the forward's
    fold, cubridge.lower.fa3_sm90). No score_mod: y = x (scale ln2 / 2) + bias / 2, one FFMA per element
    instead of FMUL, FFMA, FMUL. A softcap A tanh(B s): y = tanh(x scale ln2 B) (A / 2) + bias / 2 and
    d/ds = A B (1 - t^2) from the same tanh (the compiler shares it). Elsewhere the natural score_mod,
    then one FFMA. The bias (the normalisation's argument) reads no index: one value per launch."""
    half_bias = f"0.5f * ({to_c(ir.norm_arg, hooks.c_names(ir, {}), hooks.c_tables(ir))})"
    if ir.score is None:
        return f"fmaf(x, scale_log2 * (0.5f * kLn2), {half_bias})", grad, s, gs
    form = fusion.softcap_form(ir.score)
    if form is None:
        return f"fmaf({to_c(ir.score, names, tables)}, 0.5f, {half_bias})", grad, s, gs
    amp, rate = form
    t = f"  const float t = cuir_tanh(x * (scale_log2 * (kLn2 * {c_literal(rate)})));\n"
    return (f"fmaf(t, {c_literal(0.5 * amp)}, {half_bias})", f"{c_literal(amp * rate)} * fmaf(-t, t, 1.f)", t, t)


def softcap_split(ir: VariantIR) -> bool:
    """SOFTCAP_SPLIT_ENV=1 and a folded sigmoid whose score_mod is a softcap A tanh(B s) (composite): dS takes the
    softcap's derivative A B (1 - t^2) from P itself (_softcap_ds_from_p), so kScoreGradOne holds and the kernel's
    split passes run it where the dS pass reads the f32 P (ISSUE 2: kDsFromP16 = kDsFromP32; elsewhere the one
    pass, the same softmax_ds)."""
    return (env_switch(SOFTCAP_SPLIT_ENV, "0",
                       f"unset {SOFTCAP_SPLIT_ENV} (a softcapped sigmoid's one-pass P / dS) or 1 (split passes)",
                       LowerError)
            and norm_folded(ir) and fusion.softcap_form(ir.score) is not None)


def _softcap_ds_from_p(ir: VariantIR) -> str:
    """softmax_ds of a softcapped sigmoid from P alone: P = sigmoid(A t + bias), so t = (ln P - ln(1 - P) - bias) / A
    (two MUFU.LG2), clamped to [-1, 1]; dS = dP (P - P^2) A B (1 - t^2). Where P rounds to 0 or 1 the log is
    infinite, t clamps to -1 / 1 and (1 - t^2) to 0, with P - P^2 0 there as well; where the f32 P is inexact (its
    tanh cancels near 0 and 1: absolute error ~2^-24), t's error times P (1 - P) stays ~2^-24 B |t| |dP|."""
    amp, rate = fusion.softcap_form(ir.score)
    return (f"dp * fmaf(-p, p, p) * ({c_literal(amp * rate)} * cuir_softcap_grad_from_p(p, va_arg * "
            f"{c_literal(-1.0 / amp)}, {c_literal(0.6931471805599453 / amp)}))")


# softcap_split's (1 - t^2) from P: t = (log2 P - log2 (1 - P)) ln 2 / A - bias / A, clamped to [-1, 1]
SOFTCAP_GRAD_FROM_P = """\
__device__ __forceinline__ float cuir_softcap_grad_from_p(float p, float neg_bias_over_a, float ln2_over_a) {
  const float t = fminf(fmaxf(fmaf(__log2f(p) - __log2f(1.f - p), ln2_over_a, neg_bias_over_a), -1.f), 1.f);
  return fmaf(-t, t, 1.f);
}
"""


def q_list_enabled() -> bool:
    return q_list_mode() == "1"


_RUNS_SEEN: dict[int, tuple] = {}   # id(block table) -> (table, group, answer): bind caches its tables


def wants_q_list(block_class, group: int) -> bool:
    """Whether a block table [(B, Hq,) query tiles, KV tiles] forms more than MAX_RUNS runs of
    non-empty query tiles in some KV-tile column (per-head tables: the union over each kv head's
    group, as q_group_class visits): the runs would then visit empty tiles, the list would not
    (session 12 mid call: bitpacked_blocks 2.09x with the list, the exact specs +-2%)."""
    seen = _RUNS_SEEN.get(id(block_class))
    if seen is not None and seen[0] is block_class and seen[1] == group:
        return seen[2]
    nz = block_class != 0
    if nz.dim() == 4:
        b, h, m, n = nz.shape
        nz = nz.reshape(b, h // group, group, m, n).any(2)
    starts = nz.clone()
    starts[..., 1:, :] &= ~nz[..., :-1, :]
    answer = bool(starts.numel()) and int(starts.sum(-2).max()) > MAX_RUNS
    if len(_RUNS_SEEN) > 64:
        _RUNS_SEEN.clear()
    _RUNS_SEEN[id(block_class)] = (block_class, group, answer)
    return answer


def lower_source(reference: str, ir: VariantIR, q_list: bool | None = None) -> str:
    """kernel.cu of the Hopper backward for variant `ir` (build with IS_CAUSAL=0 and the
    macros of one of VARIANT_OPTIONS: the mask is the variant's). q_list: the exact query-tile
    list instead of the runs (None: q_list_enabled())."""
    if ir.dense_reference:
        return reference
    q_list = q_list_enabled() if q_list is None else q_list
    body = regions.body(reference, "softmax_bwd")
    return regions.replace(reference, {
        "extra_io": hooks.extra_io(ir), "q_range": q_range(ir, q_list), "mask_pred": hooks.mask(ir), "score": score(ir),
        "softmax_bwd": softmax_bwd(ir, body),
    })
