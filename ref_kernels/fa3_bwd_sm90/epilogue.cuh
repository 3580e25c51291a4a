// EPILOGUE 1 (params.cuh): a consumer's dK / dV rows leave through shared memory (included by
// consumer.cuh inside namespace fa3b, after dq_store.cuh). EPILOGUE 0 stores each row fragment
// straight to global memory: 64 STG.32 per thread, each warp instruction 8 rows x 16 bytes (half of
// every 32-byte sector); the only global traffic of our CTA besides the dQ adds, and what ncu's
// lg_throttle (0.15 per issue at causal 8k, FA4 0) points at: with one CTA per SM the next CTA
// waits for it. Here the fragments go to the consumer's two dQ slots (2 x 16 KB, free once its last
// bulk add has read them) by stmatrix, then each thread copies 16-byte chunks of whole rows
// (16 LDS.128 + 16 STG.128 at D = 128, 256-byte rows written in full).
#pragma once

// Row r of a staged tile (64 rows x D 16-bit) is D * 2 bytes; its 16-byte chunk cc sits at chunk
// cc ^ (r % 8): the 8 rows of an 8 x 8 block (stmatrix) and 8 consecutive chunks of a row (the copy)
// fall in distinct banks.
constexpr int kStageRowBytes = kHeadDim * kElemBytes;
constexpr int kStageChunks = kHeadDim / 8;                       // 16-byte chunks per row
constexpr int kStageCopies = kWgRows * kStageChunks / kWgThreads; // per thread and tensor
static_assert(kWgRows * kStageRowBytes <= kDqPartBytes, "a staged dK / dV tile must fit one dQ slot");

__device__ __forceinline__ void stage_rows(const Consumer& cs, uint32_t tile, const float (&acc)[kAccRegs], float mul) {
  const int i = cs.lane / 8, r = cs.lane % 8, t = (i / 2) ^ r;   // as store_ds_stsm
  const int row = 16 * (cs.wg_thread / kWarpSize) + 8 * (i % 2) + r;
  const uint32_t row_addr = tile + row * kStageRowBytes;
#pragma unroll
  for (int j = 0; j < kStageChunks; j += 2) {   // blocks (j + i / 2, half i % 2) = regs 4j/2 .. +3
    uint32_t p[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int jj = j + q / 2, h = q % 2;
      p[q] = pack2(acc[4 * jj + 2 * h] * mul, acc[4 * jj + 2 * h + 1] * mul);
    }
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(row_addr + ((j ^ t) * 16)), "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]) : "memory");
  }
}

// All loads first, then the stores (a load-store pair per chunk serialised 16 shared-memory round trips).
__device__ __forceinline__ void copy_rows(const Consumer& cs, uint32_t tile, uint16_t* __restrict__ out,
                                          const Problem& pb) {
  uint4 v[kStageCopies];
#pragma unroll
  for (int k = 0; k < kStageCopies; ++k) {
    const int q = cs.wg_thread + k * kWgThreads, row = q / kStageChunks, cc = q % kStageChunks;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                 : "r"(tile + row * kStageRowBytes + ((cc ^ (row % 8)) * 16)));
  }
#pragma unroll
  for (int k = 0; k < kStageCopies; ++k) {
    const int q = cs.wg_thread + k * kWgThreads, row = q / kStageChunks, cc = q % kStageChunks;
    const int kv_idx = pb.n0 + cs.c * kWgRows + row;
    if (kv_idx < pb.seqlen_k)
      *reinterpret_cast<uint4*>(out + io_row(pb.bh_kv(), kv_idx, pb.seqlen_k, pb.heads_kv) + cc * 8) = v[k];
  }
}

// GQA_SPLIT > 1: this CTA's share of dK (unscaled) or dV in fp32, row-major [B * Hkv * s, Nk, D]
// at the virtual kv head (kernel.cu Problem). Straight from the fragments: a warp's float2 stores
// cover 8 rows x 32 bytes, whole sectors, so there is nothing for staging to merge.
__device__ __forceinline__ void store_partial_f32(const Consumer& cs, float* __restrict__ out,
                                                  const float (&acc)[kAccRegs], const Problem& pb) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int kv_idx = pb.n0 + cs.c * kWgRows + cs.row0() + 8 * h;
    if (kv_idx >= pb.seqlen_k) continue;
    float* row = out + (size_t(pb.bh_kv()) * pb.seqlen_k + kv_idx) * kHeadDim + cs.col0();
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
      *reinterpret_cast<float2*>(row + 8 * j) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  }
}

// dV (slot 0 of this consumer) and dK * scale (slot 1) staged, then copied out. Thread 0 first waits
// until its last dQ bulk add has read the slots; the warpgroup barriers order the slot reuse and the
// stmatrix writes before the copy's reads.
__device__ __forceinline__ void store_rows_staged(const Consumer& cs, const Smem& sm, uint16_t* __restrict__ dk,
                                                  uint16_t* __restrict__ dv, const float (&dk_acc)[kAccRegs],
                                                  const float (&dv_acc)[kAccRegs], float softmax_scale,
                                                  const Problem& pb) {
  if constexpr (kGqaSplit > 1) {   // dk / dv point at the fp32 partials then (fa3_bwd_sm90.py)
    store_partial_f32(cs, reinterpret_cast<float*>(dv), dv_acc, pb);
    store_partial_f32(cs, reinterpret_cast<float*>(dk), dk_acc, pb);
    return;
  }
#if TILE_M80   // one 40 KB dQ slot: stage in the Q / dO stages (80 KB) once BOTH consumers' last GEMMs read them
  const uint32_t tile_v = sm.q() + cs.c * kWgRows * kStageRowBytes;
  const uint32_t tile_k = sm.q() + (kConsumers + cs.c) * kWgRows * kStageRowBytes;
  named_sync(kBarDsReady, kConsumers * kWgThreads);
#else
  const uint32_t tile_v = sm.dq() + cs.c * kDqPartBytes, tile_k = sm.dq() + (kConsumers + cs.c) * kDqPartBytes;
  if (!kDqWriter && cs.wg_thread == 0) bulk_wait_read<0>();   // DQ_WRITER: dq_drain waited instead
  cs.wg_sync();
#endif
  stage_rows(cs, tile_v, dv_acc, 1.f);
  stage_rows(cs, tile_k, dk_acc, softmax_scale);
  cs.wg_sync();
  copy_rows(cs, tile_v, dv, pb);
  copy_rows(cs, tile_k, dk, pb);
}
