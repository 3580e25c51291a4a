// FlashAttention-3-class forward attention for Hopper (sm_90a): TMA + wgmma, warp-specialised.
//
// Build: nvcc -cubin -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I<this dir> \
//        [-DHEAD_DIM=128 -DBLOCK_M=128 -DBLOCK_N=128 -DSTAGES=2 -DIS_CAUSAL=0 -DDTYPE_BF16=1] kernel.cu
//
// Glossary
//   B, Hq, Hkv      batch, query heads, key/value heads (Hq % Hkv == 0; G = Hq / Hkv queries per kv head)
//   Nq, Nk          query / key sequence lengths (any value >= 1; tails are zero-filled by TMA, masked)
//   D               head dimension (HEAD_DIM)
//   q, k, v, o      [B, H, N, D] 16-bit views, D contiguous, the strides of N, H and B any 16-byte
//                   multiples ([B, N, H, D] memory is read in place): 4-D TMA maps (D, N, H, B),
//                   a box of one head; lse [B, Hq, Nq] float32 contiguous, natural log
//   tile            one (m_block, head, batch) work item. A CTA starts with tile blockIdx.x and
//                   then takes gridDim.x + atomicAdd(tile_counter, 1) until past the last tile
//                   (the last producer done resets the counter to 0 for the next launch)
//                   (grid = #tiles: one tile each; grid = #SMs: persistent, dynamically balanced)
//   tile_slot[2]    smem ring through which the producer hands each tile (index, heads and its
//                   KV range, computed once) to the consumers, guarded by tile_full / tile_empty
//   m_block         index of a query tile: rows [m0, m0 + BLOCK_M), m0 = m_block * BLOCK_M
//   q_idx           a query's position: row + Nk - Nq (queries aligned to the end of the keys,
//                   as in FlashAttention; causal is then bottom-right aligned when Nq < Nk)
//   n               index of a key/value tile: keys [n * BLOCK_N, (n + 1) * BLOCK_N)
//   WG              warpgroup: 4 consecutive warps, 128 threads, the unit that issues wgmma
//   producer        WG 0; one thread issues every TMA load
//   consumer c      WG c + 1 (c = 0 .. kConsumers-1); owns query rows [m0 + 64c, m0 + 64c + 64)
//   S, P, O         scores Q K^T (f32 regs), probabilities (16-bit regs, wgmma A operand), output acc
//   row_max         running max of the scores of a row (natural units), row_sum the running sum
//   stage           slot of the K/V ring in shared memory; phase = parity of the ring's lap
//   full / empty    mbarriers: "a TMA filled this slot" / "every consumer warp is done reading it"
//                   (q_full[slot] / q_empty[slot] for the Q tiles, k_full[stage] ... v_empty[stage]
//                   for the K/V ring)
//   Q slot          kQSlots (1 or 2) Q tiles in shared memory; tile k of a CTA (counting tiles
//                   with KV work) uses slot k % kQSlots, so with two the next tile's Q loads early
//   wg_turn[c]      named barrier: consumer c may issue its GEMMs (ping-pong between consumers)
//   panel           64 columns of a tile (128 bytes, the 128B-swizzle span); D = 128 has two
//
// Lifting map (regions marked @cuir-region / @cuir-end): head_map, extra_io, kv_range, load_q,
// load_kv, qk, score, mask, softmax, pv, epilogue. See README.md for what each region may be
// replaced with; cubridge/lower regenerates extra_io, kv_range, score, mask, softmax, epilogue.
// The consumers' loop is in consumer.cuh (included after the epilogue), the work tiles and the
// tile hand-over in tiles.cuh (after the regions); neither holds a region.
#if defined(__CUDACC_RTC__)   // NVRTC: no toolkit headers; the few types the kernel names
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };
typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <cuda.h>
#include <stdint.h>
#endif

#include "wgmma.cuh"

// ------------------------------------------------------------------ compile-time parameters
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef IS_CAUSAL
#define IS_CAUSAL 0
#endif
#ifndef DTYPE_BF16
#define DTYPE_BF16 1
#endif
// Options for full attention (IS_CAUSAL=0; no effect on causal): KV_ROTATE starts each query
// block's KV loop at its own tile (kv_range), L2_HINTS loads K / V with EVICT_LAST and Q with
// EVICT_FIRST. Off unless the runtime's Fa3Config sets them (session 10: A/B pending).
#ifndef KV_ROTATE
#define KV_ROTATE 0
#endif
#ifndef L2_HINTS
#define L2_HINTS 0
#endif
// TAIL_SPLIT (full attention of the dense kernel, persistent grid): the last #tiles mod #CTAs tiles,
// which would run alone on a few SMs while the rest idle, are split along KV into chunks whose
// partial results the last chunk combines (tiles.cuh). Its workspace pointer and counters follow the
// scheduler's pair in tile_counter (Fa3Config.tail_split). Off by default (session 13: A/B pending).
#ifndef TAIL_SPLIT
#define TAIL_SPLIT 0
#endif
// K_BEFORE_V (HEAD_DIM 256 only; ignored elsewhere): the producer issues K_i before V_{i-1}, the
// order the consumers read them in (QK_i, then P_{i-1} V_{i-1}) and FA4's SM90 producer order with
// intra-warpgroup overlap, so K_{i+1} no longer queues behind V_i's wait for its slot (freed only
// when P_{i-2} V_{i-2} completes). Off unless Fa3Config.k_before_v (session 14: A/B pending; at
// D 128 with turns it lost 2-7%, session 12, experiments/patches/k_before_v.patch).
#ifndef K_BEFORE_V
#define K_BEFORE_V 0
#endif
// MBAR_SLEEP (every head dim; D 256 only before session 15): mbarrier waits with a suspend-time hint
// (hopper_ptx.cuh).
#ifndef MBAR_SLEEP
#define MBAR_SLEEP 0
#endif
// UNIFORM_Q (HEAD_DIM 256 only): the consumer index through a lane-0 shuffle taken in the consumers'
// branch only, so that ptxas keeps the Q descriptors in uniform registers (no R2UR pair before each QK
// HGMMA) while the 24-register producer never holds it (kUniformWg's shuffle before the role split
// spilled there). Off unless Fa3Config.uniform_q (session 15: A/B pending; kUniformQ below).
#ifndef UNIFORM_Q
#define UNIFORM_Q 0
#endif
// PRODUCER_SLEEP (every head dim; session 16): the producer's mbarrier waits (tile, Q, K and V slots
// free) take the suspend-time hint of MBAR_SLEEP, the consumers' waits do not. Session 15's ncu (full
// 8k): the producer thread's two slot waits retried (YIELD, TRYWAIT, BRA) 19 times a KV step at D 128
// 128 x 176 and 10 at D 64, 449 / 368 warp instructions a step on sub-partition 0, which are ours'
// whole executed surplus over FA4 at D 128 (497 vs 466 per 128 keys per consumer warp). Off unless
// Fa3Config.producer_sleep (session 16 mid: 0.998-1.011 at D 64 / 128, 1k / 8k, the noise; clock unmeasured).
#ifndef PRODUCER_SLEEP
#define PRODUCER_SLEEP 0
#endif
// ALIGN_END (dense causal; session 17): where BLOCK_M does not divide Nq, the query blocks after the first end at Nq,
// so the rows the last block would have padded are instead the first block's overlap with the second (kAlignEnd below).
// Off unless Fa3Config.align_end.
#ifndef ALIGN_END
#define ALIGN_END 0
#endif

#include "hopper_ptx.cuh"   // after the parameter macros: pack2 reads DTYPE_BF16

#include "params.cuh"        // tile sizes, fragments, shared-memory layout, barriers

namespace fa3 {

// ------------------------------------------------------------------ regions
// @cuir-region head_map
// bh_q indexes LSE (b * Hq + h); (h, b) address Q and O in their 4-D TMA maps, bh_kv split into
// (bh_kv % Hkv, bh_kv / Hkv) K and V: split at each load, not carried (two more live values in
// the 24-register producer of D 256 128x80 spilled 32 bytes, 22 with the 3-D maps; split in the
// load's arguments it spills 2, nvcc 13.0; hoisted to the loop's top, 60).
struct HeadMap { int bh_q; int bh_kv; int b; int h; };
__device__ __forceinline__ HeadMap head_map(int b, int h, int heads_q, int heads_kv) {
  const int group = heads_q / heads_kv;          // MHA: 1, GQA: Hq / Hkv, MQA: Hq
  return HeadMap{b * heads_q + h, b * heads_kv + h / group, b, h};
}
// @cuir-end head_map

// @cuir-region extra_io
// A variant's extra kernel arguments (captured tensors, shape-dependent scalars); none here.
// kLongestFirst: schedule the query tiles with the most KV tiles first (short tail); causal does.
struct VariantArgs { int unused; };
constexpr bool kLongestFirst = false;
// @cuir-end extra_io

// @cuir-region kv_range
// Key tiles [n_begin, n_end) may hold attended pairs for query rows [m0, m0 + kBlockM);
// tiles in [full_begin, full_end) need no mask (every pair attended and in bounds).
// The skeleton only uses kv_count, tile_at (the i-th KV tile to visit; high n first: masked tiles
// lead) and tile_partial, so a variant may replace the range by any set of tiles.
// kKvRotate (KV_ROTATE, full attention only: the order is free there): query block m_block of num_m
// starts m_block / num_m of the way round its KV tiles, so that the persistent CTAs, which run one
// head's query blocks at a time, do not all read the same K / V tile at the same moment.
constexpr bool kKvRotate = KV_ROTATE && !kCausal;
// This region's mark: a lowered variant replaces the region and with it the mark, so kDenseKernel
// (below) tells the reference kernel from a lowered variant.
#define FA3_DENSE_KV_RANGE 1
struct KvRange { int n_begin; int n_end; int full_begin; int full_end; int rot; };
constexpr bool kRangeViaSmem = false;   // consumers recompute this range (cheaper than a hand-over)
constexpr bool kProducerReadsTable = false;   // true: the range comes from a block table in global memory
__device__ __forceinline__ KvRange kv_range(const VariantArgs& va, int b, int h, int m_block, int m0,
                                            int seqlen_q, int seqlen_k) {
  const int kv_stop = kCausal ? min(seqlen_k, m0 + kBlockM) : seqlen_k;   // kv <= q (positions)
  const int n_end = max(0, (kv_stop + kBlockN - 1) / kBlockN);            // Nq > Nk: rows before key 0
  int full_end = seqlen_k / kBlockN;                                       // ragged tail is partial
  if (kCausal) full_end = min(full_end, (m0 + 1) / kBlockN);               // max kv <= min q
  // (seqlen_q here is the last query's position + 1 = Nk: num_m counts Nk's query blocks, and with
  // Nq > Nk m_block goes past it, hence the modulo)
  const int num_m = max(1, (seqlen_q + kBlockM - 1) / kBlockM);
  const int rot = kKvRotate && n_end > 0 ? int((long long)m_block * n_end / num_m % n_end) : 0;
  return KvRange{0, n_end, 0, max(0, min(full_end, n_end)), rot};
}
__device__ __forceinline__ int kv_count(const KvRange& r) { return r.n_end - r.n_begin; }
__device__ __forceinline__ int tile_at(const KvRange& r, int i) {
  if constexpr (!kKvRotate) return r.n_end - 1 - i;
  const int j = i + r.rot;                             // i < kv_count and rot < kv_count (n_begin 0)
  return r.n_end - 1 - (j >= r.n_end ? j - r.n_end : j);
}
__device__ __forceinline__ bool tile_partial(const VariantArgs& va, const KvRange& r, int n) {
  return n >= r.full_end || n < r.full_begin;
}
// @cuir-end kv_range
// Session 10's code-generation changes (wgmma descriptors once per GEMM, the uniform warpgroup
// index, the three-consumer producer loop) apply to the reference kernel only: in lowered variants
// they moved ptxas's register allocation both ways (e.g. share_question 128 x 128 s3 6 -> 22 bytes
// spilled, global_sliding_window 128 x 96 s3 0 -> 18, relative_pos 192 x 80 s3 16 -> 32), so the
// variants keep session 9's code until a per-variant, spill-checked choice exists.
#ifdef FA3_DENSE_KV_RANGE
constexpr bool kDenseKernel = true;
#else
constexpr bool kDenseKernel = false;
#endif
// And to two consumers: three (D 64's 192 x 128) ran 3-6% slower with the descriptors and the
// producer loop below (session 10 mid call, fwd_mid_ab.json, all eight D 64 shapes), so they keep
// session 9's code, with its 4-18 spilled bytes in the producer of 20 causal builds of the space.
// Lowered variants whose kv_range region defines CUIR_VARIANT_CODEGEN get it too (session 12: softmax
// variants with no score_mod and no block table, cubridge/lower/fa3_sm90.py session10_codegen;
// spill-free at 128 x 128 and 128 x 176 with it, +3.4-4.9% at 128 x 176 in the mid call).
#ifdef CUIR_VARIANT_CODEGEN
constexpr bool kVariantCodegen = true;
#else
constexpr bool kVariantCodegen = false;
#endif
constexpr bool kNewCodegen = (kDenseKernel || kVariantCodegen) && kConsumers == 2;

// @cuir-region score
// score = kScoreFactor * score_mod(va, x, scale, ...), x the raw q.k and scale the softmax scale
// (the score before any transform is x * scale). kScoreModIdentity: score_mod is x * scale
// itself, so the scores stay raw and the softmax region applies softmax_scale inside its exp2
// FFMA (one FMUL per score less); a generated score_mod leaves a positive constant factor of its
// result to kScoreFactor, which the normalisation folds into its first FFMA the same way.
constexpr bool kScoreModIdentity = true;
constexpr float kScoreFactor = 1.f;
__device__ __forceinline__ float score_mod(const VariantArgs& va, float x, float scale, int b, int h,
                                           int q_idx, int kv_idx) {
  return x * scale;
}
// @cuir-end score

// @cuir-region mask
__device__ __forceinline__ bool mask_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx) {
  return !kCausal || kv_idx <= q_idx;
}
// @cuir-end mask

// ALIGN_END (above): query block m > 0 covers rows [Nq - (num_m - m) * kBlockM, +kBlockM) and block 0 rows [0, kBlockM),
// so no block is partial: the pad = num_m * kBlockM - Nq rows the last (in causal the longest) block padded are the
// first block's last rows, which the second block computes again. D 64 causal 192 x 128 at 4k: 384 KV steps a head ->
// 364 (-5.2%; the first block 2 KV tiles as before), 8k / 16k -1.4%. No TMA coordinate is negative (the mid call's
// rows-before-0 form of this hit an illegal instruction). A row of the overlap visits the same attended KV tiles in the
// same order from both blocks (the second one's extra, fully masked tiles leave its state as it was: max -inf, sum 0,
// O 0), so both write the same O and LSE: the duplicate stores are of equal values (up to the sign of an exact 0).
constexpr bool kAlignEnd = ALIGN_END && kCausal && kDenseKernel;

// kSaturates (a generated score region defines CUIR_SAT_LO / CUIR_SAT_HI: cubridge/lower/saturate.py):
// score_mod reads q_idx and kv_idx only through d = kv_idx - q_idx and is the same function of its
// other inputs for every d >= kSatHi and for every d <= kSatLo (T5's clamped buckets), so a full
// tile whose pairs all lie past one bound evaluates it there, kv_idx = q_idx + bound: bitwise the
// same scores, and nvcc folds d and all that depends on it alone (the bucket) out of the loop.
#ifdef CUIR_SAT_HI
constexpr bool kSaturates = true;
constexpr int kSatLo = CUIR_SAT_LO, kSatHi = CUIR_SAT_HI;
#else
constexpr bool kSaturates = false;
constexpr int kSatLo = 0, kSatHi = 0;
#endif

// kMaskRows (a generated mask region defines CUIR_MASK_ROWS and mask_rows: cubridge/lower/rowint.py):
// the mask keeps the keys of each row in kMaskPieces intervals [lo, hi), so a partial tile takes them
// once per row, moves them to the tile's column origin, and tests each element against its column
// offset (an immediate): one or two compares per element, not the whole predicate. Two pieces
// (global_sliding_window's global columns and window) are clipped to the tile and merged; where a
// row of the warp keeps two disjoint pieces in this tile, the warp evaluates mask_pred instead.
#ifdef CUIR_MASK_ROWS
constexpr bool kMaskRows = CUIR_MASK_ROWS;
#else                                                      // no row-interval form: mask_pred per element
constexpr bool kMaskRows = false, kMaskRowLo = true;
constexpr int kMaskPieces = 1;
__device__ __forceinline__ void mask_rows(const VariantArgs&, int, int, int, int (&lo)[1], int (&hi)[1]) { lo[0] = hi[0] = 0; }
#endif

// (tile_row_interval: tests/cpu/test_rowint.py compiles it from here with g++.)
// The keys row q keeps among the tile's columns, relative to kv_col0, as one interval [row_lo,
// row_hi), the key bound applied: true; false where they are two disjoint pieces in this tile.
// Two pieces are clipped to the columns [0, kBlockN) and merged where one is empty or they touch.
__device__ __forceinline__ bool tile_row_interval(const int (&lo)[kMaskPieces], const int (&hi)[kMaskPieces],
                                                  int kv_col0, int seqlen_k, int& row_lo, int& row_hi) {
  if constexpr (kMaskPieces == 1) {
    row_lo = lo[0] - kv_col0;
    row_hi = min(hi[0], seqlen_k) - kv_col0;
    return true;
  } else {
    const int lo0 = max(lo[0] - kv_col0, 0), hi0 = min(min(hi[0], seqlen_k) - kv_col0, kBlockN);
    const int lo1 = max(lo[1] - kv_col0, 0), hi1 = min(min(hi[1], seqlen_k) - kv_col0, kBlockN);
    const bool empty0 = lo0 >= hi0, empty1 = lo1 >= hi1;
    row_lo = empty0 ? lo1 : empty1 ? lo0 : min(lo0, lo1);
    row_hi = empty0 ? hi1 : empty1 ? hi0 : max(hi0, hi1);
    return empty0 | empty1 | ((lo0 <= hi1) & (lo1 <= hi0));
  }
}
// (end tile_row_interval)

// One pass over S with each element's indices: score_mod (skipped for an identity score_mod: the
// softmax scales) and on partial tiles the mask, per element (mask_pred) or, kRows, against the
// rows' column interval [row_lo, row_hi) relative to kv_col0.
template <bool kPartial, int kSat, bool kRows>
__device__ __forceinline__ void score_mask_pass(const VariantArgs& va, float (&s)[kSRegs],
                                                float softmax_scale, HeadMap hm, int q_row0, int kv_col0,
                                                int seqlen_k, const int (&row_lo)[2], const int (&row_hi)[2]) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        const int q_idx = q_row0 + 8 * half, kv_idx = kv_col0 + 8 * j + e;
        const int kv_mod = kSat > 0 ? q_idx + kSatHi : kSat < 0 ? q_idx + kSatLo : kv_idx;
        if constexpr (!kScoreModIdentity) x = score_mod(va, x, softmax_scale, hm.b, hm.h, q_idx, kv_mod);
        if constexpr (kPartial && kRows) {
          const int c = 8 * j + e;                       // kv_idx - kv_col0
          if (!(((!kMaskRowLo) | (c >= row_lo[half])) & (c < row_hi[half]))) x = kNegInf;
        } else if (kPartial && !((kv_idx < seqlen_k) & mask_pred(va, hm.b, hm.h, q_idx, kv_idx))) {
          x = kNegInf;
        }
      }
}

// Scale and score_mod, and on partial tiles the mask (score_mask_pass). kSat: 0 score_mod at each
// pair's own kv_idx; +1 / -1 at d = kSatHi / kSatLo (a full tile wholly past that bound).
template <bool kPartial, int kSat = 0>
__device__ __forceinline__ void score_and_mask(const VariantArgs& va, float (&s)[kSRegs],
                                               float softmax_scale, HeadMap hm, int q_row0,
                                               int kv_col0, int seqlen_k) {
  int row_lo[2] = {0, 0}, row_hi[2] = {0, 0};             // kMaskRows: [lo, hi) - kv_col0 per row
  if constexpr (kPartial && kMaskRows) {
    bool one = true;                                       // every row's kept keys: one interval here
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int lo[kMaskPieces], hi[kMaskPieces];
      mask_rows(va, hm.b, hm.h, q_row0 + 8 * half, lo, hi);
      one &= tile_row_interval(lo, hi, kv_col0, seqlen_k, row_lo[half], row_hi[half]);
    }
    if (kMaskPieces == 1 || __all_sync(kFullMask, one)) {
      score_mask_pass<kPartial, kSat, true>(va, s, softmax_scale, hm, q_row0, kv_col0, seqlen_k, row_lo, row_hi);
      return;
    }
  }
  score_mask_pass<kPartial, kSat, false>(va, s, softmax_scale, hm, q_row0, kv_col0, seqlen_k, row_lo, row_hi);
}

#ifdef CUIR_TABLE_ROWS_HOOKS
// A lowered block-table mask R & X (cubridge/lower/tablerange.py, CUIR_TABLE_ROWS): a partial tile in one pass,
// R's row interval [row_key_lo, row_key_hi) (kMaskRows' compare pair) and X's bit for each of the thread's two
// rows and 32 columns, evaluated once per tile (x_pred) and skipped where X keeps the whole tile (x_all: the
// tile r_only), so that tile reads no table.
static_assert(kBlockN <= 128, "CUIR_TABLE_ROWS: a thread's columns of a tile must fit 32 bits");
__device__ __forceinline__ void score_and_mask_x(const VariantArgs& va, float (&s)[kSRegs], float softmax_scale,
                                                 HeadMap hm, int q_row0, int kv_col0, int seqlen_k, bool x_all) {
  int row_lo[2], row_hi[2];
  unsigned xb[2] = {~0u, ~0u};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int q_idx = q_row0 + 8 * half;
    row_lo[half] = row_key_lo(va, hm.b, hm.h, q_idx) - kv_col0;
    row_hi[half] = min(row_key_hi(va, hm.b, hm.h, q_idx), seqlen_k) - kv_col0;
  }
  if (!x_all) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      unsigned bits = 0u;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          bits |= unsigned(x_pred(va, hm.b, hm.h, q_row0 + 8 * half, kv_col0 + 8 * j + e)) << (2 * j + e);
      xb[half] = bits;
    }
  }
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        const int q_idx = q_row0 + 8 * half, c = 8 * j + e;
        if constexpr (!kScoreModIdentity) x = score_mod(va, x, softmax_scale, hm.b, hm.h, q_idx, kv_col0 + c);
        if (!(((!kTableRowLo) | (c >= row_lo[half])) & (c < row_hi[half]) & (((xb[half] >> (2 * j + e)) & 1u) != 0u)))
          x = kNegInf;
      }
}
#endif

// @cuir-region softmax
// Online softmax over one S tile (two rows per thread; a row is spread over 4 lanes). S holds
// scores / score_scale (raw q.k when score_mod is the identity, else score_mod's results with
// score_scale = kScoreFactor) and becomes exp(score - row_max) in place, the scale folded into
// the exp2 FFMA; row_max is in natural units (score_scale > 0, so the max of S scales to the max
// of scores). rescale[half] is what the O rows accumulated so far get multiplied by.
struct SoftmaxState { float row_max[2]; float row_sum[2]; };
__device__ __forceinline__ void softmax_init(SoftmaxState& st) {
  st.row_max[0] = st.row_max[1] = kNegInf;
  st.row_sum[0] = st.row_sum[1] = 0.f;
}
__device__ __forceinline__ void softmax_update(const VariantArgs& va, float (&s)[kSRegs],
                                               SoftmaxState& st, float (&rescale)[2],
                                               float score_scale) {
  const float scale_log2 = score_scale * kLog2e;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = kNegInf;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
      mx = fmaxf(mx, fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    mx = fmaxf(st.row_max[half], mx * score_scale);
    const float base = (mx == kNegInf ? 0.f : mx) * kLog2e;   // a row with nothing attended yet
    rescale[half] = fast_exp2(st.row_max[half] * kLog2e - base);
    st.row_max[half] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        x = fast_exp2(fmaf(x, scale_log2, -base));
        sum += x;
      }
    st.row_sum[half] = st.row_sum[half] * rescale[half] + sum;   // per-lane partial sum
  }
}
// The same update in two halves (FA3_SOFTMAX_SPLIT marks them): max and exp2 arguments, then the
// exponentials and sums, bitwise the same; consumer.cuh waits for its P V between them (FA4's SASS).
#define FA3_SOFTMAX_SPLIT 1
__device__ __forceinline__ void softmax_args(const VariantArgs& va, float (&s)[kSRegs],
                                             SoftmaxState& st, float (&rescale)[2],
                                             float score_scale) {
  const float scale_log2 = score_scale * kLog2e;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = kNegInf;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
      mx = fmaxf(mx, fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    mx = fmaxf(st.row_max[half], mx * score_scale);
    const float base = (mx == kNegInf ? 0.f : mx) * kLog2e;   // a row with nothing attended yet
    rescale[half] = fast_exp2(st.row_max[half] * kLog2e - base);
    st.row_max[half] = mx;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        x = fmaf(x, scale_log2, -base);
      }
  }
}
__device__ __forceinline__ void softmax_exps(float (&s)[kSRegs], SoftmaxState& st,
                                             const float (&rescale)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        x = fast_exp2(x);
        sum += x;
      }
    st.row_sum[half] = st.row_sum[half] * rescale[half] + sum;   // per-lane partial sum
  }
}
__device__ __forceinline__ void rescale_o(float (&o)[kORegs], const float (&rescale)[2]) {
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[4 * j + i] *= rescale[i / 2];
}
// @cuir-end softmax

// DESC_ONCE=1 (Fa3Config.desc_once, off; session 15): the dense kernel's three consumers (D 64's
// 192 x 128) build each GEMM's descriptors once and add the k-steps (kNewCodegen's form), without
// the rest of session 10's change (the producer loop). Session 15 SASS (experiments/
// sass_step_count_fwd.py): D 64's steady step carries 93 uniform-datapath instructions and 8 R2UR
// against 59 / 0 at D 128 128 x 128 (FA4 D 128: 57 / 0), about 5 per HGMMA: the descriptor rebuilt
// per k-step (UIADD3, ULOP3, USHF, ULOP3, UMOV). An option until an H100 A/B shows it.
#ifndef DESC_ONCE
#define DESC_ONCE 0
#endif
constexpr bool kDescOnce = kNewCodegen || (DESC_ONCE && kDenseKernel && kConsumers == 3);

// @cuir-region qk
// S(64 x kBlockN) = Q_c(64 x D) K_n^T; both operands K-major in swizzled panels.
__device__ __forceinline__ void gemm_qk(float (&s)[kSRegs], uint32_t q_rows, uint32_t k_tile) {
  wgmma_fence();
  // One descriptor per operand, the k-steps added to its address field (16-byte units), as
  // CUTLASS iterates them: ptxas builds each descriptor once instead of per HGMMA (session 9 A/B,
  // `uniform_desc`: +3-5% at D 128 8k / 16k, fa4fwd_ab.json). No carry out of the 14-bit field
  // (addresses < 2^18 B: the shared window is 228 KB), so these are the same bits as make_desc's.
  // Lowered variants and three consumers: a descriptor per k-step (kDescOnce: kNewCodegen, DESC_ONCE).
  const uint64_t a0 = make_desc(q_rows, 1 * kDescUnit, kSwizzleAtomBytes);
  const uint64_t b0 = make_desc(k_tile, 1 * kDescUnit, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
    const int panel = kk / kKStepsPerPanel, step = (kk % kKStepsPerPanel) * kKStepBytes;
    const int qo = panel * kQPanelBytes + step, ko = panel * kKVPanelBytes + step;   // byte offsets
    const uint64_t a = kDescOnce ? a0 + uint64_t(qo / kDescUnit)
                                  : make_desc(q_rows + qo, 1 * kDescUnit, kSwizzleAtomBytes);
    const uint64_t b = kDescOnce ? b0 + uint64_t(ko / kDescUnit)
                                  : make_desc(k_tile + ko, 1 * kDescUnit, kSwizzleAtomBytes);
    WgmmaSS<kBlockN, MmaTag>::mma(s, a, b, kk > 0);
  }
  wgmma_commit();
}
// @cuir-end qk

// @cuir-region pv
// O(64 x D) += P(64 x kBlockN, registers) V_n(kBlockN x D); V is MN-major (D contiguous), its
// panels of 64 columns kKVPanelBytes apart (leading offset), 8-row groups 1024 B apart (stride).
__device__ __forceinline__ void gemm_pv(float (&o)[kORegs], const uint32_t (&p)[kPRegs],
                                        uint32_t v_tile) {
  wgmma_fence();
  const uint64_t b0 = make_desc(v_tile, kKVPanelBytes, kSwizzleAtomBytes);   // k-steps added (gemm_qk)
#pragma unroll
  for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
    const uint64_t b = kDescOnce ? b0 + uint64_t(kk * kMmaK * kSwizzleBytes / kDescUnit)
                                  : make_desc(v_tile + kk * kMmaK * kSwizzleBytes, kKVPanelBytes, kSwizzleAtomBytes);
    WgmmaRS<kHeadDim, MmaTag>::mma(o, &p[4 * kk], b);
  }
  wgmma_commit();
}
// @cuir-end pv

__device__ __forceinline__ void convert_p(uint32_t (&p)[kPRegs], const float (&s)[kSRegs]) {
#pragma unroll
  for (int i = 0; i < kPRegs; ++i) p[i] = pack2(s[2 * i], s[2 * i + 1]);
}

#include "tiles.cuh"   // Smem, the K/V ring, work tiles (decode_tile) and the tile hand-over

// ------------------------------------------------------------------ register budgets
// Two consumers: 40 / 232. A producer that scans a block table for the consumers
// (kProducerReadsTable, set by a generated kv_range region) spilled under 40 (share_question, 62
// bytes); up to BLOCK_N 128 it takes 56 and the consumers 224, spill-free there (176-column
// consumers spill under 224). Every other kernel keeps 40 / 232.
// HEAD_DIM 256 with BLOCK_N > 64 (a 64 x 256 O accumulator: 128 registers per thread): 24 / 240,
// as FlashAttention-3 runs it. nvcc 13.0, 128 x 80 causal: under 232 the consumers spill 50 bytes;
// under 240 they spilled 2 (once per tile; 0 since the descriptors are built once per GEMM,
// session 10) and the one producer thread ~20 (0 since the 4-D maps: see head_map). 128 x 64 is
// spill-free under 40 / 232 and keeps it.
constexpr bool kScanningProducer = kProducerReadsTable && kConsumers == 2 && kBlockN <= 128;
constexpr bool kWideHead = kHeadDim == 256 && kBlockN > 64 && !kScanningProducer;
constexpr int kProducerRegs = kConsumers == 2 ? (kScanningProducer ? 56 : kWideHead ? 24 : 40) : 32;
constexpr int kConsumerRegs = kConsumers == 2 ? (kScanningProducer ? 224 : kWideHead ? 240 : 232) : 160;
static_assert(kProducerRegs * kWgThreads + kConsumerRegs * kConsumers * kWgThreads <=
                  kEntryRegs * kThreads,
              "setmaxnreg budgets exceed the CTA's register allocation (consumers would hang)");
// The warpgroup index made provably warp-uniform (entry point), where the producer and the
// consumers have the registers for it: with a 24- (D 256 128 x 80) or 32-register producer (three
// consumers) ptxas spilled 4-12 bytes, with 224-register consumers (a block-table producer,
// share_question at 128 x 128) 6 -> 30 bytes.
constexpr bool kUniformWg = kNewCodegen && kProducerRegs >= 40 && kConsumerRegs >= 232;
// UNIFORM_Q where kUniformWg is off (128 x 80; 128 x 64 has it). Spill-free (nvcc 13.0) at 128 x 80 causal and
// full, with or without turns, f / r / k / z, once the consumers recompute num_m / num_tiles after the role
// split (entry point: without that, full attention spilled them, 4-8 bytes). Static steady step, 128 x 80 fr
// (experiments/sass_step_count.py --fwd): causal 537 -> 468 warp instructions (R2UR 32 -> 0, IMAD 35 -> 4,
// IADD3 16 -> 0), full 515 -> 499 (R2UR 32 -> 10: ptxas parks 5 of the 16 Q descriptors in vector registers).
constexpr bool kUniformQ = UNIFORM_Q && kHeadDim == 256 && !kUniformWg;

// ------------------------------------------------------------------ producer
// L2 policies of the loads (L2_HINTS, full attention only; FlashAttention-3's choice): K and V are
// re-read by every query block of their head, Q once per tile. Causal lost 1-2% with them
// (session 9, fa4fwd_ab.json: its tiles of all heads run at once, longest first).
constexpr bool kL2Hints = L2_HINTS && !kCausal;
constexpr uint64_t kQPolicy = kL2Hints ? kL2EvictFirst : 0;
constexpr uint64_t kKVPolicy = kL2Hints ? kL2EvictLast : 0;
constexpr bool kKBeforeV = K_BEFORE_V && kHeadDim == 256;   // (see K_BEFORE_V above)
// The dense kv_range visits n_end - 1 down to 0: the tile before visit i is the next one up (a
// lowered variant's range, or a rotated one, is asked again). (The region's own constants are not
// visible here: a variant replaces them; the region's mark is.)
#if defined(FA3_DENSE_KV_RANGE) && !KV_ROTATE
constexpr bool kVisitsDescend = true;
#else
constexpr bool kVisitsDescend = false;
#endif
// tile_counter[0] is the dynamic scheduler's next-tile counter, tile_counter[1] counts producers
// past their last atomicAdd on it. The last producer out resets both, so the host keeps one
// zeroed pair per stream instead of zeroing one before every launch (a memset kernel and an
// allocation per call, which short sequences pay for).
__device__ __forceinline__ void release_tile_counter(int* tile_counter) {
  __threadfence();                                   // our last atomicAdd on [0] before [1]
  if (atomicAdd(tile_counter + 1, 1) == int(gridDim.x) - 1) {
    tile_counter[0] = 0;                             // every CTA is past [0]: none reads it again
    tile_counter[1] = 0;
  }
}

__device__ __forceinline__ void producer(const Smem& sm, const CUtensorMap* tm_q,
                                         const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                         const Problem& pb) {
#if PRODUCER_SLEEP
  // (PRODUCER_SLEEP) the producer's waits, the load regions' included, sleep in the barrier: this name
  // hides hopper_ptx.cuh's mbar_wait in the producer's body only
  const auto mbar_wait = [](uint32_t bar, int parity) { mbar_wait_sleep(bar, parity); };
#endif
  tma_prefetch_map(tm_q);
  tma_prefetch_map(tm_k);
  tma_prefetch_map(tm_v);
  int it = 0, q_iter = 0;
  for (int t = blockIdx.x, k = 0;; ++k) {
    const int slot = k % kTileSlots;                       // hand tile t to the consumers
    mbar_wait(sm.tile_empty + 8 * slot, ((k / kTileSlots) & 1) ^ 1);
    Tile tl{};
    if constexpr (kRangeViaSmem) {
      if (t < pb.num_tiles) tl = pb.tile(t);
#ifdef CUIR_FULL_BITS_HOOKS   // (a lowered block-table variant: the row's classes into L2 for the consumers' bitmap)
      if (t < pb.num_tiles) full_bits_prefetch(pb.va, tl.r);
#endif
      st_shared_words(sm.tile_slot + kTileSlotBytes * slot, TileMsg{t, tl});
    } else {
      st_shared_words(sm.tile_slot + kTileSlotBytes * slot, t);
    }
    mbar_arrive(sm.tile_full + 8 * slot);                  // release: the slot's stores first
    if (t >= pb.num_tiles) {
      release_tile_counter(pb.tile_counter);
      break;
    }
    if constexpr (!kRangeViaSmem) tl = pb.tile(t);
    const int tiles = kv_count(tl.r);
    // O_HALF: Q loads when the previous tile's last QK is done, an iteration before its first QK
    // here; into L2 now (two KV tiles ahead), that load is an L2 hit.
    if constexpr (kOHalf) {
      if (tiles > 0)
#pragma unroll
        for (int p = 0; p < kPanels; ++p) tma_prefetch_4d(tm_q, p * kPanelCols, tl.m0, tl.hm.h, tl.hm.b);
    }
    auto load_q = [&]() {
      const int qs = q_iter % kQSlots;
      // @cuir-region load_q
      mbar_wait(sm.q_empty + 8 * qs, ((q_iter / kQSlots) & 1) ^ 1);
      mbar_expect_tx(sm.q_full + 8 * qs, kQBytes);
#pragma unroll
      for (int p = 0; p < kPanels; ++p)
        tma_load_4d<kQPolicy>(sm.q_tile(qs) + p * kQPanelBytes, tm_q, sm.q_full + 8 * qs, p * kPanelCols,
                              tl.m0, tl.hm.h, tl.hm.b);
      // @cuir-end load_q
      ++q_iter;
    };
    // Two Q slots: this tile's Q goes first (its slot was freed by the tile before last, long
    // done), hiding its latency behind the tiles still in the ring.
    if (kQSlots > 1 && tiles > 0) load_q();
    // O staged in the only Q slot: a tile with no KV tile (rows before key 0) still writes its
    // zero O through that slot, so it takes the slot like any tile, without a load (a bare arrive
    // completes q_full's phase), and its epilogue frees it. Before this, its O overwrote the next
    // tile's Q as it landed (D 256, Nq > Nk causal: reruns differed).
    if (kOInQ && tiles == 0) {
      const int qs = q_iter % kQSlots;
      mbar_wait(sm.q_empty + 8 * qs, ((q_iter / kQSlots) & 1) ^ 1);
      mbar_arrive(sm.q_full + 8 * qs);
      ++q_iter;
    }
    // ptxas unrolls this loop twice, which spills 4-18 bytes in the 32-register producer of three
    // consumers (20 causal builds of the tuner's space). Not unrolled (experiments/patches/
    // three_consumer_unroll1.patch) it does not spill, but the mid call measured that together with
    // the descriptors 3-6% slower at D 64 (kNewCodegen): it waits for an A/B of its own.
    // kKBeforeV: V runs one iteration behind K (iteration i loads K_i, then V_{i-1}; one more
    // iteration loads the last V; a tile without KV tiles starts past it: its Q slot is taken above).
    // One V load site: with a second one after the loop the 24-register producer spilled 40 bytes.
    constexpr int kLag = kKBeforeV ? 1 : 0;
    const int i0 = tiles == 0 ? kLag : 0;
    for (int i = i0; i < tiles + kLag; ++i, ++it) {
      const int n = tile_at(tl.r, i), st = ring_stage(it), empty_parity = ring_phase(it) ^ 1;
      if (!kKBeforeV || i < tiles) {
      // @cuir-region load_kv
      mbar_wait(sm.k_empty + 8 * st, empty_parity);
      mbar_expect_tx(sm.k_full + 8 * st, kKVBytes);
#pragma unroll
      for (int p = 0; p < kPanels; ++p)
        tma_load_4d<kKVPolicy>(sm.k_tile(st) + p * kKVPanelBytes, tm_k, sm.k_full + 8 * st, p * kPanelCols,
                               n * kBlockN, tl.hm.bh_kv % pb.heads_kv, tl.hm.bh_kv / pb.heads_kv);
      // @cuir-end load_kv
      }
      // One Q slot: after the first K, so that the K load overlaps the wait for the slot.
      if (kQSlots == 1 && i == 0) load_q();
      if (kKBeforeV && i == 0) continue;
      // (kVisitsDescend: tile_at(i - 1) = n + 1, one live value less)
      const int nv = !kKBeforeV ? n : kVisitsDescend ? n + 1 : tile_at(tl.r, i - 1);
      const int sv = kKBeforeV ? ring_stage(it - 1) : st;
      const int v_parity = kKBeforeV ? ring_phase(it - 1) ^ 1 : empty_parity;
      mbar_wait(sm.v_empty + 8 * sv, v_parity);
      mbar_expect_tx(sm.v_full + 8 * sv, kKVBytes);
#pragma unroll
      for (int p = 0; p < kPanels; ++p)
        tma_load_4d<kKVPolicy>(sm.v_tile(sv) + p * kKVPanelBytes, tm_v, sm.v_full + 8 * sv, p * kPanelCols,
                               nv * kBlockN, tl.hm.bh_kv % pb.heads_kv, tl.hm.bh_kv / pb.heads_kv);
    }
    it -= kLag - i0;
    // Fetched after the loads (keeps the 24-register producer spill-free); its latency hides
    // behind the STAGES tiles the ring holds ahead of the consumers.
    t = gridDim.x + atomicAdd(pb.tile_counter, 1);
  }
}

// ------------------------------------------------------------------ consumer
struct Consumer {
  int c;            // consumer index
  int wg_thread;    // 0..127
  int lane;
  __device__ __forceinline__ void turn_wait() const { named_sync(kBarWgTurn0 + c, 2 * kWgThreads); }
  __device__ __forceinline__ void turn_pass() const {
    named_arrive(kBarWgTurn0 + (c + 1) % kConsumers, 2 * kWgThreads);
  }
  __device__ __forceinline__ void wg_sync() const { named_sync(kBarEpilogue0 + c, kWgThreads); }
  __device__ __forceinline__ void release(uint32_t bar) const {
    if (lane == 0) mbar_arrive(bar);
  }
};

__device__ __forceinline__ void epilogue(const Consumer& cs, const Smem& sm, const CUtensorMap* tm_o,
                                         float* __restrict__ lse, float (&o)[kORegs],
                                         const SoftmaxState& st, const Tile& tl, int seqlen_q,
                                         bool holds_q) {
  // @cuir-region epilogue
  const Frag f = frag_coords(cs.wg_thread);
  float inv[2], row_lse[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = st.row_sum[half];
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    const bool attended = sum > 0.f;                       // else: no key attended, O = 0, lse = -inf
    inv[half] = attended ? 1.f / sum : 0.f;
    row_lse[half] = attended ? st.row_max[half] + __logf(sum) : kNegInf;
  }
  const uint32_t o_rows = sm.o + cs.c * kOWgStride;        // this consumer's rows of the O stage
  if (cs.wg_thread == 0) tma_store_wait_read();            // the previous tile's store has read it
  cs.wg_sync();                                            // ... and every warp's last QK is done
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
    const int panel = j / (kPanelCols / 8), chunk = j % (kPanelCols / 8);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = f.row0 + 8 * half;
      const uint32_t addr = o_rows + panel * kOPanelBytes + row * kSwizzleBytes +
                            ((chunk ^ (row % 8)) * 16) + f.col0 * kElemBytes;
      const uint32_t val = pack2(o[4 * j + 2 * half] * inv[half], o[4 * j + 2 * half + 1] * inv[half]);
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(val) : "memory");
    }
  }
  fence_async_smem();
  cs.wg_sync();
  const int q_base = tl.m0 + cs.c * kWgRows;
  if (cs.wg_thread == 0) {
#pragma unroll
    for (int p = 0; p < kPanels; ++p)
      tma_store_4d(tm_o, o_rows + p * kOPanelBytes, p * kPanelCols, q_base, tl.hm.h, tl.hm.b);
    tma_store_commit();
  }
  if (cs.lane % 4 == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int q_idx = q_base + f.row0 + 8 * half;
      if (q_idx < seqlen_q) lse[size_t(tl.hm.bh_q) * seqlen_q + q_idx] = row_lse[half];
    }
  }
  if (kOInQ && holds_q) {           // O was staged in Q (one Q slot, slot 0): free it once read
    if (cs.wg_thread == 0) tma_store_wait_read();
    cs.wg_sync();
    cs.release(sm.q_empty);
  }
  // @cuir-end epilogue
}

#if TAIL_SPLIT
#include "tail_split.cuh"   // tail_epilogue: a chunk of a split tail tile, and the combine
#endif

#include "exp2_emu.cuh"   // EXP2_EMU (off): part of the exponentials on the FMA pipe
#include "tree_max.cuh"   // TREE_MAX (off): the softmax row max as a tree, both halves at once
#include "consumer.cuh"   // the consumer warpgroups' loop over tiles and KV tiles

}  // namespace fa3

// ------------------------------------------------------------------ entry point
// Grid: (G) with G <= number of tiles = ceil(Nq / BLOCK_M) * Hq * B; block: kThreads;
// dynamic smem: kSmemBytes; tile_counter[0..1] must be 0 at launch, and are 0 again after it.
extern "C" __global__ void __launch_bounds__(fa3::kThreads, 1)
fa3_sm90_fwd(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
             const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
             float* __restrict__ lse, int* __restrict__ tile_counter,
             const int* __restrict__ tile_order, int seqlen_q, int seqlen_k,
             int heads_q, int heads_kv, int batch, float softmax_scale,
             const __grid_constant__ fa3::VariantArgs va) {
  using namespace fa3;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + kSmemAlign - 1) & ~uint32_t(kSmemAlign - 1);
  Smem sm;
  sm.q = base + kOffQ;
  sm.k = base + kOffK;
  sm.v = base + kOffV;
  sm.o = base + kOffO;
  sm.q_full = base + kOffBar;
  sm.q_empty = sm.q_full + 8 * kQSlots;
  sm.k_full = sm.q_empty + 8 * kQSlots;
  sm.k_empty = sm.k_full + 8 * kStages;
  sm.v_full = sm.k_empty + 8 * kStages;
  sm.v_empty = sm.v_full + 8 * kStages;
  sm.tile_full = sm.v_empty + 8 * kStages;
  sm.tile_empty = sm.tile_full + 8 * kTileSlots;
  sm.tile_slot = sm.tile_empty + 8 * kTileSlots;
  const int num_m = (seqlen_q + kBlockM - 1) / kBlockM;
#if TAIL_SPLIT
  const TailPlan tail = tail_plan(num_m * heads_q * batch, seqlen_k);
  const Problem pb{seqlen_q, seqlen_k, heads_q, heads_kv, num_m, tail.items, tile_counter, tile_order, va,
                   tail.start, tail.split};
#else
  const Problem pb{seqlen_q, seqlen_k, heads_q, heads_kv, num_m, num_m * heads_q * batch,
                   tile_counter, tile_order, va};
#endif

  // kUniformWg: the warpgroup index through a lane-0 shuffle, which ptxas knows to be
  // warp-uniform, so a consumer's Q descriptors live in uniform registers (no R2UR of the Q
  // descriptor before each HGMMA: 128 x 176 full, 3136 -> 2936 SASS instructions with the
  // descriptors above). kUniformWg says where: elsewhere ptxas spilled with it.
  const int wg = kUniformWg ? __shfl_sync(kFullMask, int(threadIdx.x / kWgThreads), 0)
                            : int(threadIdx.x / kWgThreads);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kQSlots; ++s) {
      mbar_init(sm.q_full + 8 * s, 1);
      mbar_init(sm.q_empty + 8 * s, kEmptyArrivals);
    }
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.k_full + 8 * s, 1);
      mbar_init(sm.v_full + 8 * s, 1);
      mbar_init(sm.k_empty + 8 * s, kEmptyArrivals);
      mbar_init(sm.v_empty + 8 * s, kEmptyArrivals);
    }
    for (int s = 0; s < kTileSlots; ++s) {
      mbar_init(sm.tile_full + 8 * s, 1);
      mbar_init(sm.tile_empty + 8 * s, kConsumers * kWgThreads);
    }
    if (kOHalf) mbar_init(o_free_bar(sm), 1);               // O_HALF: the O stage read by its last store
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    reg_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) producer(sm, &tm_q, &tm_k, &tm_v, pb);
  } else {
    reg_alloc<kConsumerRegs>();
    // kUniformQ: the warpgroup index made provably warp-uniform here, in the consumers' branch only
    const int c = kUniformQ ? __shfl_sync(kFullMask, int(threadIdx.x / kWgThreads), 0) - 1 : wg - 1;
    const Consumer cs{c, int(threadIdx.x % kWgThreads), int(threadIdx.x % kWarpSize)};
    if constexpr (kUniformQ && !TAIL_SPLIT) {
      // kUniformQ: the tile counts recomputed after the split (opaque: not merged with pb's), so the values
      // computed before it are not live through the consumers' loop (full attention spilled them)
      Problem pbc = pb;
      pbc.num_m = (opaque(seqlen_q) + kBlockM - 1) / kBlockM;
      pbc.num_tiles = pbc.num_m * heads_q * batch;
      consumer(cs, sm, &tm_o, lse, pbc, softmax_scale);
    } else {
      consumer(cs, sm, &tm_o, lse, pb, softmax_scale);
    }
  }
}

// KV tiles each work tile visits: counts[bh * num_m + m_block] = kv_count(kv_range(...)), one
// thread per tile. The host orders the tiles by it (longest first) for the dynamic scheduler.
extern "C" __global__ void fa3_sm90_tile_counts(int* __restrict__ counts, int seqlen_q, int seqlen_k,
                                                int heads_q, int heads_kv, int batch,
                                                const __grid_constant__ fa3::VariantArgs va) {
  using namespace fa3;
  const int num_m = (seqlen_q + kBlockM - 1) / kBlockM;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= num_m * heads_q * batch) return;
  const int m_block = t % num_m, bh = t / num_m;
  const HeadMap hm = head_map(bh / heads_q, bh % heads_q, heads_q, heads_kv);
  counts[t] = kv_count(kv_range(va, hm.b, hm.h, m_block, m_block * kBlockM + seqlen_k - seqlen_q, seqlen_k,
                                seqlen_k));
}

// A marker: its name in a cubin's symbols says that the forward reads Q, K, V and writes O through
// 4-D maps (D, N, H, B). The host refuses a cubin without it (built before, for 3-D maps
// (D, N, B*H)), which would read the 4-D descriptors as 3-D ones: wrong heads, silently.
extern "C" __device__ int fa3_sm90_maps_4d = 4;
