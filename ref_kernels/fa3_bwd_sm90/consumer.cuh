// The consumer warpgroups of fa3_bwd_sm90 (included by kernel.cu inside namespace fa3b, after the
// regions and the producer). Fragment of a 64 x N f32 accumulator (per thread): element
// a[4j + 2h + e] is row 16 * warp + lane / 4 + 8h, column 8j + 2 * (lane % 4) + e.
#pragma once

struct Consumer {
  int c;            // consumer index: keys [n0 + 64c, n0 + 64c + 64)
  int wg_thread;    // 0 .. 127
  int lane;
  __device__ __forceinline__ int row0() const { return 16 * (wg_thread / kWarpSize) + lane / 4; }
  __device__ __forceinline__ int col0() const { return 2 * (lane % 4); }
  __device__ __forceinline__ void wg_sync() const { named_sync(kBarWg0 + c, kWgThreads); }
};

template <int kN> __device__ __forceinline__ void reg_fence_u(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
using fa3::reg_fence;

#include "dq_store.cuh"

// The descriptor of addr + off, from addr's: ISSUE 1 adds off / 16 to the low word's 14-bit start
// address field (shared addresses stay below 256 KB: no carry out of it), one uniform add per
// k-step; ISSUE 0 rebuilds it (make_desc: mask, shift, or).
__device__ __forceinline__ uint64_t desc_at(uint64_t desc0, uint32_t addr, uint32_t off, int lead, int stride) {
#if DESC64   // params.cuh DESC64: one 64-bit add, the high word kept (no carry out of the field: the same value)
  if constexpr (kIssue) return desc0 + off / kDescUnit;
#endif
  if constexpr (kIssue)
    return (desc0 & 0xffffffff00000000ull) | uint32_t(uint32_t(desc0) + off / kDescUnit);
  return make_desc(addr + off, lead, stride);
}

#if TILE_M80
#include "tile_m80.cuh"   // the dS store and dQ GEMM of the 80-row query tile (params.cuh TILE_M80)
#endif

// S^T (64 keys x 64 queries) = X_c T^T: X = K or V rows of this consumer, T = Q or dO of the
// stage; both K-major (D contiguous) in swizzled panels.
__device__ __forceinline__ void gemm_xt(float (&s)[kSRegs], uint32_t x_rows, uint32_t t_tile) {
  const uint64_t a0 = make_desc(x_rows, 1 * kDescUnit, kSwizzleAtomBytes);
  const uint64_t b0 = make_desc(t_tile, 1 * kDescUnit, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
    const int panel = kk / kKStepsPerPanel, step = (kk % kKStepsPerPanel) * kKStepBytes;
    const uint64_t a = desc_at(a0, x_rows, panel * kKVPanelBytes + step, 1 * kDescUnit, kSwizzleAtomBytes);
    const uint64_t b = desc_at(b0, t_tile, panel * kQPanelBytes + step, 1 * kDescUnit, kSwizzleAtomBytes);
    WgmmaSS<kBlockM, MmaTag>::mma(s, a, b, kk > 0);
  }
}

// acc (64 keys x D) += A (64 keys x 64 queries, registers) T (64 queries x D, MN-major stage):
// dV += P^T dO and dK += dS^T Q.
__device__ __forceinline__ void gemm_rs(float (&acc)[kAccRegs], const uint32_t (&a)[kPRegs],
                                        uint32_t t_tile) {
  const uint64_t b0 = make_desc(t_tile, kQPanelBytes, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kBlockM / kMmaK; ++kk) {
    const uint64_t b = desc_at(b0, t_tile, kk * kRowStepBytes, kQPanelBytes, kSwizzleAtomBytes);
    WgmmaRS<kHeadDim, MmaTag>::mma(acc, &a[4 * kk], b);
  }
}

// dQ part (64 queries x 64 columns) = dS (queries x keys, from the dS^T slot: M-major) K (keys x
// D: N-major). Split N (D = 128): all 128 keys, columns [64c, 64c + 64). Split K (D = 64): own
// 64 keys, all columns.
__device__ __forceinline__ void gemm_dq(float (&dq)[kDqRegs], uint32_t ds_slot, uint32_t k_tile, int c) {
#if TILE_M80
  gemm_dq_m80(dq, ds_slot, k_tile, c);   // dQ^T = K^T dS^T (tile_m80.cuh)
#else
  const uint32_t a0 = ds_slot + (kDqSplitN ? 0 : c * kWgRows * kSwizzleBytes);
  const uint32_t b0 = k_tile + (kDqSplitN ? c * kKVPanelBytes : c * kWgRows * kSwizzleBytes);
  const uint64_t da = make_desc(a0, kDsBytes, kSwizzleAtomBytes), db = make_desc(b0, kKVPanelBytes, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kDqKSteps; ++kk) {
    const uint64_t a = desc_at(da, a0, kk * kRowStepBytes, kDsBytes, kSwizzleAtomBytes);
    const uint64_t b = desc_at(db, b0, kk * kRowStepBytes, kKVPanelBytes, kSwizzleAtomBytes);
    WgmmaSST<kDqCols, MmaTag>::mma(dq, a, b, kk > 0);
  }
#endif
}

__device__ __forceinline__ void pack_frag(uint32_t (&p)[kPRegs], const float (&s)[kSRegs]) {
#pragma unroll
  for (int i = 0; i < kPRegs; ++i) p[i] = pack2(s[2 * i], s[2 * i + 1]);
}

// dS^T rows of this consumer into the slot: [128 keys][64 queries], 128B-swizzled (the layout a
// TMA would write), so gemm_dq reads it as an M-major operand.
// ISSUE 1: 4 stmatrix.x4 per thread. The accumulator fragment of an 8 x 8 block (lane holds row
// lane / 4, columns 2 (lane % 4) + {0, 1}) is stmatrix's source layout; one instruction stores the
// blocks (column block j + i / 2, row half i % 2) = ds[2j + i], i = 0..3, and lane l gives the
// address of row l % 8 of block l / 8. In the slot the 16-byte chunk of column block jj of row r
// sits at jj ^ (r % 8); with j even, jj = j ^ (i / 2), so the chunk is j ^ t, t = (i / 2) ^ (l % 8).
__device__ __forceinline__ void store_ds_stsm(const Consumer& cs, uint32_t slot, const uint32_t (&ds)[kPRegs]) {
  const int i = cs.lane / 8, r = cs.lane % 8, t = (i / 2) ^ r;
  const int row = cs.c * kWgRows + 16 * (cs.wg_thread / kWarpSize) + 8 * (i % 2) + r;
  const uint32_t row_addr = slot + row * kSwizzleBytes;
#pragma unroll
  for (int j = 0; j < kBlockM / 8; j += 2)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(row_addr + ((j ^ t) * 16)), "r"(ds[2 * j]), "r"(ds[2 * j + 1]), "r"(ds[2 * j + 2]),
                 "r"(ds[2 * j + 3]) : "memory");
}
__device__ __forceinline__ void store_ds(const Consumer& cs, uint32_t slot, const uint32_t (&ds)[kPRegs]) {
#if TILE_M80
  store_ds_m80(cs, slot, ds);   // dS, K-major (tile_m80.cuh)
#else
  if constexpr (kIssue) {
    store_ds_stsm(cs, slot, ds);
    return;
  }
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = cs.c * kWgRows + cs.row0() + 8 * h;
      const uint32_t addr = slot + row * kSwizzleBytes + ((j ^ (row % 8)) * 16) + cs.col0() * kElemBytes;
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(ds[2 * j + h]) : "memory");
    }
#endif
}

// LSE (log2 units; +inf past Nq or for a row that attended nothing, so P = 0) and Dvec of one
// query row. Read where used (L1 hits): preloading all 16 of each per thread cost 32 registers
// at the peak and spilled 24 bytes at D = 128 causal.
struct RowTerms { float lse2; float dvec; };
__device__ __forceinline__ RowTerms row_terms(const float* __restrict__ lse, const float* __restrict__ dvec,
                                              size_t row_base, int q_row, int seqlen_q) {
  if (q_row >= seqlen_q) return RowTerms{kPosInf, 0.f};
  const float l = __ldg(lse + row_base + q_row);
  return RowTerms{l == kNegInf ? kPosInf : l * kLog2e, __ldg(dvec + row_base + q_row)};
}

// S^T -> P^T (in s) and dP^T -> dS^T (in dp), masked on partial steps. mask_pred sees positions
// (q_idx = row + q_shift, kv_idx); the keys are carried in the rows' frame (kv_row = kv_idx -
// q_shift; kv_idx < Nk iff kv_row < Nq), the shift read from shared memory (step_q_shift) at each
// step; mask_pred's two shifts cancel for causal. Each form kept here is the one ptxas left
// spill-free at D = 128 causal (a register for the shift: 8 bytes; one shared read reused: 12).
// One body with a runtime `partial` (two template copies spilled 12 bytes at D = 128 causal).
__device__ __forceinline__ void probs_and_ds(const VariantArgs& va, bool partial, const Consumer& cs,
                                             float (&s)[kSRegs], float (&dp)[kSRegs],
                                             const float* __restrict__ lse, const float* __restrict__ dvec,
                                             float scale_log2, const Problem& pb, int g, int m0) {
  const int kv_row_base = pb.n0 + cs.c * kWgRows + cs.row0() - step_q_shift();
  const size_t row_base = size_t(pb.bh_q(g)) * pb.seqlen_q;
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int q_row = m0 + 8 * j + cs.col0() + e;
      const RowTerms rt = row_terms(lse, dvec, row_base, q_row, pb.seqlen_q);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h + e, kv_row = kv_row_base + 8 * h;
        const bool keep = !partial || ((kv_row < pb.seqlen_q) &
                                        mask_pred(va, pb.b, pb.h_kv * pb.group + g, q_row + pb.q_shift(),
                                                  kv_row + pb.q_shift()));
        s[i] = kScoreModIdentity ? score(va, s[i], scale_log2, 0, 0, 0, 0)
               : score(va, s[i], scale_log2, pb.b, pb.h_kv * pb.group + g, q_row + pb.q_shift(), kv_row + pb.q_shift());
        softmax_bwd(va, s[i], dp[i], rt.lse2, rt.dvec, keep);
      }
    }
}

// An LSE / Dvec load that stays where it is written: asm volatile keeps it after the wgmma wait
// before it. With __ldg the compiler hoisted the second pass's 16 Dvec loads above the first
// pass (latency hiding), 16 more registers at the peak: 64-68 bytes of spill at D = 128.
__device__ __forceinline__ float ld_row_term(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// LSE_SMEM: a row term of the stage (asm volatile: stays after the stage's mbarrier wait).
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}

// ISSUE 1: the 16 LSE (or Dvec) values of this thread's query columns, loaded from the stage while a
// GEMM runs (8 ld.shared.v2 issued right after the S / dP GEMMs, or after dV), so the pass after
// the wgmma wait does not start with a shared-memory round trip. FA4 loads its LSE the same way.
// TILE_M80: the first M80_PRE of the 20 (default 18); the rest read in the pass (all 20 held through the P pass spilled
// 8 bytes at bf16: 128 dK / dV + 2 x 40 S^T / dP^T + 20 leave no room for the pass's temporaries)
#ifndef M80_PRE
#define M80_PRE 18
#endif
constexpr int kPreRegs = kIssue ? (kM80 ? M80_PRE : kBlockM / 4) : 1;
static_assert(kPreRegs % 2 == 0 || kPreRegs == 1, "row terms are preloaded in pairs");
__device__ __forceinline__ void preload_row_terms(float (&pre)[kPreRegs], const Consumer& cs, uint32_t tile) {
  if constexpr (kIssue && !kRowTerms) {   // a normalisation that reads no row terms: none loaded
#pragma unroll
    for (int j = 0; j < kPreRegs; ++j) pre[j] = 0.f;
  } else if constexpr (kIssue) {
#pragma unroll
    for (int j = 0; j < kPreRegs / 2; ++j)
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(pre[2 * j]), "=f"(pre[2 * j + 1])
                   : "r"(tile + 4 * (8 * j + cs.col0())));
  }
}

// SCHED 1's P^T pass (runs while the dP GEMM does); ds_only16 below is its dS^T pass. Two bodies
// (masked / unmasked): with one body and a runtime flag, the masked predicates were hoisted and
// saved to registers (P2R) and D = 128 causal fp16 spilled 16 bytes.
template <bool kPartial>
__device__ __forceinline__ void probs_body(const VariantArgs& va, const Consumer& cs, float (&s)[kSRegs],
                                           const float* __restrict__ lse, float scale_log2,
                                           const Problem& pb, int g, int m0, uint32_t lse_tile,
                                           const float (&lse_pre)[kPreRegs], int shift_pre,
                                           uint32_t (&pf16)[kPackRegs]) {
  constexpr bool partial = kPartial;
  // ROWS_EARLY: Nk - Nq as read before the GEMMs (a shared load here waits behind dP^T's HGMMAs)
  const int q_shift = kRowsEarly ? shift_pre : step_q_shift();
  const int kv_row_base = pb.n0 + cs.c * kWgRows + cs.row0() - q_shift;   // as probs_and_ds
  const size_t row_base = size_t(pb.bh_q(g)) * pb.seqlen_q;
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int q_row = m0 + 8 * j + cs.col0() + e;
      float lse2 = kPosInf;
      if constexpr (!kRowTerms) {   // unread (sigmoid, relu)
      } else if constexpr (kLseSmem) {
        lse2 = kIssue && 2 * j + e < kPreRegs ? lse_pre[(2 * j + e) % kPreRegs]
                                              : ld_shared_f32(lse_tile + 4 * (8 * j + cs.col0() + e));
      } else if (q_row < pb.seqlen_q) {
        const float l = ld_row_term(lse + row_base + q_row);
        lse2 = l == kNegInf ? kPosInf : l * kLog2e;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h + e, kv_row = kv_row_base + 8 * h;
        const bool keep = !partial || ((kv_row < pb.seqlen_q) &
                                        mask_pred(va, pb.b, pb.h_kv * pb.group + g, q_row + pb.q_shift(),
                                                  kv_row + pb.q_shift()));
        // score_mod's indices only where it reads them: computed (then unused) they changed the dense SASS
        const float x = kScoreModIdentity ? score(va, s[i], scale_log2, 0, 0, 0, 0)
                        : score(va, s[i], scale_log2, pb.b, pb.h_kv * pb.group + g, q_row + pb.q_shift(),
                                kv_row + pb.q_shift());
        if constexpr (kDsFactor) {   // P^T packed here (pair i - e, i - e + 1, as pack_frag), s[i] = dS's factor
          const float p = softmax_p(va, x, lse2, keep);
          const float f = kScoreGradOne ? softmax_dsf(va, p)
                          : softmax_dsf(va, p) * score_grad(va, s[i], scale_log2, pb.b, pb.h_kv * pb.group + g,
                                                            q_row + pb.q_shift(), kv_row + pb.q_shift());
          pf16[i / 2] = e == 0 ? __float_as_uint(p) : pack2(__uint_as_float(pf16[i / 2]), p);
          s[i] = f;
        } else {
          s[i] = softmax_p(va, x, lse2, keep);
        }
      }
    }
}
__device__ __forceinline__ void probs_only(const VariantArgs& va, bool partial, const Consumer& cs,
                                           float (&s)[kSRegs], const float* __restrict__ lse, float scale_log2,
                                           const Problem& pb, int g, int m0, uint32_t lse_tile,
                                           const float (&lse_pre)[kPreRegs], int shift_pre,
                                           uint32_t (&pf16)[kPackRegs]) {
  if (partial) probs_body<true>(va, cs, s, lse, scale_log2, pb, g, m0, lse_tile, lse_pre, shift_pre, pf16);
  else probs_body<false>(va, cs, s, lse, scale_log2, pb, g, m0, lse_tile, lse_pre, shift_pre, pf16);
}

// kSplitPasses false (a variant whose score_mod has a derivative other than 1, e.g. a softcap, or
// whose dS needs the unrounded P, relu): P^T and dS^T = dscore(P, dP) * score_mod' in one pass after
// both GEMMs, from the f32 scores (which SCHED 1's 16-bit P^T no longer has). LSE_SMEM only.
template <bool kPartial>
__device__ __forceinline__ void probs_ds_body(const VariantArgs& va, const Consumer& cs, float (&s)[kSRegs],
                                              float (&dp)[kSRegs], float scale_log2, const Problem& pb, int g,
                                              int m0, uint32_t lse_tile, uint32_t dvec_tile) {
  const int kv_row_base = pb.n0 + cs.c * kWgRows + cs.row0() - step_q_shift();   // as probs_and_ds
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int q_row = m0 + 8 * j + cs.col0() + e;
      const float lse2 = kRowTerms ? ld_shared_f32(lse_tile + 4 * (8 * j + cs.col0() + e)) : 0.f;
      const float dv = kRowTerms ? ld_shared_f32(dvec_tile + 4 * (8 * j + cs.col0() + e)) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h + e, kv_row = kv_row_base + 8 * h;
        const int h_q = pb.h_kv * pb.group + g, q_idx = q_row + pb.q_shift(), kv_idx = kv_row + pb.q_shift();
        const bool keep = !kPartial || ((kv_row < pb.seqlen_q) & mask_pred(va, pb.b, h_q, q_idx, kv_idx));
        const float p = softmax_p(va, score(va, s[i], scale_log2, pb.b, h_q, q_idx, kv_idx), lse2, keep);
        dp[i] = softmax_ds(va, p, dp[i], dv) * score_grad(va, s[i], scale_log2, pb.b, h_q, q_idx, kv_idx);
        s[i] = p;
      }
    }
}
__device__ __forceinline__ void probs_and_ds_smem(const VariantArgs& va, bool partial, const Consumer& cs,
                                                  float (&s)[kSRegs], float (&dp)[kSRegs], float scale_log2,
                                                  const Problem& pb, int g, int m0, uint32_t lse_tile,
                                                  uint32_t dvec_tile) {
  if (partial) probs_ds_body<true>(va, cs, s, dp, scale_log2, pb, g, m0, lse_tile, dvec_tile);
  else probs_ds_body<false>(va, cs, s, dp, scale_log2, pb, g, m0, lse_tile, dvec_tile);
}

// dS^T from the 16-bit P^T (SCHED 1): the f32 P^T dies at the pack, 32 registers fewer while dV
// runs under the dS pass. P is rounded once more than in SCHED 0 (the dV GEMM reads the same
// rounded P); the GPU test's rule decides whether that is acceptable.
__device__ __forceinline__ float unpack_lo(uint32_t w) {
#if DTYPE_BF16
  return __uint_as_float(w << 16);
#else
  float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(w)); return f;
#endif
}
__device__ __forceinline__ float unpack_hi(uint32_t w) {
#if DTYPE_BF16
  return __uint_as_float(w & 0xffff0000u);
#else
  float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(w)); return f;
#endif
}

// SCHED 1: dS^T = P^T (dP^T - Dvec) with P^T read back from its 16-bit pack.
__device__ __forceinline__ void ds_only16(const VariantArgs& va, const Consumer& cs, const uint32_t (&p16)[kPRegs],
                                          const float (&p32)[kSRegs],
                                          float (&dp)[kSRegs], const float* __restrict__ dvec, const Problem& pb,
                                          int g, int m0, uint32_t dvec_tile, const float (&dvec_pre)[kPreRegs]) {
  // m0 made opaque: otherwise the 16 row offsets and "q < Nq" predicates of the P pass are kept
  // for this one (CSE), 16+ registers across the peak: 60-68 bytes of spill at D = 128.
  asm volatile("" : "+r"(m0));
  const size_t row_base = size_t(pb.bh_q(g)) * pb.seqlen_q;
#pragma unroll
  for (int j = 0; j < kBlockM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int q_row = m0 + 8 * j + cs.col0() + e;
      const float dv = kIssue && 2 * j + e < kPreRegs ? dvec_pre[(2 * j + e) % kPreRegs]
                       : !kRowTerms ? 0.f
                       : kLseSmem ? ld_shared_f32(dvec_tile + 4 * (8 * j + cs.col0() + e))
                       : q_row < pb.seqlen_q ? ld_row_term(dvec + row_base + q_row) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * j + 2 * h + e;   // p16[i / 2] packs s[i - e] (low) and s[i - e + 1] (high)
        const float p = kDsFromP32 ? p32[i] : e == 0 ? unpack_lo(p16[i / 2]) : unpack_hi(p16[i / 2]);
        if constexpr (kDsFactor)
          dp[i] *= p32[i];   // the P pass's factor
        else
          dp[i] = softmax_ds(va, p, dp[i], dv);
      }
    }
}

// The stage's Q, dO (and LSE_SMEM's LSE / Dvec) are read: lane 0 of each warp arrives after its
// warp's wgmma wait, or every thread (ARRIVE_ALL, params.cuh: what racecheck can follow).
__device__ __forceinline__ void release_stage(const Consumer& cs, const Smem& sm, int st) {
  if (kArriveAll || cs.lane == 0) mbar_arrive(sm.q_empty() + 8 * st);
}

// dQ part out: atomics (DQ_MODE 0) or the shared buffer the writer warp adds (DQ_MODE 1).
__device__ __forceinline__ void emit_dq(const Consumer& cs, const Smem& sm, float* __restrict__ dq_accum,
                                        const float (&dq)[kDqRegs], int bh_q, int m0, int seqlen_q, int it) {
  if constexpr (kDqBulk) {
    const int num_m = (seqlen_q + kBlockM - 1) / kBlockM;
    put_dq_smem(cs, sm.dq(), dq, it, dq_accum + dq_tile_offset(bh_q, m0 / kBlockM, kDqSplitN ? cs.c : 0, num_m));
  } else {
    add_dq_atomic(cs, dq_accum, dq, bh_q, m0, seqlen_q);
  }
}

// dK (scaled) and dV rows of this consumer to global memory, rows below Nk.
__device__ __forceinline__ void store_rows(const Consumer& cs, uint16_t* __restrict__ out,
                                           const float (&acc)[kAccRegs], float mul, const Problem& pb) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int kv_idx = pb.n0 + cs.c * kWgRows + cs.row0() + 8 * h;
    if (kv_idx >= pb.seqlen_k) continue;
    uint16_t* row = out + (size_t(pb.bh_kv()) * pb.seqlen_k + kv_idx) * kHeadDim + cs.col0();
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
      *reinterpret_cast<uint32_t*>(row + 8 * j) = pack2(acc[4 * j + 2 * h] * mul, acc[4 * j + 2 * h + 1] * mul);
  }
}

#include "epilogue.cuh"

// Does this consumer's step (query tile m0 / kBlockM, its 64 keys) need the element mask?
__device__ __forceinline__ bool step_needs_mask(const VariantArgs& va, const Consumer& cs, const Problem& pb, int m0) {
  if constexpr (kRangeRuns)
    return q_step_partial(va, pb.b, pb.h_kv, pb.group, pb.n0, pb.n0 + cs.c * kWgRows, m0 / kBlockM, pb.seqlen_q,
                          pb.seqlen_k);
  return step_partial(m0, pb.n0 + cs.c * kWgRows - step_q_shift(), pb.seqlen_q);
}

// SCHED 1, one step: S^T and dP^T issued together; P^T computed while dP^T still runs; dV issued
// before the dS pass, which reads P^T back from its 16 bits; dQ and dK issued back to back; the dQ
// part written out while dK runs (FlashAttention-3/4's order, own code). With the f32 P^T kept
// through the dS pass instead (dV issued after it), D = 128 spilled 8-64 bytes in every variant
// of the ordering tried (NOTES.md).
__device__ __forceinline__ void overlap_step(const VariantArgs& va, const Consumer& cs, const Smem& sm,
                                             const Problem& pb, int st, int it, int g, int m0, uint32_t kr,
                                             uint32_t vr, uint32_t kt,
                                             float (&dk_acc)[kAccRegs], float (&dv_acc)[kAccRegs],
                                             uint32_t (&ds16)[kPRegs],
                                             const float* __restrict__ lse, const float* __restrict__ dvec,
                                             float* __restrict__ dq_accum, float scale_log2,
                                             uint32_t sched_release = 0u) {
  float s[kSRegs], dp[kSRegs];
  // A variant's mask test may read a block table: issued before the GEMMs, its load latency hides
  // under them (false and unused in the dense kernel).
  const bool variant_partial = kRangeRuns && step_needs_mask(va, cs, pb, m0);
  // PERSIST: the tile's last step has read its runs / list flags: the scheduler may overwrite them
  if constexpr (kPersist)
    if (sched_release != 0u) mbar_arrive(sched_release);
  // ROWS_EARLY (params.cuh): the LSE rows and the mask decision read before any HGMMA of the step is
  // queued, so their LDS do not wait behind the SS GEMMs' shared-memory reads
  float early_pre[kPreRegs];
  bool early_partial = false;
  int early_shift = 0;
  if constexpr (kRowsEarly >= 1) {
    preload_row_terms(early_pre, cs, sm.lse_tile(st));
    early_shift = step_q_shift();
    early_partial = !kRangeRuns && step_partial(m0, pb.n0 + cs.c * kWgRows - early_shift, pb.seqlen_q);
  }
  wgmma_fence();
  gemm_xt(s, kr, sm.q_tile(st));
  wgmma_commit();
  gemm_xt(dp, vr, sm.do_tile(st));
  wgmma_commit();
  float row_pre[kPreRegs];
  if constexpr (kRowsEarly == 0) preload_row_terms(row_pre, cs, sm.lse_tile(st));   // ISSUE 1: LSE under the S / dP GEMMs
  // ISSUE 1: the mask decision (a shared read of Nk - Nq) also before the wait
  const bool pre_partial = kRowsEarly ? early_partial : kIssue && !kRangeRuns && step_needs_mask(va, cs, pb, m0);
  const float (&lse_pre)[kPreRegs] = kRowsEarly ? early_pre : row_pre;
  // kSplitPasses false: score_mod' or dscore needs the f32 score, so P^T and dS^T in one pass after both
  if constexpr (kSplitPasses) wgmma_wait<1>();  // S^T landed, dP^T in flight
  else wgmma_wait<0>();
  reg_fence(s);
  if constexpr (kCarry) {   // CARRY: the previous step's dK (committed before S^T) has landed as well
    reg_fence(dk_acc);
    reg_fence_u(ds16);
    if (it > 0) release_stage(cs, sm, (it + kStages - 1) % kStages);
  }
  uint32_t pf16[kPackRegs];   // kDsFactor: P^T packed by the P pass (s then holds dS's factor)
  if constexpr (kSplitPasses) {
    probs_only(va, kRangeRuns ? variant_partial : kIssue ? pre_partial : step_needs_mask(va, cs, pb, m0), cs, s, lse,
               scale_log2, pb, g,
               m0, sm.lse_tile(st), lse_pre, early_shift, pf16);
  } else {
    reg_fence(dp);
    probs_and_ds_smem(va, variant_partial, cs, s, dp, scale_log2, pb, g, m0, sm.lse_tile(st), sm.dvec_tile(st));
  }
  uint32_t p16[kPRegs];
  if constexpr (kDsFactor) {
#pragma unroll
    for (int i = 0; i < kPRegs; ++i) p16[i] = pf16[i];
  } else {
    pack_frag(p16, s);
  }
  // ROWS_EARLY 2: Dvec before the dV GEMM's HGMMAs are queued (else after them, ISSUE 1)
  if constexpr (kSplitPasses && kRowsEarly >= 2) preload_row_terms(row_pre, cs, sm.dvec_tile(st));
  if constexpr (!kDvLate) {
    wgmma_fence();
    gemm_rs(dv_acc, p16, sm.do_tile(st));        // dV += P^T dO runs under the dS pass
    wgmma_commit();
  }
  if constexpr (kSplitPasses) {
    if constexpr (kRowsEarly < 2) preload_row_terms(row_pre, cs, sm.dvec_tile(st));   // ISSUE 1: Dvec under the dP / dV GEMMs
    if constexpr (kDvLate) wgmma_wait<0>();     // dP^T landed (DV_LATE: nothing else in flight)
    else wgmma_wait<1>();                        // dP^T landed
    reg_fence(dp);
    ds_only16(va, cs, p16, s, dp, dvec, pb, g, m0, sm.dvec_tile(st), row_pre);
  }
  pack_frag(ds16, dp);
  const uint32_t slot = sm.ds_slot(it % kDsSlots);
  store_ds(cs, slot, ds16);
  if constexpr (kDvLate) {   // DV_LATE (FA4's order): dV issued after the dS pass, runs under the barrier
    wgmma_fence();
    gemm_rs(dv_acc, p16, sm.do_tile(st));
    wgmma_commit();
  }
  fa3::fence_async_smem();                       // generic stores -> the wgmma (async proxy) reads
  dq_slot_wait(cs);
  if (kDqSplitN) named_sync(kBarDsReady, kConsumers * kWgThreads);
  else cs.wg_sync();
  if constexpr (!kDqFirst && !kDvLate) {
    wgmma_wait<0>();   // dV (long done: the dS pass, store and barrier ran under it) frees P^T's
    reg_fence(dv_acc); // registers before dQ's 32 are taken: waiting after the dQ issue spilled 8
    reg_fence_u(p16);  // bytes at D = 128 causal fp16 (SCHED 1's form)
  }
  float dq[kDqRegs];
  wgmma_fence();
  gemm_dq(dq, slot, kt, cs.c);
  wgmma_commit();
  if constexpr (kDqFirst || kDvLate) {   // SCHED 2 / DV_LATE: dQ queued behind dV, then dV waited for
    wgmma_wait<1>();
    reg_fence(dv_acc);
    reg_fence_u(p16);
    wgmma_fence();
  }
  gemm_rs(dk_acc, ds16, sm.q_tile(st));          // dK += dS^T Q
  wgmma_commit();
  wgmma_wait<1>();                               // dQ landed, dK in flight
  reg_fence(dq);
  emit_dq(cs, sm, dq_accum, dq, pb.bh_q(g), m0, pb.seqlen_q, it);
  if constexpr (!kCarry) {   // CARRY: waited for at the next step's first wait (or after the loop)
    wgmma_wait<0>();
    reg_fence(dk_acc);
    reg_fence_u(ds16);
    release_stage(cs, sm, st);
  }
}

__device__ __forceinline__ void consumer(const VariantArgs& va, const Consumer& cs, const Smem& sm,
                                         const Problem& pb, QRange qr, bool has_work, const float* __restrict__ lse,
                                         const float* __restrict__ dvec, float* __restrict__ dq_accum,
                                         uint16_t* __restrict__ dk, uint16_t* __restrict__ dv,
                                         float softmax_scale) {
  if (kDqBulk) {  // the query range again from an opaque Nq: computed before the warpgroup branch, its end
     // was live across setmaxnreg and spilled (4-8 bytes at D = 128, DQ_MODE 1)
    int nq = pb.seqlen_q;
    asm volatile("" : "+r"(nq));
    qr = q_range(pb.n0, nq, pb.seqlen_k - nq);
  }
  float dk_acc[kAccRegs], dv_acc[kAccRegs];
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) dk_acc[i] = dv_acc[i] = 0.f;
  const float scale_log2 = softmax_scale * kLog2e;
  const uint32_t k_rows = sm.k() + cs.c * kWgRows * kSwizzleBytes;
  const uint32_t v_rows = sm.v() + cs.c * kWgRows * kSwizzleBytes;
  if (has_work) mbar_wait(sm.kv_full(), 0);
  if constexpr (kOverlap) {
    // One flat loop, (g, m) derived from `it`: nested loops kept g, m, m_end and the group size
    // live, and g spilled (4 bytes, D = 128 causal fp16).
    const int steps = kRangeRuns ? q_runs_count() : qr.m_end - qr.m_begin, total = has_work ? steps * pb.group : 0;
    // ISSUE 1: (g, i) counted along (no division per step: ~30 instructions at the step's top,
    // where the tensor pipe has drained; they fit in uniform registers now).
    int g_run = 0, i_run = 0;
    // dS^T of the step (dK's A operand): loop-carried so that CARRY keeps it live until dK landed
    uint32_t ds16[kPRegs];
#pragma unroll
    for (int i = 0; i < kPRegs; ++i) ds16[i] = 0u;
    for (int it = 0; it < total; ++it) {
      const int g = kIssue ? g_run : it / steps, i = kIssue ? i_run : it - g * steps,
                m0 = (kRangeRuns ? q_runs_tile(i) : kMRotate || kMDescend ? sweep_tile(qr, i, steps)
                      : kIssue ? qr.m_begin + i : qr.m_begin + it - g * steps) * kBlockM,
                st = it % kStages;   // (ISSUE 0's form kept: its SASS stays as it was)
      if constexpr (kIssue) {
        i_run = i_run + 1 == steps ? 0 : i_run + 1;
        g_run += i_run == 0;
      }
      mbar_wait(sm.q_full() + 8 * st, (it / kStages) & 1);
      uint32_t kr = k_rows, vr = v_rows, kt = sm.k();   // opaque per step, as below
      asm volatile("" : "+r"(kr), "+r"(vr), "+r"(kt));
      overlap_step(va, cs, sm, pb, st, it, g, m0, kr, vr, kt, dk_acc, dv_acc, ds16, lse, dvec, dq_accum, scale_log2);
    }
    if constexpr (kCarry) {   // the last step's dK (waited for on every path: else ptxas injects a wait)
      wgmma_wait<0>();
      reg_fence(dk_acc);
      reg_fence_u(ds16);
      if (total > 0) release_stage(cs, sm, (total - 1) % kStages);
    }
    dq_drain(cs, total);   // DQ_WRITER: its last adds have read the slots
  }
  int it = 0;
  for (int g = 0; !kOverlap && has_work && g < pb.group; ++g)
    for (int m = qr.m_begin; m < qr.m_end; ++m, ++it) {
      const int st = it % kStages, m0 = m * kBlockM, bh_q = pb.bh_q(g);
      mbar_wait(sm.q_full() + 8 * st, (it / kStages) & 1);
      // K / V descriptors are loop-invariant: hoisted, 16 of them took 32 registers and spilled
      // 24 bytes at D = 128. An opaque copy per step keeps them recomputed (a few integer ops).
      uint32_t kr = k_rows, vr = v_rows, kt = sm.k();
      asm volatile("" : "+r"(kr), "+r"(vr), "+r"(kt));
      float s[kSRegs], dp[kSRegs];
      wgmma_fence();
      gemm_xt(s, kr, sm.q_tile(st));
      wgmma_commit();
      gemm_xt(dp, vr, sm.do_tile(st));
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(s);
      reg_fence(dp);
      probs_and_ds(va, step_partial(m0, pb.n0 + cs.c * kWgRows - step_q_shift(), pb.seqlen_q), cs, s, dp, lse, dvec,
                   scale_log2, pb, g, m0);
      uint32_t p16[kPRegs], ds16[kPRegs];
      pack_frag(p16, s);
      pack_frag(ds16, dp);
      wgmma_fence();
      gemm_rs(dv_acc, p16, sm.do_tile(st));
      gemm_rs(dk_acc, ds16, sm.q_tile(st));
      wgmma_commit();
      const uint32_t slot = sm.ds_slot(it % kDsSlots);
      store_ds(cs, slot, ds16);
      fa3::fence_async_smem();                 // generic stores -> the wgmma (async proxy) reads
      dq_slot_wait(cs);
      if (kDqSplitN) named_sync(kBarDsReady, kConsumers * kWgThreads);
      else cs.wg_sync();
      float dq[kDqRegs];
      wgmma_fence();
      gemm_dq(dq, slot, kt, cs.c);
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(dq);
      reg_fence(dk_acc);
      reg_fence(dv_acc);
      reg_fence_u(p16);                        // the dV / dK wgmmas read them until the wait
      reg_fence_u(ds16);
      release_stage(cs, sm, st);
      emit_dq(cs, sm, dq_accum, dq, bh_q, m0, pb.seqlen_q, it);
    }
  if constexpr (kEpilogue) {
    store_rows_staged(cs, sm, dk, dv, dk_acc, dv_acc, softmax_scale, pb);
  } else {
    store_rows(cs, dv, dv_acc, 1.f, pb);
    store_rows(cs, dk, dk_acc, softmax_scale, pb);
  }
  if (kDqBulk && !kDqWriter && cs.wg_thread == 0) {   // shared memory stays valid until read
    if constexpr (kLean) bulk_wait_read<0>();   // params.cuh LEAN
    else bulk_wait_all();
  }
}
