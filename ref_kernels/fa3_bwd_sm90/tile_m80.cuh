// TILE_M80 (params.cuh; session 16, bwd16): the pieces of the 80-row query tile that differ from the 64-row one.
// Included twice: by consumer.cuh inside namespace fa3b (the dS store and the dQ GEMM), and at kernel.cu's end with
// FA3B_M80_ENTRY defined (the dQ convert of this tile's accumulator order). Off: nothing of it is compiled.
//
// Why dQ is transposed: wgmma's M is 64, so dQ (80 queries x D) cannot be an accumulator; dQ^T (64 D columns x 80
// queries) = K^T dS^T can (m64n80k16, FA4's and C++ FA3's "dQ_swapAB" for this tile). Its operands: A = K^T, the K
// tile as it is (keys x D, D contiguous: M-major, the 64-row build's B of the dQ GEMM), B = dS^T, which must be
// N = 80 queries x K = 128 keys; an MN-major B of N = 80 does not tile 128-byte swizzle atoms (64 elements), so dS is
// stored K-major instead: per consumer c a panel [80 queries][64 keys c] (128 B rows, swizzled as a TMA would write
// them), written from the dS^T fragments by stmatrix.trans (an 8 x 8 block of keys x queries lands as 8 query rows
// of 16 bytes of keys).
#ifndef FA3B_M80_ENTRY

// dS of this consumer's 64 keys into panel c of the slot. Fragment block (query block jj, key half h) is ds[2 jj + h]
// (keys 16 w + 8 h + lane / 4, queries 8 jj + 2 (lane % 4) + {0, 1}); with .trans, lane r of group i gives the address
// of memory row r = query 8 jj + r, whose 16-byte chunk of keys 16 w + 8 h is chunk (2 w + h) ^ (r % 8) of the row.
__device__ __forceinline__ void store_ds_m80(const Consumer& cs, uint32_t slot, const uint32_t (&ds)[kPRegs]) {
  const int i = cs.lane / 8, r = cs.lane % 8, w = cs.wg_thread / kWarpSize;
  const uint32_t base = slot + cs.c * kDsPanelBytes + (8 * (i / 2) + r) * kSwizzleBytes + (((2 * w + i % 2) ^ r) * 16);
#pragma unroll
  for (int j = 0; j < kBlockM / 8; j += 2)   // matrices (query block j + i / 2, key half i % 2) = ds[2j .. 2j + 3]
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(base + 8 * j * kSwizzleBytes), "r"(ds[2 * j]), "r"(ds[2 * j + 1]), "r"(ds[2 * j + 2]),
                 "r"(ds[2 * j + 3]) : "memory");
}

// dQ^T part (D columns [64c, 64c + 64) x 80 queries) = K^T dS^T over all 128 keys: A from K's panel c (M-major, 16
// keys = 16 rows per k-step), B from the dS panels (K-major, k-step kk in panel kk / 4).
__device__ __forceinline__ void gemm_dq_m80(float (&dq)[kDqRegs], uint32_t ds_slot, uint32_t k_tile, int c) {
  const uint32_t a0 = k_tile + c * kKVPanelBytes;
  const uint64_t da = make_desc(a0, kKVPanelBytes, kSwizzleAtomBytes);
  const uint64_t db = make_desc(ds_slot, 1 * kDescUnit, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
    const uint64_t a = desc_at(da, a0, kk * kRowStepBytes, kKVPanelBytes, kSwizzleAtomBytes);
    const uint64_t b = desc_at(db, ds_slot, (kk / kKStepsPerPanel) * kDsPanelBytes + (kk % kKStepsPerPanel) * kKStepBytes,
                               1 * kDescUnit, kSwizzleAtomBytes);
    WgmmaSTA<kBlockM, MmaTag>::mma(dq, a, b, kk > 0);
  }
}

static_assert(!kM80 || (kDqSplitN && kDsBytes == kConsumers * kDsPanelBytes && kDqRegs == kSRegs),
              "TILE_M80: dQ^T split by D columns over two consumers, dS as two K-major panels");

#else   // FA3B_M80_ENTRY: the dQ convert of TILE_M80's accumulator

// dQ = accumulator * scale, 16-bit, from TILE_M80's tiled accumulator: blocks of kDqPartFloats per (bh, query tile
// m, part p) in dQ^T fragment order (dq_store.cuh's order on the m64n80 fragment): float4 number j * 128 + t holds
// (column 64p + d, query 80m + q), (d, q + 1), (d + 8, q), (d + 8, q + 1), d = 16 (t / 32) + (t % 32) / 4, q = 8j +
// 2 (t % 4). One CTA of 128 threads per part: the 10 float4 loads at once, the 16-bit values transposed through
// shared memory (rows of 64 columns + 16 bytes of pad), then every query row of the part leaves as 8 16-byte
// stores. Rows past Nq are padding. Grid: one CTA per part (accumulator floats / kDqPartFloats), block 128.
extern "C" __global__ void __launch_bounds__(fa3b::kWgThreads)
fa3_bwd_dq_convert_m80(const float* __restrict__ dq_accum, uint16_t* __restrict__ dq, int seqlen_q, int num_m,
                       float softmax_scale
#if BNHD
                       , int heads_q   // BNHD: dq is [B, N, Hq, D] memory
#endif
                       ) {
  using namespace fa3b;
  constexpr int kPitch = kDqCols + 8;                          // 16-bit elements per staged row
  constexpr int kRowVecs = kDqCols / 8;
  constexpr int kStores = kBlockM * kRowVecs / kWgThreads;     // 5 per thread
  static_assert(kStores * kWgThreads == kBlockM * kRowVecs, "whole rows per CTA");
  __shared__ __align__(16) uint16_t stage[kBlockM * kPitch];
  const long long blk = blockIdx.x;
  const int part = int(blk % kDqParts);
  const long long tile_bh = blk / kDqParts;
  const int m = int(tile_bh % num_m);
  const long long bh = tile_bh / num_m;
  const int t = threadIdx.x, d = 16 * (t / kWarpSize) + (t % kWarpSize) / 4, q0 = 2 * (t % 4);
  const float4* src = reinterpret_cast<const float4*>(dq_accum) + blk * (kDqPartFloats / 4);
  float4 a[kDqChunks];
#pragma unroll
  for (int j = 0; j < kDqChunks; ++j) a[j] = src[j * kWgThreads + t];
#pragma unroll
  for (int j = 0; j < kDqChunks; ++j) {
    const int q = 8 * j + q0;
    const uint32_t lo = fa3::pack2(a[j].x * softmax_scale, a[j].z * softmax_scale);   // (d, q), (d + 8, q)
    const uint32_t hi = fa3::pack2(a[j].y * softmax_scale, a[j].w * softmax_scale);   // (d, q + 1), (d + 8, q + 1)
    stage[q * kPitch + d] = uint16_t(lo & 0xffffu);
    stage[q * kPitch + d + 8] = uint16_t(lo >> 16);
    stage[(q + 1) * kPitch + d] = uint16_t(hi & 0xffffu);
    stage[(q + 1) * kPitch + d + 8] = uint16_t(hi >> 16);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kStores; ++k) {
    const int idx = k * kWgThreads + t, row = idx / kRowVecs, vec = idx % kRowVecs, q_row = m * kBlockM + row;
    if (q_row < seqlen_q) {
#if BNHD
      uint16_t* dst = dq + io_row(bh, q_row, seqlen_q, heads_q) + part * kDqCols + 8 * vec;
#else
      uint16_t* dst = dq + (bh * seqlen_q + q_row) * kHeadDim + part * kDqCols + 8 * vec;
#endif
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&stage[row * kPitch + 8 * vec]);
    }
  }
}

#endif  // FA3B_M80_ENTRY
