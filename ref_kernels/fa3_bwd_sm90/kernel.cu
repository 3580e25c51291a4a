// FlashAttention-3-class backward attention for Hopper (sm_90a): TMA + wgmma, warp-specialised.
// Computes dK, dV and an fp32 dQ accumulator; D = rowsum(dO * O), the zeroing of the accumulator
// and dQ = accumulator * scale are the portable backward's fa2_bwd_preprocess /
// fa2_bwd_dq_convert (ref_kernels/fa2_bwd_sm80/kernel.cu), launched around this kernel.
//
// Build: nvcc -cubin -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I<this dir> \
//        [-DHEAD_DIM=128 -DIS_CAUSAL=0 -DDTYPE_BF16=1] kernel.cu
//
// Glossary
//   B, Hq, Hkv, G   batch, query heads, kv heads, G = Hq / Hkv query heads per kv head
//   Nq, Nk          query / key lengths (>= 1; TMA zero-fills tails, which are masked)
//   q_idx           a query's position: row + q_shift, q_shift = Nk - Nq (queries aligned to the
//                   end of the keys, as the forward kernels; with Nq > Nk the first Nq - Nk rows
//                   see no key: their LSE is -inf, so P = 0 and they contribute nothing)
//   D               head dimension (HEAD_DIM); "Dvec" is the softmax backward's row term
//   CTA             one (KV tile n of 128 keys, kv head, batch): blockIdx = (n, kv head, batch), or
//                   decoded from blockIdx.x (TILE_ORDER 2: tile_coord, sections of l2_section
//                   (batch, kv head) pairs)
//   producer        WG 0; one thread loads K, V once, then streams (Q, dO) tiles of 64 queries
//                   of every query head of the group through the kStages ring
//   consumer c      WG c + 1; owns keys [n0 + 64c, n0 + 64c + 64): its dK, dV rows in registers
//   step            one (query head g, query tile m) of the CTA's loop; `it` counts steps
//   S^T, dP^T       K_c Q^T and V_c dO^T: 64 keys x 64 queries, f32 registers (keys are rows,
//                   so P^T and dS^T are already the A operands of the dV and dK GEMMs)
//   P^T             exp(S^T * scale - LSE[q]); dS^T = P^T * (dP^T - Dvec[q])
//   dS slot         smem copy of dS^T [128 keys][64 queries] (q contiguous, swizzled) that dQ reads
//   dq_accum        fp32 [B, Hq, Nq, D]; dQ += dS K is added with red.global.add.v2.f32
//   full / empty    mbarriers: "TMA filled this stage" / "every consumer warp (ARRIVE_ALL: thread) is
//                   done with it"
//
// Lifting map (@cuir-region / @cuir-end): extra_io, q_range, mask_pred, score, softmax_bwd.
#if !defined(__CUDACC_RTC__)
#include <cuda.h>
#include <stdint.h>
#else
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#endif

#include "../fa3_sm90/wgmma.cuh"
#include "wgmma_t.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef IS_CAUSAL
#define IS_CAUSAL 0
#endif
#ifndef DTYPE_BF16
#define DTYPE_BF16 1
#endif
#ifndef DQ_MODE
#define DQ_MODE 0
#endif
#ifndef SCHED
#define SCHED 0
#endif
#ifndef LSE_SMEM
#define LSE_SMEM 0
#endif
#ifndef TILE_ORDER
#define TILE_ORDER 0
#endif
#ifndef ARRIVE_ALL
#define ARRIVE_ALL 0
#endif
#ifndef LEAN
#define LEAN 0
#endif
#ifndef ISSUE
#define ISSUE 0
#endif
#ifndef EPILOGUE
#define EPILOGUE 0
#endif
#ifndef CARRY
#define CARRY 0
#endif
#ifndef DV_LATE
#define DV_LATE 0
#endif
#ifndef DQ_WRITER
#define DQ_WRITER 0
#endif
#ifndef ROWS_EARLY
#define ROWS_EARLY 0
#endif
#ifndef M_ROTATE
#define M_ROTATE 0
#endif
#ifndef PERSIST
#define PERSIST 0
#endif
// GQA_SPLIT s > 1 (session 14, off until an H100 run proves it): a GQA group's G query heads are
// split over s CTAs per KV tile, G / s heads each (the launcher passes heads_kv * s "virtual kv
// heads" and group G / s, so bh_q and every hook's query head stay exact); the s CTAs of one KV
// tile write fp32 partial dK / dV that fa3_bwd_dkdv_sum adds in a fixed order (bitwise repeatable).
#ifndef GQA_SPLIT
#define GQA_SPLIT 1
#endif
// BNHD 1 (session 14, off until an H100 run proves it): the caller's layout. Q, K, V, dO through 4-D
// TMA maps (D, N, H, B) built from the tensors' own strides (any 16-byte-aligned view, as the
// forward's), and O, dO (preprocess), dQ (convert), dK, dV (epilogue) addressed as [B, N, H, D]
// memory: the layout a transformers model hands over, so its views need no copies either way.
#ifndef BNHD
#define BNHD 0
#endif

#include "../fa3_sm90/hopper_ptx.cuh"   // after DTYPE_BF16: pack2 reads it
#include "params.cuh"

namespace fa3b {
constexpr int kGqaSplit = GQA_SPLIT;
static_assert(kGqaSplit == 1 || kGqaSplit == 2 || kGqaSplit == 4 || kGqaSplit == 8 || kGqaSplit == 16,
              "GQA_SPLIT must be 1 (off) or a power of two up to 16");
static_assert(kGqaSplit == 1 || EPILOGUE == 1, "GQA_SPLIT > 1 writes its fp32 partials in EPILOGUE 1's place");
constexpr bool kBnhd = BNHD == 1;
static_assert(BNHD == 0 || (BNHD == 1 && LEAN == 1 && EPILOGUE == 1),
              "BNHD=1 needs LEAN=1 (its preprocess reads O / dO) and EPILOGUE=1 (its stores write dK / dV)");
using fa3::fast_exp2; using fa3::make_desc; using fa3::mbar_arrive; using fa3::mbar_expect_tx;
using fa3::mbar_init; using fa3::mbar_wait; using fa3::named_arrive; using fa3::named_sync; using fa3::pack2;
using fa3::tma_load_3d; using fa3::wgmma_commit; using fa3::wgmma_fence; using fa3::wgmma_wait;
using fa3::kDescUnit;

// ------------------------------------------------------------------ regions
// A variant (cubridge/lower/fa3_bwd_sm90.py) regenerates these five; the dense bodies below are
// what the reference computes, and each also defines the variant-only hooks (kRangeRuns,
// q_scan, q_step_partial, kScoreGradOne, score_grad) as no-ops so that the skeleton compiles the
// same instructions (the `if constexpr` branches on them vanish).
// @cuir-region extra_io
// A variant's extra kernel argument (captured tensors, shape scalars): none here.
struct VariantArgs { int unused; };
// @cuir-end extra_io

// @cuir-region q_range
// Query tiles [m_begin, m_end) (of rows) that may attend keys [n0, n0 + kBlockN): causal, row r
// sits at position r + q_shift and sees key j iff j <= r + q_shift, so the first tile holds row
// n0 - q_shift.
struct QRange { int m_begin; int m_end; };
__device__ __forceinline__ QRange q_range(int n0, int seqlen_q, int q_shift) {
  const int num_m = (seqlen_q + kBlockM - 1) / kBlockM;
  return QRange{kCausal ? min(num_m, max(n0 - q_shift, 0) / kBlockM) : 0, num_m};
}
// A step needs the mask when some pair of it is not attended or a key is past Nk. In the rows'
// frame: m0 the step's first row, kv_row0 = kv0 - q_shift the consumer's first key minus the
// shift (key kv0 + i is visible to row r iff kv_row0 + i <= r; kv0 + i < Nk iff kv_row0 + i < Nq).
// Rows past Nq need no mask: their LSE is +inf (P = 0).
__device__ __forceinline__ bool step_partial(int m0, int kv_row0, int seqlen_q) {
  return (kCausal && m0 < kv_row0 + kWgRows - 1) || kv_row0 + kWgRows > seqlen_q;
}
// Variants: the query tiles as runs that warp 0 scans into shared memory (q_scan), and a
// per-step mask test (q_step_partial); unused here.
constexpr bool kRangeRuns = false;
constexpr int kQRuns = 1;
__device__ __forceinline__ void q_scan(const VariantArgs& va, int b, int h_kv, int group, int n0, int len_q, int len_k,
                                       int* runs) {}
__device__ __forceinline__ bool q_step_partial(const VariantArgs& va, int b, int h_kv, int group, int n0, int kv_lo,
                                               int m, int len_q, int len_k) {
  return true;
}
// @cuir-end q_range

// @cuir-region mask_pred
__device__ __forceinline__ bool mask_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx) {
  return !kCausal || kv_idx <= q_idx;
}
// @cuir-end mask_pred

// @cuir-region score
// The forward's score in log2 units: x * scale_log2 (x = q.k); its derivative dscore/dx = scale
// is applied to dQ (in the convert kernel) and dK (in the epilogue). A variant's score_mod takes
// the natural score s = x * scale; kScoreGradOne false: dS also picks up d score_mod / d s.
// kScoreModIdentity: score reads no index (the skeleton then passes none).
constexpr bool kScoreModIdentity = true;
constexpr bool kScoreGradOne = true;
__device__ __forceinline__ float score(const VariantArgs& va, float x, float scale_log2, int b, int h, int q_idx,
                                       int kv_idx) {
  return x * scale_log2;
}
__device__ __forceinline__ float score_grad(const VariantArgs& va, float x, float scale_log2, int b, int h,
                                            int q_idx, int kv_idx) {
  return 1.f;
}
// @cuir-end score

// @cuir-region softmax_bwd
// P = exp(score - LSE) (log2 units), dS = P (dP - Dvec); masked pairs get P = 0, so dS = 0.
// kDsFromP16: dS may be computed from P rounded to 16 bits (SCHED 1's dS pass reads it back).
constexpr bool kDsFromP16 = true;
// kRowTerms: P / dS read the row terms LSE and Dvec. A lowered normalisation without them (sigmoid,
// relu; CUBRIDGE_BWD_ROWLESS=1) sets it false: the preprocess reads no O / dO, the producer loads no
// LSE / Dvec rows, the consumers read none.
constexpr bool kRowTerms = true;
// kDsFactor: the P pass leaves dS's factor f = softmax_dsf(P) * score_grad in the f32 P^T registers (P^T itself
// packed to 16 bits there) and the dS pass is dS = dP f. A lowered sigmoid / relu with CUBRIDGE_BWD_DS_FACTOR=1
// on ISSUE 2 options: a score_mod with a derivative (composite's softcap) keeps the split passes. Softmax's dS
// needs Dvec: false here.
constexpr bool kDsFactor = false;
__device__ __forceinline__ float softmax_dsf(const VariantArgs& va, float p) { return p; }
__device__ __forceinline__ void softmax_bwd(const VariantArgs& va, float& p, float& ds, float lse_log2,
                                            float dvec, bool keep) {
  p = keep ? fast_exp2(p - lse_log2) : 0.f;
  ds = p * (ds - dvec);
}
// The same two lines apart (SCHED 1 computes P while the dP GEMM still runs).
__device__ __forceinline__ float softmax_p(const VariantArgs& va, float p, float lse_log2, bool keep) {
  return keep ? fast_exp2(p - lse_log2) : 0.f;
}
__device__ __forceinline__ float softmax_ds(const VariantArgs& va, float p, float dp, float dvec) {
  return p * (dp - dvec);
}
// @cuir-end softmax_bwd
// A lowered variant runs on the bulk_overlap_lse path only (LSE / Dvec in shared memory, SCHED 1):
// the one the GPU measured fastest, and the only one whose per-step passes take the variant hooks.
static_assert(!kRangeRuns || (kLseSmem && kOverlap && kDqBulk), "a variant needs DQ_MODE=1 SCHED=1 LSE_SMEM=1");
// SCHED 1's split passes (P^T under the dP GEMM, dS^T from the 16-bit P^T), or one pass after both
// GEMMs from the f32 scores: a score_mod' != 1 needs the score, relu's [s > 0] the unrounded P. (ISSUE
// 2's dS pass reads the f32 P^T, so relu could split there: not yet run on a GPU, NOTES.md "Session 12".)
constexpr bool kSplitPasses = kDsFactor || (kScoreGradOne && kDsFromP16);
static_assert(!kDsFactor || kDsFromP32, "kDsFactor keeps the factor in the f32 P^T registers: ISSUE 2 only");
constexpr int kPackRegs = kDsFactor ? kPRegs : 1;   // kDsFactor: P^T packed in the P pass
static_assert(kSplitPasses || kRangeRuns, "the one-pass P / dS path is a variant's (kRangeRuns)");
static_assert(!kMRotate || !kRangeRuns, "M_ROTATE is dense only (a variant's runs order its own sweep)");
static_assert(!kMDescend || !kRangeRuns, "M_ROTATE 3 (descending) is dense only (a variant's runs order its own sweep)");

// ------------------------------------------------------------------ shared memory
// Nk - Nq for the consumers, re-read from shared memory at every step: held in a register across
// the step loop, it made ptxas spill 8 bytes at D = 128 causal.
__shared__ int g_q_shift;
__device__ __forceinline__ int step_q_shift() { return *static_cast<volatile int*>(&g_q_shift); }
// M_ROTATE (params.cuh): this CTA's first query tile of the sweep, as an offset into its range (0 for causal),
// written by thread 0 with g_q_shift and re-read per step (a register held through the loops would cost one
// more at the consumers' peak and in the producer's 24). Step i of a head visits tile m_begin + (i + rot) % steps.
__shared__ int g_m_rot;
__device__ __forceinline__ int sweep_tile(QRange qr, int i, int steps) {
  if constexpr (kMDescend) return qr.m_end - 1 - i;   // M_ROTATE 3: the last query tile first
  if constexpr (kMRotate) {
    const int r = i + *static_cast<volatile int*>(&g_m_rot);
    return qr.m_begin + (r >= steps ? r - steps : r);
  }
  return qr.m_begin + i;
}
// A TMA tile of rows [row, row + box) of head bh = b * heads + h: 3-D maps (D, N, B * H) of contiguous
// [B, H, N, D], or BNHD's 4-D maps (D, N, H, B) of any strides.
__device__ __forceinline__ void tma_rows(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int row, int b,
                                         int h, int heads) {
  if constexpr (kBnhd) fa3::tma_load_4d(dst, map, bar, col, row, h, b);
  else fa3::tma_load_3d(dst, map, bar, col, row, b * heads + h);
}
// Element offset of (head bh = b * heads + h, row) in contiguous [B, H, N, D], or in BNHD's [B, N, H, D].
__device__ __forceinline__ size_t io_row(long long bh, int row, int len, int heads) {
  if constexpr (kBnhd) {
    const long long b = bh / heads;
    return (size_t((b * len + row) * heads + (bh - b * heads))) * kHeadDim;
  }
  return (size_t(bh) * len + row) * kHeadDim;
}
// kRangeRuns (variants): warp 0's q_scan writes [count, lo_0, len_0, lo_1, len_1, ...]: the
// CTA's query tiles are runs [lo_k, lo_k + len_k), read back at every step (volatile: a few
// shared loads per step instead of 2 kQRuns + 1 registers held through the loops). A q_range
// region that defines FA3B_Q_TILE_LIST (an exact tile list) brings its own g_qruns, q_runs_count
// and q_runs_tile instead.
#ifndef FA3B_Q_TILE_LIST
__shared__ int g_qruns[1 + 2 * kQRuns];
__device__ __forceinline__ int q_runs_count() { return *static_cast<volatile int*>(&g_qruns[0]); }
__device__ __forceinline__ int q_runs_tile(int i) {
  const volatile int* runs = g_qruns;
#pragma unroll
  for (int k = 0; k < kQRuns - 1; ++k) {
    const int len = runs[2 + 2 * k];
    if (i < len) return runs[1 + 2 * k] + i;
    i -= len;
  }
  return runs[2 * kQRuns - 1] + i;
}
#endif
// One register (the aligned base); every region is base + a constant, folded into the shared
// memory instructions' immediate offsets. Ten separate addresses kept 8-10 more registers live
// through the consumer loop (4-8 bytes of spill at D = 128 with DQ_MODE 1).
struct Smem {
  uint32_t base;
  __device__ __forceinline__ uint32_t k() const { return base + kOffK; }
  __device__ __forceinline__ uint32_t v() const { return base + kOffV; }
  __device__ __forceinline__ uint32_t q() const { return base + kOffQ; }
  __device__ __forceinline__ uint32_t dout() const { return base + kOffDo; }
  __device__ __forceinline__ uint32_t ds() const { return base + kOffDs; }
  __device__ __forceinline__ uint32_t dq() const { return base + kOffDq; }
  __device__ __forceinline__ uint32_t kv_full() const { return base + kOffBar; }
  __device__ __forceinline__ uint32_t q_full() const { return kv_full() + 8; }
  __device__ __forceinline__ uint32_t q_empty() const { return q_full() + 8 * kStages; }
  // PERSIST only (persist.cuh; params.cuh counts them in kBarBytes)
  __device__ __forceinline__ uint32_t kv_empty() const { return q_empty() + 8 * kStages; }
  __device__ __forceinline__ uint32_t sched_full() const { return kv_empty() + 8; }
  __device__ __forceinline__ uint32_t sched_empty() const { return sched_full() + 8; }
  __device__ __forceinline__ uint32_t q_tile(int s) const { return q() + s * kQBytes; }
  __device__ __forceinline__ uint32_t do_tile(int s) const { return dout() + s * kQBytes; }
  __device__ __forceinline__ uint32_t ds_slot(int s) const { return ds() + s * kDsBytes; }
  __device__ __forceinline__ uint32_t lse_tile(int s) const { return base + kOffLse + s * kRowTermBytes; }
  __device__ __forceinline__ uint32_t dvec_tile(int s) const { return base + kOffDvec + s * kRowTermBytes; }
};

struct Problem {
  int seqlen_q, seqlen_k, heads_q, heads_kv, group;
  int b, h_kv, n0;
  // Nk - Nq: row r is query position r + q_shift (recomputed from the parameters where used: a
  // field held in a register spilled 8 bytes at D = 128 causal, ptxas)
  __device__ __forceinline__ int q_shift() const { return seqlen_k - seqlen_q; }
  __device__ __forceinline__ int bh_q(int g) const { return b * heads_q + h_kv * group + g; }
  __device__ __forceinline__ int bh_kv() const { return b * heads_kv + h_kv; }
};

// ------------------------------------------------------------------ tile order
// (KV tile, kv head, batch) of this CTA. TILE_ORDER 2: blockIdx.x runs over sections of `section`
// (batch, kv head) pairs, hb = b * Hkv + h; inside a section the tile is the slow index, so each
// section's tile 0s (causal: the longest) go out first, and only a section's heads stream Q / dO
// and reduce dQ at a time (the launcher sizes sections to L2). The last section may be narrower.
struct TileCoord { int n, h_kv, b; };
// Tile idx of TILE_ORDER 2's order over `total` tiles (the grid; PERSIST: its queue, persist.cuh).
__device__ __forceinline__ TileCoord tile_coord_at(int idx, int total, int seqlen_k, int heads_kv, int section) {
  const int num_n = (seqlen_k + kBlockN - 1) / kBlockN;
  const int total_hb = total / num_n, per_section = section * num_n;
  const int s = idx / per_section, r = idx - s * per_section, hb0 = s * section;
  const int width = min(section, total_hb - hb0);
  const int n = r / width, hb = hb0 + (r - n * width);
  return TileCoord{n, hb % heads_kv, hb / heads_kv};
}
__device__ __forceinline__ TileCoord tile_coord(int seqlen_k, int heads_kv, int section) {
  if constexpr (TILE_ORDER == 4) {   // TILE_ORDER 0's tiles from a 1-D grid
    const int num_n = (seqlen_k + kBlockN - 1) / kBlockN, idx = int(blockIdx.x), hb = idx / num_n;
    return TileCoord{idx - hb * num_n, hb % heads_kv, hb / heads_kv};
  }
  if constexpr (TILE_ORDER == 5) {   // TILE_ORDER 2's order, no division: grid (section, tiles, pairs / section)
    const int hb = int(blockIdx.x + gridDim.x * blockIdx.z);   // pair b * Hkv + h, x fastest: sections tile-major
    if constexpr (kBnhd) return TileCoord{int(blockIdx.y), hb % heads_kv, hb / heads_kv};   // 4-D maps need b, h
    return TileCoord{int(blockIdx.y), hb, 0};   // b folded into the head: bh_q / bh_kv / the 3-D maps read b * H + h
  }
  if constexpr (TILE_ORDER == 3)   // the 3-D grid linearised, x fastest
    return tile_coord_at(int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)),
                         int(gridDim.x * gridDim.y * gridDim.z), seqlen_k, heads_kv, section);
  if constexpr (kTileL2Sections) return tile_coord_at(int(blockIdx.x), int(gridDim.x), seqlen_k, heads_kv, section);
  return TileCoord{int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
}

// ------------------------------------------------------------------ producer
// LSE_SMEM: a non-tensor bulk copy global -> shared that completes on the stage's mbarrier.
__device__ __forceinline__ void bulk_load(uint32_t dst, const float* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// One (Q, dO) stage of step `it`: query head g, query tile m (with LSE_SMEM its LSE / Dvec rows).
__device__ __forceinline__ void load_stage(const Smem& sm, const CUtensorMap* tm_q, const CUtensorMap* tm_do,
                                           const Problem& pb, int g, int m, int it,
                                           const float* __restrict__ lse, const float* __restrict__ dvec) {
  const int st = it % kStages;
  mbar_wait(sm.q_empty() + 8 * st, ((it / kStages) & 1) ^ 1);
  mbar_expect_tx(sm.q_full() + 8 * st, 2 * kQBytes + (kLseSmem && kRowTerms ? 2 * kRowTermBytes : 0));
#pragma unroll
  for (int p = 0; p < kPanels; ++p) {
    tma_rows(sm.q_tile(st) + p * kQPanelBytes, tm_q, sm.q_full() + 8 * st, p * kPanelCols, m * kBlockM, pb.b,
             pb.h_kv * pb.group + g, pb.heads_q);
    tma_rows(sm.do_tile(st) + p * kQPanelBytes, tm_do, sm.q_full() + 8 * st, p * kPanelCols, m * kBlockM, pb.b,
             pb.h_kv * pb.group + g, pb.heads_q);
  }
  if constexpr (kLseSmem && kRowTerms) {   // padded [B * Hq, num_m * 64]: tile m of head bh_q is contiguous
    const size_t off = (size_t(pb.bh_q(g)) * ((pb.seqlen_q + kBlockM - 1) / kBlockM) + m) * kBlockM;
    bulk_load(sm.lse_tile(st), lse + off, kRowTermBytes, sm.q_full() + 8 * st);
    bulk_load(sm.dvec_tile(st), dvec + off, kRowTermBytes, sm.q_full() + 8 * st);
  }
}

__device__ __forceinline__ void producer(const Smem& sm, const CUtensorMap* tm_q,
                                         const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                         const CUtensorMap* tm_do, const Problem& pb, QRange qr,
                                         const float* __restrict__ lse, const float* __restrict__ dvec) {
  mbar_expect_tx(sm.kv_full(), 2 * kKVBytes);
#pragma unroll
  for (int p = 0; p < kPanels; ++p) {
    // GQA_SPLIT: virtual kv head h_kv = real head * s + slice, heads_kv = real heads * s
    tma_rows(sm.k() + p * kKVPanelBytes, tm_k, sm.kv_full(), p * kPanelCols, pb.n0, pb.b, pb.h_kv / kGqaSplit,
             pb.heads_kv / kGqaSplit);
    tma_rows(sm.v() + p * kKVPanelBytes, tm_v, sm.kv_full(), p * kPanelCols, pb.n0, pb.b, pb.h_kv / kGqaSplit,
             pb.heads_kv / kGqaSplit);
  }
  int it = 0;
  if constexpr (kRangeRuns) {
    const int count = q_runs_count();
    for (int g = 0; g < pb.group; ++g)
      for (int i = 0; i < count; ++i, ++it)
        load_stage(sm, tm_q, tm_do, pb, g, q_runs_tile(i), it, lse, dvec);
    return;
  }
  if constexpr (kMRotate) {   // the consumers' and the writer's order (sweep_tile)
    const int steps = qr.m_end - qr.m_begin;
    for (int g = 0; g < pb.group; ++g)
      for (int i = 0; i < steps; ++i, ++it) load_stage(sm, tm_q, tm_do, pb, g, sweep_tile(qr, i, steps), it, lse, dvec);
    return;
  }
  if constexpr (kMDescend) {   // the same tiles last first (sweep_tile); not unrolled, as BNHD's below
    for (int g = 0; g < pb.group; ++g)
#pragma unroll 1
      for (int m = qr.m_end - 1; m >= qr.m_begin; --m, ++it) load_stage(sm, tm_q, tm_do, pb, g, m, it, lse, dvec);
    return;
  }
  if constexpr (kBnhd) {   // not unrolled: ptxas unrolled x4 and spilled 4 bytes (the 4-D maps' extra coordinate)
    for (int g = 0; g < pb.group; ++g)
#pragma unroll 1
      for (int m = qr.m_begin; m < qr.m_end; ++m, ++it) load_stage(sm, tm_q, tm_do, pb, g, m, it, lse, dvec);
    return;
  }
  for (int g = 0; g < pb.group; ++g)
    for (int m = qr.m_begin; m < qr.m_end; ++m, ++it) load_stage(sm, tm_q, tm_do, pb, g, m, it, lse, dvec);
}

#include "consumer.cuh"
#include "persist.cuh"

}  // namespace fa3b

// ------------------------------------------------------------------ entry point
// Grid (ceil(Nk / 128), Hkv, B) (TILE_ORDER 2: (ceil(Nk / 128) * Hkv * B, 1, 1) with l2_section
// >= 1, ignored otherwise); block kThreads; dynamic smem kSmemBytes. lse [B, Hq, Nq] natural log; dvec [B, Hq, Nq]; dq_accum [B, Hq, Nq, D] zeroed; dk, dv [B, Hkv, Nk, D] 16-bit;
// group = heads_q / heads_kv. LSE_SMEM 1: lse and dvec are padded [B * Hq, ceil(Nq / 64) * 64]
// copies instead, lse in log2 units with +inf where P must be 0 (padding, rows that see no key).
// va: the variant's arguments (region extra_io; the dense kernel's is an unused int).
extern "C" __global__ void __launch_bounds__(fa3b::kThreads, 1)
fa3_bwd_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
             const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
             const float* __restrict__ lse, const float* __restrict__ dvec,
             float* __restrict__ dq_accum, uint16_t* __restrict__ dk, uint16_t* __restrict__ dv,
             int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int group, float softmax_scale,
             int l2_section, const __grid_constant__ fa3b::VariantArgs va
#if PERSIST
             , int* __restrict__ tile_ctr, int tiles_total
#endif
#if DQ_FUSE   // dq_store.cuh DQ_FUSE: the per-tile step counters and the 16-bit dQ the CTAs convert into
             , int* __restrict__ dq_ctr, uint16_t* __restrict__ dq_out
#endif
             ) {
  using namespace fa3b;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (fa3::smem_addr(smem_raw) + kSmemAlign - 1) & ~uint32_t(kSmemAlign - 1);
  const Smem sm{base};
#if PERSIST   // persist.cuh: the grid is min(tiles, SMs) CTAs looping over the tile queue
  persist_cta(va, sm, &tm_q, &tm_k, &tm_v, &tm_do, lse, dvec, dq_accum, dk, dv, seqlen_q, seqlen_k, heads_q, heads_kv,
              group, softmax_scale, l2_section, tile_ctr, tiles_total);
  return;
#endif
  // group = heads_q / heads_kv from the host: a parameter is read from the constant bank where
  // used, the division's result took a register through the consumer loop (12-40 bytes of spill
  // at D = 128 with DQ_MODE 1).
  const TileCoord tc = tile_coord(seqlen_k, heads_kv, l2_section);
  const Problem pb{seqlen_q, seqlen_k, heads_q, heads_kv, group, tc.b, tc.h_kv, tc.n * kBlockN};
  const QRange qr = q_range(pb.n0, seqlen_q, pb.q_shift());
  bool has_work = qr.m_begin < qr.m_end;   // else dK = dV = 0 and nothing is loaded

  if (threadIdx.x == 0) {
    g_q_shift = pb.q_shift();
    if constexpr (kMRotate) g_m_rot = m_rotation(tc.n, qr.m_end - qr.m_begin);
#if DQ_FUSE
    fuse_init(dq_accum, dq_out, seqlen_q, heads_q, softmax_scale);
#endif
    mbar_init(sm.kv_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.q_full() + 8 * s, 1);
      mbar_init(sm.q_empty() + 8 * s, kEmptyArrivals);
    }
    fa3::fence_barrier_init();
  }
  if constexpr (kRangeRuns)   // all 32 lanes: one tile predicate each per ballot
    if (threadIdx.x < kWarpSize) q_scan(va, pb.b, pb.h_kv, group, pb.n0, seqlen_q, seqlen_k, g_qruns);
  __syncthreads();
  if constexpr (kRangeRuns) has_work = q_runs_count() > 0;

  const int wg = threadIdx.x / kWgThreads;
  if (wg == 0) {
    fa3::reg_dealloc<kProducerRegs>();
    // DQ_WRITER (params.cuh): the warp index broadcast from lane 0 (ptxas then sees a warp-uniform
    // branch; with threadIdx.x / 32 the producer's loop spilled 104 bytes under its 24 registers,
    // D = 128 causal, even with an empty writer)
    if (kDqWriter && __shfl_sync(0xffffffffu, threadIdx.x / kWarpSize, 0) == kDqWriterWarp) {
#if DQ_FUSE
      dq_writer(sm, pb, qr, has_work, dq_accum, int(threadIdx.x % kWarpSize), FuseArgs{dq_ctr, dq_out});
    } else if (__shfl_sync(0xffffffffu, threadIdx.x / kWarpSize, 0) >= kFuseWarp0) {   // DQ_FUSE's converter warps
      fuse_converter(int(threadIdx.x % kWarpSize));
#else
      dq_writer(sm, pb, qr, has_work, dq_accum, int(threadIdx.x % kWarpSize));
#endif
    } else if (threadIdx.x == 0 && has_work) {
      fa3::tma_prefetch_map(&tm_q);
      fa3::tma_prefetch_map(&tm_do);
      producer(sm, &tm_q, &tm_k, &tm_v, &tm_do, pb, qr, lse, dvec);
    }
  } else {
    fa3::reg_alloc<kConsumerRegs>();
    // ISSUE 1: the index broadcast from lane 0, so ptxas sees it warp-uniform (params.cuh)
    const int c = kIssue ? __shfl_sync(0xffffffffu, wg - 1, 0) : wg - 1;
    const Consumer cs{c, int(threadIdx.x % kWgThreads), int(threadIdx.x % kWarpSize)};
    consumer(va, cs, sm, pb, qr, has_work, lse, dvec, dq_accum, dk, dv, softmax_scale);
#if DQ_FUSE
    fuse_tail();   // dq_store.cuh: the tiles whose last step was this CTA's
#endif
  }
}

// DQ_MODE 1's dQ = accumulator * scale, 16-bit, from the tiled accumulator (dq_store.cuh: blocks
// of kDqPartFloats per (bh, query tile, part) in fragment order; rows past Nq are padding).
// One thread per float4: rows r and r + 8, two columns. Grid ceil(chunks / 256), block 256.
extern "C" __global__ void __launch_bounds__(256)
fa3_bwd_dq_convert_tiled(const float* __restrict__ dq_accum, uint16_t* __restrict__ dq, int seqlen_q,
                         int num_m, long long chunks, float softmax_scale
#if BNHD
                         , int heads_q   // BNHD: dq is [B, N, Hq, D] memory
#endif
                         ) {
  using namespace fa3b;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  constexpr int kChunksPerPart = kDqPartFloats / 4;
  const long long blk = i / kChunksPerPart;
  const int within = int(i % kChunksPerPart), j = within / kWgThreads, t = within % kWgThreads;
  const int part = int(blk % kDqParts);
  const long long tile_bh = blk / kDqParts;
  const int m = int(tile_bh % num_m);
  const long long bh = tile_bh / num_m;
  const int row = m * kBlockM + 16 * (t / kWarpSize) + (t % kWarpSize) / 4;
  const int col = part * kDqCols + 8 * j + 2 * (t % 4);
  const float4 a = reinterpret_cast<const float4*>(dq_accum)[i];
#if BNHD
  if (row < seqlen_q)
    *reinterpret_cast<uint32_t*>(dq + io_row(bh, row, seqlen_q, heads_q) + col) =
        fa3::pack2(a.x * softmax_scale, a.y * softmax_scale);
  if (row + 8 < seqlen_q)
    *reinterpret_cast<uint32_t*>(dq + io_row(bh, row + 8, seqlen_q, heads_q) + col) =
        fa3::pack2(a.z * softmax_scale, a.w * softmax_scale);
#else
  if (row < seqlen_q)
    *reinterpret_cast<uint32_t*>(dq + (bh * seqlen_q + row) * kHeadDim + col) =
        fa3::pack2(a.x * softmax_scale, a.y * softmax_scale);
  if (row + 8 < seqlen_q)
    *reinterpret_cast<uint32_t*>(dq + (bh * seqlen_q + row + 8) * kHeadDim + col) =
        fa3::pack2(a.z * softmax_scale, a.w * softmax_scale);
#endif
}

#if TILE_M80   // its own convert (the accumulator holds dQ^T parts: tile_m80.cuh)
#define FA3B_M80_ENTRY 1
#include "tile_m80.cuh"
#endif

// DQ_CONVERT 2 (session 15, vbwd15; off: the runtime's CUBRIDGE_BWD_STAGED_CONVERT=1 builds it): the same dQ =
// accumulator * scale (the same multiply and pack2 per element: bitwise the tiled convert's dQ) with FA4's
// postprocess shape. One CTA of 128 threads per 64 x 64 part: each thread loads its 8 float4 of the part at once
// (8 loads in flight, not 1), the packed pairs go to a row-major shared tile (rows padded to 36 words: stores and
// 16-byte reads conflict-free), then every row leaves as 8 full 16-byte stores (4 whole sectors; the tiled convert
// writes 4-byte pieces, 16 bytes of a row per warp instruction). H100 early call, session 15: the tiled convert
// took 0.080 ms per 1k call (B 16 x 16 heads, D 128) against FA4's staged postprocess's 0.068. Contiguous [B, Hq,
// Nq, D] dq only (BNHD keeps the tiled convert). Grid: one CTA per part (accumulator floats / 4096), block 128.
#ifndef DQ_CONVERT
#define DQ_CONVERT 1
#endif
#if DQ_CONVERT == 2
static_assert(BNHD == 0, "DQ_CONVERT=2 writes contiguous [B, Hq, Nq, D] dq (BNHD keeps the tiled convert)");
extern "C" __global__ void __launch_bounds__(fa3b::kWgThreads)
fa3_bwd_dq_convert_staged(const float* __restrict__ dq_accum, uint16_t* __restrict__ dq, int seqlen_q, int num_m,
                          float softmax_scale) {
  using namespace fa3b;
  constexpr int kRowWords = kDqCols / 2 + 4;                   // bf16 / fp16 pairs per staged row + 16 B of pad
  constexpr int kRowVecs = kDqCols / 8;                        // 16-byte pieces per row of the part
  constexpr int kStores = kWgRows * kRowVecs / kWgThreads;     // per thread
  __shared__ __align__(16) uint32_t stage[kWgRows * kRowWords];
  const long long blk = blockIdx.x;                            // (bh, query tile m, part), as dq_tile_offset
  const int part = int(blk % kDqParts);
  const long long tile_bh = blk / kDqParts;
  const int m = int(tile_bh % num_m);
  const long long bh = tile_bh / num_m;
  const int t = threadIdx.x, r = 16 * (t / kWarpSize) + (t % kWarpSize) / 4, pair = t % 4;
  const float4* src = reinterpret_cast<const float4*>(dq_accum) + blk * (kDqPartFloats / 4);
  float4 a[kDqChunks];
#pragma unroll
  for (int j = 0; j < kDqChunks; ++j) a[j] = src[j * kWgThreads + t];   // fragment order (dq_store.cuh)
#pragma unroll
  for (int j = 0; j < kDqChunks; ++j) {                        // columns 8j + 2 pair + {0, 1} of rows r, r + 8
    stage[r * kRowWords + 4 * j + pair] = fa3::pack2(a[j].x * softmax_scale, a[j].y * softmax_scale);
    stage[(r + 8) * kRowWords + 4 * j + pair] = fa3::pack2(a[j].z * softmax_scale, a[j].w * softmax_scale);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kStores; ++k) {
    const int idx = k * kWgThreads + t, row = idx / kRowVecs, vec = idx % kRowVecs, q_row = m * kBlockM + row;
    if (q_row < seqlen_q)
      *reinterpret_cast<uint4*>(dq + (bh * seqlen_q + q_row) * kHeadDim + part * kDqCols + 8 * vec) =
          *reinterpret_cast<const uint4*>(&stage[row * kRowWords + 4 * vec]);
  }
}
#endif  // DQ_CONVERT

// LEAN 1's one launch before the backward (it replaces fa2_bwd_preprocess, the torch ops that made
// the padded LSE / Dvec copies and the zeroing of the accumulator's padding rows). Per padded row p
// of [B * Hq, padded_q] (padded_q = ceil(Nq / 64) * 64), row r = p % padded_q: Dvec = rowsum(dO * O)
// for r < Nq (fa2_bwd_preprocess's order of operations: both paths give bitwise equal Dvec) else 0;
// LSE in log2 units, +inf for padding and for rows that saw no key (natural-log -inf); and the
// row's D floats of the tiled dQ accumulator zeroed (it holds padded rows x D floats). One thread
// per 8 elements of a row. Grid ceil(padded_rows * D / 8 / 256), block 256. Built with LEAN 1 only
// (the other options' cubins stay as they were).
#if LEAN
extern "C" __global__ void __launch_bounds__(256)
fa3_bwd_preprocess(const uint16_t* __restrict__ o, const uint16_t* __restrict__ dout, const float* __restrict__ lse,
                   float* __restrict__ lse2, float* __restrict__ dvec, float* __restrict__ dq_accum, int seqlen_q,
                   int padded_q, long long padded_rows
#if BNHD
                   , int heads_q   // BNHD: o and dout are [B, N, Hq, D] memory
#endif
#if DQ_FUSE   // the accumulator is kept zero between calls; dQ rows of tiles no step visits (count 0) written here
                   , const int* __restrict__ dq_ctr, uint16_t* __restrict__ dq_out
#endif
                   ) {
  using namespace fa3b;
  constexpr int kChunk = 8, kRowChunks = kHeadDim / kChunk, kRowsPerBlock = 256 / kRowChunks;
  const long long p = static_cast<long long>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowChunks;
  const int chunk = threadIdx.x % kRowChunks;
  const long long bh = p / padded_q;
  const int row = int(p - bh * padded_q);
  const bool in_rows = p < padded_rows, real = in_rows && row < seqlen_q;
  float acc = 0.f;
  if (kRowTerms && real) {   // (no row terms: Dvec = 0, unread)
#if BNHD
    const long long off = io_row(bh, row, seqlen_q, heads_q) + chunk * kChunk;
#else
    const long long off = (bh * seqlen_q + row) * kHeadDim + chunk * kChunk;
#endif
    const uint4 a = *reinterpret_cast<const uint4*>(o + off);
    const uint4 d = *reinterpret_cast<const uint4*>(dout + off);
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = fmaf(unpack_lo(aw[i]), unpack_lo(dw[i]), acc);
      acc = fmaf(unpack_hi(aw[i]), unpack_hi(dw[i]), acc);
    }
  }
#if DQ_FUSE   // (contiguous dq: dq_fuse.cuh)
  if (real && dq_ctr[bh * (padded_q / kBlockM) + row / kBlockM] == 0)
    *reinterpret_cast<uint4*>(dq_out + (bh * seqlen_q + row) * kHeadDim + chunk * kChunk) = make_uint4(0, 0, 0, 0);
#else
  if (in_rows) {
    float4* z = reinterpret_cast<float4*>(dq_accum + p * kHeadDim + chunk * kChunk);
    z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#endif
#pragma unroll
  for (int w = 1; w < kRowChunks; w *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, w);   // the row's lanes
  if (in_rows && chunk == 0) {
    float l2 = kPosInf;
    if (real) {
      const float l = lse[bh * seqlen_q + row];
      l2 = l == kNegInf ? kPosInf : l * kLog2e;
    }
    lse2[p] = l2;
    dvec[p] = acc;
  }
}
#endif  // LEAN

#if DQ_FUSE
#include "dq_fuse.cuh"
#endif

// GQA_SPLIT s > 1's one launch after the backward: dV = sum of its s fp32 partials and dK = scale x
// the sum of its partials (partials [B * Hkv, s, Nk, D] row-major, added in slice order 0..s-1:
// the same bits every run), 16-bit, into dk / dv at the caller's element strides (batch, head, row;
// D contiguous, strides multiples of 4 elements: fa3_bwd_sm90.py checks). One thread per 4 floats of
// a row; blockIdx.y 0 is dV, 1 is dK. Grid (ceil(rows * D / 4 / 256), 2), block 256, rows = B * Hkv * Nk.
#if GQA_SPLIT > 1
extern "C" __global__ void __launch_bounds__(256)
fa3_bwd_dkdv_sum(const float* __restrict__ dk_part, const float* __restrict__ dv_part, uint16_t* __restrict__ dk,
                 uint16_t* __restrict__ dv, int heads_kv, int seqlen_k, long long rows, long long dk_sb,
                 long long dk_sh, long long dk_sn, long long dv_sb, long long dv_sh, long long dv_sn,
                 float softmax_scale) {
  using namespace fa3b;
  constexpr int kRowChunks = kHeadDim / 4;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * kRowChunks) return;
  const bool is_k = blockIdx.y == 1;
  const long long row = i / kRowChunks, bh = row / seqlen_k;
  const int col = int(i % kRowChunks) * 4, n = int(row - bh * seqlen_k);
  const float* part = (is_k ? dk_part : dv_part) + (bh * kGqaSplit * seqlen_k + n) * kHeadDim + col;
  const long long slice = static_cast<long long>(seqlen_k) * kHeadDim;
  float4 acc = *reinterpret_cast<const float4*>(part);
#pragma unroll
  for (int j = 1; j < kGqaSplit; ++j) {
    const float4 x = *reinterpret_cast<const float4*>(part + j * slice);
    acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
  }
  const float mul = is_k ? softmax_scale : 1.f;
  const long long b = bh / heads_kv, h = bh - b * heads_kv;
  uint16_t* out = is_k ? dk + b * dk_sb + h * dk_sh + n * dk_sn : dv + b * dv_sb + h * dv_sh + n * dv_sn;
  *reinterpret_cast<uint2*>(out + col) = make_uint2(pack2(acc.x * mul, acc.y * mul), pack2(acc.z * mul, acc.w * mul));
}
#endif  // GQA_SPLIT
