// fa2_bwd_sm80/dkdv.cuh: the main backward kernel (included by kernel.cu after the regions).
//
// One CTA per (KV tile, kv head, batch). K and V of the tile stay in shared memory; the (query
// head, query tile) pairs it visits stream Q, dO, LSE and Dvec through a two-slot ring. Per pair:
//   S^T = K Q^T, P^T (recomputed from LSE), dP^T = V dO^T, dS^T = P^T (dP^T - Dvec)
//   dV += P^T dO, dK += dS^T Q           (registers, A operands straight from the C fragments)
//   dS^T -> shared memory, barrier, dQ_tile = dS K, red.add into dQaccum   (unless DETERMINISTIC)
// Barriers per pair: one at the top (the slot landed; the previous pair is done with the other
// slot and with the dS tile), one between the dS store and the dQ GEMM.
#pragma once

namespace fa2b {

constexpr int OFF_K = 0;
constexpr int OFF_V = OFF_K + KV_BYTES;
constexpr int OFF_Q = OFF_V + KV_BYTES;            // 2 slots
constexpr int OFF_DO = OFF_Q + 2 * QT_BYTES;       // 2 slots
constexpr int OFF_DS = OFF_DO + 2 * QT_BYTES;
constexpr int OFF_LSE = OFF_DS + DS_BYTES;         // 2 slots
constexpr int OFF_DVEC = OFF_LSE + 2 * VEC_BYTES;  // 2 slots
static_assert(OFF_DVEC + 2 * VEC_BYTES == SMEM_BYTES, "shared-memory map and SMEM_BYTES disagree");

struct DkdvCta {
  const elem_t *q, *dout;     // kernel parameters (constant bank)
  const float *lse, *dvec;
  float* dq_accum;
  const VariantArgs* va;
  unsigned char* smem;
  u32 s_base;                 // shared address of smem
  int tid, lane, warp;
  int b, h0, heads_q, len_q, len_k, kv_begin;
  int key_row0;               // kv_idx of this lane's first S^T fragment row
  float sm_scale;
  QRange qr;
  int count, total;           // query tiles per head, (head, tile) pairs
  u32 k_a, v_a;               // A lanes of K and V (this warp's key rows)
  u32 q_b, do_b, q_t, do_t;   // B lanes of Q and dO in slot 0: as X^T (b_rows) and transposed (bt_rows)
  u32 ds_at, k_t;             // dQ GEMM: dS read as A^T, K as B [k][n]
  int slot;

  __device__ __forceinline__ int head_of(int it) const { return h0 + it / count; }
  __device__ __forceinline__ int tile_of(int it) const { return q_tile_at(qr, it % count); }
  __device__ __forceinline__ i64 q_rows(int h) const { return (static_cast<i64>(b) * heads_q + h) * len_q; }

  // @cuir-region load_q
  // Q, dO tiles (rows >= Nq zero-filled) and their LSE, Dvec rows (0 past Nq) of pair `it` into
  // slot `fill`, one commit group; an empty group past the end keeps the wait counts uniform.
  __device__ __forceinline__ void prefetch(int it, int fill) {
    if (it < total) {
      const i64 rows = q_rows(head_of(it));
      const int q_begin = tile_of(it) * BLOCK_M;
      const TileLoader<HEAD_DIM, THREADS> ld(tid);
      ld.load<BLOCK_M>(s_base + OFF_Q + fill * QT_BYTES, q + rows * HEAD_DIM, q_begin, len_q);
      ld.load<BLOCK_M>(s_base + OFF_DO + fill * QT_BYTES, dout + rows * HEAD_DIM, q_begin, len_q);
      load_row_vec<BLOCK_M, THREADS>(s_base + OFF_LSE + fill * VEC_BYTES, lse + rows, q_begin, len_q, tid);
      load_row_vec<BLOCK_M, THREADS>(s_base + OFF_DVEC + fill * VEC_BYTES, dvec + rows, q_begin, len_q, tid);
    }
    cp_async_commit();
  }
  // @cuir-end load_q

  // dQ of this pair: dS^T (A fragments) -> dS tile [key][query], barrier, dQ = dS K, red.add.
  __device__ __forceinline__ void dq_tile(const u32 (&da)[KEY_TILES][QK_STEPS][4], int h, int q_begin) {
    const u32 ds = s_base + OFF_DS;
    const int g = lane / QUAD, tq = lane % QUAD;
#pragma unroll
    for (int mt = 0; mt < KEY_TILES; ++mt)
#pragma unroll
      for (int kk = 0; kk < QK_STEPS; ++kk) {
        const int row = warp * WARP_KEYS + mt * MMA_M + g;
        st_shared_u32(ds + swizzle<DS_ROW_BYTES>(row, 2 * kk) + 4 * tq, da[mt][kk][0]);
        st_shared_u32(ds + swizzle<DS_ROW_BYTES>(row + 8, 2 * kk) + 4 * tq, da[mt][kk][1]);
        st_shared_u32(ds + swizzle<DS_ROW_BYTES>(row, 2 * kk + 1) + 4 * tq, da[mt][kk][2]);
        st_shared_u32(ds + swizzle<DS_ROW_BYTES>(row + 8, 2 * kk + 1) + 4 * tq, da[mt][kk][3]);
      }
    __syncthreads();   // the whole dS tile is needed by every warp's dQ rows
    const int wm = warp % DQA_WM, wd = warp / DQA_WM;
    float acc[DQA_MT][DQA_NT][4];
    zero(acc);
    gemm_ss_atb<DQA_MT, DQA_NT, BLOCK_N / MMA_K, DS_ROW_BYTES, ROW_BYTES>(acc, ds_at, wm * DQA_MT, k_t,
                                                                         wd * DQA_NT / 2);
    // @cuir-region dq_accum
    float* head = dq_accum + q_rows(h) * HEAD_DIM + wd * DQA_NT * MMA_N + 2 * tq;
#pragma unroll
    for (int mt = 0; mt < DQA_MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q_idx = q_begin + (wm * DQA_MT + mt) * MMA_M + r * 8 + g;
        if (q_idx >= len_q) continue;
#pragma unroll
        for (int nt = 0; nt < DQA_NT; ++nt)
          red_add2(head + static_cast<i64>(q_idx) * HEAD_DIM + nt * MMA_N, acc[mt][nt][2 * r], acc[mt][nt][2 * r + 1]);
      }
    // @cuir-end dq_accum
  }

  template <bool PARTIAL>
  __device__ __forceinline__ void step(int it, float (&dk)[KEY_TILES][D_TILES][4], float (&dv)[KEY_TILES][D_TILES][4]) {
    cp_async_wait<0>();   // this pair's slot landed for this thread (and K, V before it)
    __syncthreads();      // ... for every thread; the previous pair is done with the other slot and dS
    prefetch(it + 1, slot ^ 1);
    const int h = head_of(it), q_begin = tile_of(it) * BLOCK_M, col0 = q_begin + 2 * (lane % QUAD);
    const float* lse_s = reinterpret_cast<const float*>(smem + OFF_LSE + slot * VEC_BYTES);
    const float* dvec_s = reinterpret_cast<const float*>(smem + OFF_DVEC + slot * VEC_BYTES);
    float s[KEY_TILES][QN_TILES][4], g[KEY_TILES][QN_TILES][4], dp[KEY_TILES][QN_TILES][4];
    zero(s);
    gemm_ss_abt<KEY_TILES, QN_TILES, D_STEPS, ROW_BYTES, ROW_BYTES>(s, k_a, q_b + slot * QT_BYTES);
    probs<PARTIAL, true>(*va, s, g, lse_s, b, h, key_row0, col0, len_q, len_k, sm_scale, q_begin, len_k - len_q);
    zero(dp);
    gemm_ss_abt<KEY_TILES, QN_TILES, D_STEPS, ROW_BYTES, ROW_BYTES>(dp, v_a, do_b + slot * QT_BYTES);
    dscores<true>(*va, dp, s, g, dvec_s, key_row0, col0, q_begin);
    u32 pa[KEY_TILES][QK_STEPS][4], da[KEY_TILES][QK_STEPS][4];
    to_a_frags(pa, s);
    gemm_rs_ab<KEY_TILES, D_TILES, QK_STEPS, ROW_BYTES>(dv, pa, do_t + slot * QT_BYTES, 0);
    to_a_frags(da, dp);
    gemm_rs_ab<KEY_TILES, D_TILES, QK_STEPS, ROW_BYTES>(dk, da, q_t + slot * QT_BYTES, 0);
#if !DETERMINISTIC
    dq_tile(da, h, q_begin);
#endif
    slot ^= 1;
  }
};

}  // namespace fa2b

extern "C" __global__ void __launch_bounds__(fa2b::THREADS, MIN_BLOCKS)
fa2_bwd_dkdv(const fa2b::elem_t* __restrict__ q, const fa2b::elem_t* __restrict__ k,
             const fa2b::elem_t* __restrict__ v, const fa2b::elem_t* __restrict__ dout,
             const float* __restrict__ lse, const float* __restrict__ dvec, float* __restrict__ dq_accum,
             fa2b::elem_t* __restrict__ dk, fa2b::elem_t* __restrict__ dv, int batch, int heads_q, int heads_kv,
             int len_q, int len_k, float sm_scale, const __grid_constant__ fa2b::VariantArgs va) {
  using namespace fa2b;
  extern __shared__ __align__(128) unsigned char smem[];
  const int kv_tile = blockIdx.x, kv_begin = kv_tile * BLOCK_N;   // causal: tile 0 is the heaviest

  // @cuir-region head_map
  const int b = blockIdx.z, h_kv = blockIdx.y;
  const int group = heads_q / heads_kv;          // GQA / MQA: query heads [h_kv G, h_kv G + G)
  const i64 kv_off = (static_cast<i64>(b) * heads_kv + h_kv) * len_k * HEAD_DIM;
  // @cuir-end head_map

  DkdvCta c;
  c.q = q; c.dout = dout; c.lse = lse; c.dvec = dvec; c.dq_accum = dq_accum; c.va = &va;
  c.smem = smem;
  c.s_base = smem_u32(smem);
  c.tid = threadIdx.x; c.lane = c.tid % WARP_SIZE; c.warp = c.tid / WARP_SIZE;
  c.b = b; c.h0 = h_kv * group; c.heads_q = heads_q; c.len_q = len_q; c.len_k = len_k;
  c.kv_begin = kv_begin;
  c.key_row0 = kv_begin + c.warp * WARP_KEYS + c.lane / QUAD;
  c.sm_scale = sm_scale;
  c.qr = q_range(va, b, h_kv, kv_tile, kv_begin, len_q, len_k);
  c.count = max(q_count(c.qr), 0);
  c.total = group * c.count;
  c.k_a = a_rows<ROW_BYTES>(c.s_base + OFF_K, c.warp * WARP_KEYS, c.lane);
  c.v_a = a_rows<ROW_BYTES>(c.s_base + OFF_V, c.warp * WARP_KEYS, c.lane);
  c.q_b = b_rows<ROW_BYTES>(c.s_base + OFF_Q, 0, c.lane);
  c.do_b = b_rows<ROW_BYTES>(c.s_base + OFF_DO, 0, c.lane);
  c.q_t = bt_rows<ROW_BYTES>(c.s_base + OFF_Q, c.lane);
  c.do_t = bt_rows<ROW_BYTES>(c.s_base + OFF_DO, c.lane);
  c.ds_at = at_rows<DS_ROW_BYTES>(c.s_base + OFF_DS, c.lane);
  c.k_t = bt_rows<ROW_BYTES>(c.s_base + OFF_K, c.lane);
  c.slot = 0;

  // @cuir-region load_kv
  {
    const TileLoader<HEAD_DIM, THREADS> ld(c.tid);   // rows >= Nk zero-filled: masked P = 0 meets no garbage
    ld.load<BLOCK_N>(c.s_base + OFF_K, k + kv_off, kv_begin, len_k);
    ld.load<BLOCK_N>(c.s_base + OFF_V, v + kv_off, kv_begin, len_k);
    cp_async_commit();
  }
  // @cuir-end load_kv
  c.prefetch(0, 0);

  float acc_dk[KEY_TILES][D_TILES][4], acc_dv[KEY_TILES][D_TILES][4];
  zero(acc_dk);
  zero(acc_dv);
  for (int it = 0; it < c.total; ++it) {
    if (q_tile_partial(va, c.qr, c.tile_of(it)))
      c.step<true>(it, acc_dk, acc_dv);
    else
      c.step<false>(it, acc_dk, acc_dv);
  }
  cp_async_wait<0>();   // nothing in flight at exit (no pair visited: K, V only)

  // @cuir-region epilogue
  // dK = sm_scale sum dS^T Q, dV = sum P^T dO over the group's heads; rows >= Nk are not stored.
  const int row_base = kv_begin + c.warp * WARP_KEYS;
  store_rows(dk + kv_off, acc_dk, row_base, len_k, sm_scale, c.lane);
  store_rows(dv + kv_off, acc_dv, row_base, len_k, 1.f, c.lane);
  // @cuir-end epilogue
}
