// fa2_bwd_sm80/dq.cuh: the deterministic mode's dQ pass (included by kernel.cu after the regions).
//
// One CTA per (query tile, query head, batch), laid out as the forward kernel: Q, dO, LSE and Dvec
// of the tile stay in shared memory, K and V tiles stream through a two-slot ring, each warp owns
// DQ_WARP_ROWS query rows. Per KV tile: S = Q K^T, P from LSE, dP = dO V^T, dS = P (dP - Dvec),
// dQ += dS K (dS straight from the C fragments). dQ lives in registers: no atomics, the same
// summation order every run.
#pragma once

namespace fa2b {

constexpr int DQ_OFF_Q = 0;
constexpr int DQ_OFF_DO = DQ_OFF_Q + DQ_QT_BYTES;
constexpr int DQ_OFF_K = DQ_OFF_DO + DQ_QT_BYTES;       // 2 slots
constexpr int DQ_OFF_V = DQ_OFF_K + 2 * DQ_KV_BYTES;    // 2 slots
constexpr int DQ_OFF_LSE = DQ_OFF_V + 2 * DQ_KV_BYTES;
constexpr int DQ_OFF_DVEC = DQ_OFF_LSE + DQ_BLOCK_M * 4;
static_assert(DQ_OFF_DVEC + DQ_BLOCK_M * 4 == DQ_SMEM_BYTES, "shared-memory map and DQ_SMEM_BYTES disagree");

struct DqCta {
  const elem_t *k, *v;
  const VariantArgs* va;
  unsigned char* smem;
  u32 s_base;
  int tid, lane, warp, b, h, len_q, len_k, q_begin, row0;   // row0: q_idx of this lane's first row
  i64 kv_off;
  float sm_scale;
  KvRange kv;
  int count, slot;
  u32 q_a, do_a, k_b, v_b, k_t;   // A lanes of Q, dO; B lanes of K, V (slot 0); K transposed

  __device__ __forceinline__ void prefetch(int i, int fill) {
    if (i < count) {
      const int tile = tile_at(kv, i);
      const TileLoader<HEAD_DIM, DQ_THREADS> ld(tid);
      ld.load<DQ_BLOCK_N>(s_base + DQ_OFF_K + fill * DQ_KV_BYTES, k + kv_off, tile * DQ_BLOCK_N, len_k);
      ld.load<DQ_BLOCK_N>(s_base + DQ_OFF_V + fill * DQ_KV_BYTES, v + kv_off, tile * DQ_BLOCK_N, len_k);
    }
    cp_async_commit();
  }

  template <bool PARTIAL>
  __device__ __forceinline__ void step(int i, float (&acc)[DQ_MT][D_TILES][4]) {
    cp_async_wait<0>();
    __syncthreads();   // tile i visible to all; every warp is done with tile i - 1's slot
    prefetch(i + 1, slot ^ 1);
    const int tile = tile_at(kv, i), col0 = tile * DQ_BLOCK_N + 2 * (lane % QUAD);
    const float* lse_s = reinterpret_cast<const float*>(smem + DQ_OFF_LSE);
    const float* dvec_s = reinterpret_cast<const float*>(smem + DQ_OFF_DVEC);
    float s[DQ_MT][DQ_NT][4], g[DQ_MT][DQ_NT][4], dp[DQ_MT][DQ_NT][4];
    zero(s);
    gemm_ss_abt<DQ_MT, DQ_NT, D_STEPS, ROW_BYTES, ROW_BYTES>(s, q_a, k_b + slot * DQ_KV_BYTES);
    probs<PARTIAL, false>(*va, s, g, lse_s, b, h, row0, col0, len_q, len_k, sm_scale, q_begin, len_k - len_q);
    zero(dp);
    gemm_ss_abt<DQ_MT, DQ_NT, D_STEPS, ROW_BYTES, ROW_BYTES>(dp, do_a, v_b + slot * DQ_KV_BYTES);
    dscores<false>(*va, dp, s, g, dvec_s, row0, col0, q_begin);
    u32 da[DQ_MT][DQ_KSTEPS][4];
    to_a_frags(da, dp);
    gemm_rs_ab<DQ_MT, D_TILES, DQ_KSTEPS, ROW_BYTES>(acc, da, k_t + slot * DQ_KV_BYTES, 0);
    slot ^= 1;
  }
};

}  // namespace fa2b

extern "C" __global__ void __launch_bounds__(fa2b::DQ_THREADS)
fa2_bwd_dq(const fa2b::elem_t* __restrict__ q, const fa2b::elem_t* __restrict__ k,
           const fa2b::elem_t* __restrict__ v, const fa2b::elem_t* __restrict__ dout,
           const float* __restrict__ lse, const float* __restrict__ dvec, fa2b::elem_t* __restrict__ dq,
           int batch, int heads_q, int heads_kv, int len_q, int len_k, float sm_scale,
           const __grid_constant__ fa2b::VariantArgs va) {
  using namespace fa2b;
  extern __shared__ __align__(128) unsigned char smem[];
  // Causal query tiles differ in cost: the heaviest (last) first, as the forward.
  const int q_tile = IS_CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int q_begin = q_tile * DQ_BLOCK_M;
  const int b = blockIdx.z, h = blockIdx.y;
  const int h_kv = h / (heads_q / heads_kv);
  const i64 q_rows = (static_cast<i64>(b) * heads_q + h) * len_q;

  DqCta c;
  c.k = k; c.v = v; c.va = &va; c.smem = smem;
  c.s_base = smem_u32(smem);
  c.tid = threadIdx.x; c.lane = c.tid % WARP_SIZE; c.warp = c.tid / WARP_SIZE;
  c.b = b; c.h = h; c.len_q = len_q; c.len_k = len_k; c.q_begin = q_begin;
  c.row0 = q_begin + c.warp * DQ_WARP_ROWS + c.lane / QUAD;
  c.kv_off = (static_cast<i64>(b) * heads_kv + h_kv) * len_k * HEAD_DIM;
  c.sm_scale = sm_scale;
  // kv_range sees query positions, as the forward's: the tile's first row sits at q_begin + Nk - Nq
  // and the last query at Nk - 1 (so len_q is passed as Nk).
  c.kv = kv_range(va, b, h, q_tile, q_begin + len_k - len_q, len_k, len_k);
  c.count = max(kv_count(c.kv), 0);
  c.slot = 0;
  c.q_a = a_rows<ROW_BYTES>(c.s_base + DQ_OFF_Q, c.warp * DQ_WARP_ROWS, c.lane);
  c.do_a = a_rows<ROW_BYTES>(c.s_base + DQ_OFF_DO, c.warp * DQ_WARP_ROWS, c.lane);
  c.k_b = b_rows<ROW_BYTES>(c.s_base + DQ_OFF_K, 0, c.lane);
  c.v_b = b_rows<ROW_BYTES>(c.s_base + DQ_OFF_V, 0, c.lane);
  c.k_t = bt_rows<ROW_BYTES>(c.s_base + DQ_OFF_K, c.lane);

  {
    const TileLoader<HEAD_DIM, DQ_THREADS> ld(c.tid);
    ld.load<DQ_BLOCK_M>(c.s_base + DQ_OFF_Q, q + q_rows * HEAD_DIM, q_begin, len_q);
    ld.load<DQ_BLOCK_M>(c.s_base + DQ_OFF_DO, dout + q_rows * HEAD_DIM, q_begin, len_q);
    load_row_vec<DQ_BLOCK_M, DQ_THREADS>(c.s_base + DQ_OFF_LSE, lse + q_rows, q_begin, len_q, c.tid);
    load_row_vec<DQ_BLOCK_M, DQ_THREADS>(c.s_base + DQ_OFF_DVEC, dvec + q_rows, q_begin, len_q, c.tid);
    cp_async_commit();
  }
  c.prefetch(0, 0);

  float acc[DQ_MT][D_TILES][4];
  zero(acc);
  int i = 0;
  for (; i < c.count; ++i) {   // leading full tiles without mask code, then the partial ones
    if (tile_partial(va, c.kv, tile_at(c.kv, i))) break;
    c.step<false>(i, acc);
  }
  for (; i < c.count; ++i) c.step<true>(i, acc);
  cp_async_wait<0>();

  // @cuir-region dq_epilogue
  store_rows(dq + q_rows * HEAD_DIM, acc, q_begin + c.warp * DQ_WARP_ROWS, len_q, sm_scale, c.lane);
  // @cuir-end dq_epilogue
}
