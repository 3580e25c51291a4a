// fa2_bwd_sm80: FlashAttention-2-class backward attention for sm_80+ (mma.sync, ldmatrix, cp.async).
//
// Entry points (one cubin holds all four; the runtime launches them in this order):
//   fa2_bwd_preprocess  D = rowsum(dO * O) in fp32 per query row; zeroes the fp32 dQ accumulator
//   fa2_bwd_dkdv        one CTA per (KV tile, kv head, batch): loops over the G query heads of the
//                       kv head and the query tiles that reach the KV tile (q_range), recomputes
//                       P^T from LSE, accumulates dK and dV in registers (no atomics: the whole
//                       group sums inside the CTA), and adds each tile's dQ into the fp32
//                       accumulator with atomics (not in DETERMINISTIC mode)
//   fa2_bwd_dq_convert  dQ = accumulator * sm_scale rounded to 16 bit
//   fa2_bwd_dq          DETERMINISTIC mode's dQ pass instead of the atomics: one CTA per (query
//                       tile, query head, batch) loops over its KV tiles (kv_range) and keeps dQ in
//                       registers; bitwise repeatable
//
// Glossary
//   B, Hq, Hkv, G  batch, query heads, kv heads, G = Hq / Hkv query heads per kv head
//   Nq, Nk, D      query length, key length (any >= 0), head dim (HEAD_DIM)
//   row            a query's row in q / o / lse, in [0, Nq)
//   q_idx, kv_idx  a query's position row + q_shift, a key's row in [0, Nk)
//   q_shift        Nk - Nq: queries are aligned to the end of the keys, as the forward kernels
//                  (and FlashAttention) place them; with Nq > Nk the first Nq - Nk rows see no key
//   KV tile        BLOCK_N keys: the CTA of fa2_bwd_dkdv owns one; query tile: BLOCK_M queries
//   S^T, P^T       scores / probabilities with keys as rows (each warp owns WARP_KEYS keys), so
//                  P^T and dS^T are already the A operands of dV += P^T dO and dK += dS^T Q
//   LSE            natural-log logsumexp of each query row from the forward
//   Dvec           D_i = sum_d dO_id O_id (the softmax backward's row term; "D" alone is the head dim)
//   dS             dL/d(natural score) = P (dP - Dvec), dP = dO V^T; dQ = sm_scale dS K,
//                  dK = sm_scale dS^T Q, dV = P^T dO
//   dQaccum        fp32 [B, Hq, Nq, D] buffer the dkdv CTAs add their dQ contributions into
//   slot           one of the two shared-memory stages of the Q / dO / LSE / Dvec ring
//
// Lifting map: `// @cuir-region NAME` ... `// @cuir-end NAME` delimit the units a variant changes
// (README.md beside this file lists them). Layouts: q, o, dO, dQ [B, Hq, Nq, D]; k, v, dK, dV
// [B, Hkv, Nk, D] (16 bit); lse, Dvec [B, Hq, Nq] fp32; all contiguous.

// ---------------------------------------------------------------- compile-time parameters (-D)
#ifndef BLOCK_M
#define BLOCK_M 64        // query rows per step of fa2_bwd_dkdv
#endif
#ifndef BLOCK_N
#define BLOCK_N 128       // keys per fa2_bwd_dkdv CTA
#endif
#ifndef WARPS
#define WARPS 8           // warps of fa2_bwd_dkdv; each owns BLOCK_N / WARPS keys
#endif
#ifndef DQ_BLOCK_M
#define DQ_BLOCK_M 64     // query rows per fa2_bwd_dq CTA (deterministic mode)
#endif
#ifndef DQ_BLOCK_N
#define DQ_BLOCK_N 64     // keys per KV tile of fa2_bwd_dq
#endif
#ifndef DQ_WARPS
#define DQ_WARPS 4        // warps of fa2_bwd_dq; each owns DQ_BLOCK_M / DQ_WARPS query rows
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128      // 64 or 128
#endif
#ifndef IS_CAUSAL
#define IS_CAUSAL 0       // 1: kv_idx <= q_idx (q_idx = row + Nk - Nq: end-aligned, as the forward kernels)
#endif
#ifndef IS_BF16
#define IS_BF16 0         // 0: float16, 1: bfloat16
#endif
#ifndef DETERMINISTIC
#define DETERMINISTIC 0   // 1: fa2_bwd_dkdv computes no dQ; fa2_bwd_dq does, without atomics
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1      // __launch_bounds__ minimum resident CTAs per SM of fa2_bwd_dkdv
#endif

#include "common.cuh"

namespace fa2b {

constexpr int THREADS = WARPS * WARP_SIZE;
constexpr int WARP_KEYS = BLOCK_N / WARPS;          // key rows per warp in fa2_bwd_dkdv
constexpr int KEY_TILES = WARP_KEYS / MMA_M;        // m16 tiles of S^T per warp
constexpr int QN_TILES = BLOCK_M / MMA_N;           // n8 tiles of S^T (query columns)
constexpr int QK_STEPS = BLOCK_M / MMA_K;           // k16 steps of dV / dK GEMMs (queries)
constexpr int D_TILES = HEAD_DIM / MMA_N;
constexpr int D_STEPS = HEAD_DIM / MMA_K;           // k16 steps of S^T = K Q^T
constexpr int ROW_BYTES = HEAD_DIM * ELEM_BYTES;
constexpr int DS_ROW_BYTES = BLOCK_M * ELEM_BYTES;  // dS tile: [BLOCK_N keys][BLOCK_M queries]
// dQ of one query tile in fa2_bwd_dkdv: warps tile it DQA_WM (rows) x DQA_WD (head-dim columns).
constexpr int DQA_WM = WARPS < BLOCK_M / MMA_M ? WARPS : BLOCK_M / MMA_M;
constexpr int DQA_WD = WARPS / DQA_WM;
constexpr int DQA_MT = BLOCK_M / MMA_M / DQA_WM;
constexpr int DQA_NT = D_TILES / DQA_WD;

constexpr int KV_BYTES = BLOCK_N * ROW_BYTES;
constexpr int QT_BYTES = BLOCK_M * ROW_BYTES;
constexpr int DS_BYTES = DETERMINISTIC ? 0 : BLOCK_N * DS_ROW_BYTES;
constexpr int VEC_BYTES = BLOCK_M * 4;
// K, V, Q[2], dO[2], dS, LSE[2], Dvec[2]
constexpr int SMEM_BYTES = 2 * KV_BYTES + 4 * QT_BYTES + DS_BYTES + 4 * VEC_BYTES;

constexpr int DQ_THREADS = DQ_WARPS * WARP_SIZE;
constexpr int DQ_WARP_ROWS = DQ_BLOCK_M / DQ_WARPS;
constexpr int DQ_MT = DQ_WARP_ROWS / MMA_M;
constexpr int DQ_NT = DQ_BLOCK_N / MMA_N;
constexpr int DQ_KSTEPS = DQ_BLOCK_N / MMA_K;
constexpr int DQ_QT_BYTES = DQ_BLOCK_M * ROW_BYTES;
constexpr int DQ_KV_BYTES = DQ_BLOCK_N * ROW_BYTES;
constexpr int DQ_SMEM_BYTES = 2 * DQ_QT_BYTES + 4 * DQ_KV_BYTES + 2 * DQ_BLOCK_M * 4;   // Q, dO, K[2], V[2], LSE, Dvec

constexpr int PRE_THREADS = 256;                    // preprocess / convert kernels
constexpr int ROW_CHUNKS = HEAD_DIM / CHUNK_ELEMS;
constexpr int PRE_ROWS = PRE_THREADS / ROW_CHUNKS;  // query rows per preprocess CTA

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 800
constexpr int SMEM_LIMIT = 166912;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int SMEM_LIMIT = 232448;
#else
constexpr int SMEM_LIMIT = 101376;
#endif

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM must be 64 or 128");
static_assert(WARP_KEYS % MMA_M == 0 && WARP_KEYS > 0, "each warp owns whole m16 tiles of keys");
static_assert(BLOCK_M % (SWIZZLE_ROWS * CHUNK_ELEMS) == 0, "the dS tile rows (BLOCK_M) must be multiples of 64");
static_assert(WARPS % DQA_WM == 0 && D_TILES % (2 * DQA_WD) == 0, "dQ tile must split evenly over the warps");
static_assert(DQ_WARP_ROWS % MMA_M == 0 && DQ_WARP_ROWS > 0, "each dQ warp owns whole m16 tiles of queries");
static_assert(DQ_BLOCK_N % (2 * MMA_K) == 0, "dQ KV tiles are read as n16 pairs");
static_assert(SMEM_BYTES <= SMEM_LIMIT && DQ_SMEM_BYTES <= SMEM_LIMIT, "shared memory over this arch's limit");

// ---------------------------------------------------------------- regions
// @cuir-region extra_io
// A variant's extra kernel arguments (captured tensors, shape scalars); none here.
struct VariantArgs { int unused; };
// @cuir-end extra_io

// @cuir-region q_range
// Query tiles (of rows) that reach KV tile `kv_tile` (keys [kv_begin, kv_begin + BLOCK_N)):
// [begin, end). Tiles in [full_begin, full_end) need no mask (every query sees every key of the
// tile and all rows / keys are in range); the others are partial. Row r sits at position
// r + Nk - Nq, so causal row r reaches key j iff r >= j - (Nk - Nq); rows that see no key at all
// (Nq > Nk) lie before full_begin and are masked element by element. The skeleton only uses
// q_count, q_tile_at and q_tile_partial, so a variant may replace the set by any list of tiles.
struct QRange {
  int begin, end, full_begin, full_end;
};
__device__ __forceinline__ QRange q_range(const VariantArgs& va, int b, int h_kv, int kv_tile, int kv_begin,
                                          int len_q, int len_k) {
  const int n_tiles = ceil_div(len_q, BLOCK_M);
  const bool keys_whole = kv_begin + BLOCK_N <= len_k;
  const int full_end = keys_whole ? len_q / BLOCK_M : 0;
#if IS_CAUSAL
  const int q_shift = len_k - len_q;
  const int begin = min(max(kv_begin - q_shift, 0) / BLOCK_M, n_tiles);            // first tile with q_idx >= kv_begin
  const int full_begin = ceil_div(max(kv_begin + BLOCK_N - 1 - q_shift, 0), BLOCK_M);  // every q_idx >= the last key
  return QRange{begin, n_tiles, full_begin, full_end};
#else
  return QRange{0, n_tiles, 0, full_end};
#endif
}
__device__ __forceinline__ int q_count(const QRange& r) { return r.end - r.begin; }
__device__ __forceinline__ int q_tile_at(const QRange& r, int i) { return r.begin + i; }
__device__ __forceinline__ bool q_tile_partial(const VariantArgs& va, const QRange& r, int tile) {
  return tile < r.full_begin || tile >= r.full_end;
}
// @cuir-end q_range

// @cuir-region kv_range
// KV tiles one query tile of fa2_bwd_dq visits (as the forward, called as the forward calls it:
// q_begin is the tile's first query position, row + Nk - Nq, and len_q is Nk, the position past
// the last query): [begin, partial_begin) full, [partial_begin, end) partial (causal diagonal,
// ragged tail). A tile whose rows all see no key (Nq > Nk) gets end <= begin: nothing visited.
struct KvRange {
  int begin, partial_begin, end;
};
__device__ __forceinline__ KvRange kv_range(const VariantArgs& va, int b, int h, int q_tile, int q_begin,
                                            int len_q, int len_k) {
  const int n_tiles = ceil_div(len_k, DQ_BLOCK_N);
  const int whole_tiles = len_k / DQ_BLOCK_N;
#if IS_CAUSAL
  const int q_last = min(q_begin + DQ_BLOCK_M, len_q) - 1;
  const int end = min(n_tiles, q_last / DQ_BLOCK_N + 1);
  const int diag = (q_begin + 1) / DQ_BLOCK_N;
  return KvRange{0, min(min(diag, whole_tiles), end), end};
#else
  return KvRange{0, whole_tiles, n_tiles};
#endif
}
__device__ __forceinline__ int kv_count(const KvRange& r) { return r.end - r.begin; }
__device__ __forceinline__ int tile_at(const KvRange& r, int i) { return r.begin + i; }
__device__ __forceinline__ bool tile_partial(const VariantArgs& va, const KvRange& r, int tile) {
  return tile >= r.partial_begin;
}
// @cuir-end kv_range

// @cuir-region score
// score_mod of the natural score s = q . k * sm_scale, and its derivative d score_mod / d s (the
// factor dS picks up on its way back to q and k). Identity here: the skeleton then keeps S as raw
// dot products and folds sm_scale into the exp2 prescale, and skips the derivative.
constexpr bool SCORE_MOD_IS_IDENTITY = true;
__device__ __forceinline__ float score_mod(const VariantArgs& va, float s, int b, int h, int q_idx, int kv_idx) {
  return s;
}
__device__ __forceinline__ float score_grad(const VariantArgs& va, float s, int b, int h, int q_idx, int kv_idx) {
  return 1.f;
}
// @cuir-end score

// @cuir-region mask
// true = attended. Applied only in partial tiles, together with kv_idx < Nk and q_idx < Nq.
__device__ __forceinline__ bool mask_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx) {
#if IS_CAUSAL
  return kv_idx <= q_idx;
#else
  return true;
#endif
}
// @cuir-end mask

// @cuir-region softmax_bwd
// The normalisation's backward. prob: P recomputed from the score x (units of scale_log2 / LOG2E)
// and the forward's natural LSE; dscore: dS from P, dP = dO . v and the row term Dvec. Both get the
// VariantArgs (a sigmoid's bias, a relu's scale).
__device__ __forceinline__ float prob(const VariantArgs& va, float x, float lse, float scale_log2) {
  return ex2(fmaf(x, scale_log2, -lse * LOG2E));
}
__device__ __forceinline__ float dscore(const VariantArgs& va, float p, float dp, float dvec) {
  return p * (dp - dvec);
}
// @cuir-end softmax_bwd

// Skeleton: S (or S^T) -> P in place for one tile, each element with its (q_idx, kv_idx); g gets
// score_mod' where score_mod is not the identity. KEYS_ROWS: rows are keys (fa2_bwd_dkdv's S^T).
// row0 / col0: index of this lane's first fragment row / column (query rows, not positions); lse,
// dvec indexed by query row; mask_pred / score_mod / score_grad see the position row + q_shift. A
// row that sees no key has LSE = -inf (P = inf before the select): it is only ever in partial
// tiles, where the mask selects P = 0, so nothing is multiplied by it.
__device__ __forceinline__ float s_unit(float sm_scale) { return SCORE_MOD_IS_IDENTITY ? sm_scale : 1.f; }

template <bool PARTIAL, bool KEYS_ROWS, int MT, int NT>
__device__ __forceinline__ void probs(const VariantArgs& va, float (&s)[MT][NT][4], float (&g)[MT][NT][4],
                                      const float* lse, int b, int h, int row0, int col0, int len_q,
                                      int len_k, float sm_scale, int lse_row0, int q_shift) {
  const float scale_log2 = s_unit(sm_scale) * LOG2E;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {   // c: (row g, col 2tq), (g, 2tq + 1), (g + 8, 2tq), (g + 8, 2tq + 1)
        const int row = row0 + mt * MMA_M + (c / 2) * 8, col = col0 + nt * MMA_N + c % 2;
        const int q_row = KEYS_ROWS ? col : row, kv_idx = KEYS_ROWS ? row : col;
        const int q_idx = q_row + q_shift;
        const float l = lse[q_row - lse_row0];
        float x = s[mt][nt][c];
        if (!SCORE_MOD_IS_IDENTITY) {
          g[mt][nt][c] = score_grad(va, x * sm_scale, b, h, q_idx, kv_idx);
          x = score_mod(va, x * sm_scale, b, h, q_idx, kv_idx);
        }
        float p = prob(va, x, l, scale_log2);
        if (PARTIAL && !((kv_idx < len_k) & (q_row < len_q) & mask_pred(va, b, h, q_idx, kv_idx))) p = 0.f;
        s[mt][nt][c] = p;
      }
}

// dP (in place) -> dS = dscore(P, dP, Dvec) (* score_mod').
template <bool KEYS_ROWS, int MT, int NT>
__device__ __forceinline__ void dscores(const VariantArgs& va, float (&dp)[MT][NT][4], const float (&p)[MT][NT][4],
                                        const float (&g)[MT][NT][4], const float* dvec, int row0, int col0,
                                        int vec_row0) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int q_row = KEYS_ROWS ? col0 + nt * MMA_N + c % 2 : row0 + mt * MMA_M + (c / 2) * 8;
        float ds = dscore(va, p[mt][nt][c], dp[mt][nt][c], dvec[q_row - vec_row0]);
        if (!SCORE_MOD_IS_IDENTITY) ds *= g[mt][nt][c];
        dp[mt][nt][c] = ds;
      }
}

// Stores MT x NT fp32 C fragments (rows row_base + ..., 16-bit, scaled) for rows < len.
template <int MT, int NT>
__device__ __forceinline__ void store_rows(elem_t* head, const float (&c)[MT][NT][4], int row_base, int len,
                                           float scale, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_base + mt * MMA_M + r * 8 + lane / QUAD;
      if (row >= len) continue;
      u32* dst = reinterpret_cast<u32*>(head + static_cast<i64>(row) * HEAD_DIM + 2 * (lane % QUAD));
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) dst[nt * MMA_N / 2] = pack2(c[mt][nt][2 * r] * scale, c[mt][nt][2 * r + 1] * scale);
    }
}

// ---------------------------------------------------------------- preprocess and convert
// One thread per 16-byte chunk of a query row: Dvec = rowsum(dO * O) in fp32 (reduced over the
// ROW_CHUNKS lanes of the row), and the row of dQaccum zeroed (when it is not null).
extern "C" __global__ void __launch_bounds__(PRE_THREADS)
fa2_bwd_preprocess(const elem_t* __restrict__ o, const elem_t* __restrict__ dout, float* __restrict__ dvec,
                   float* __restrict__ dq_accum, i64 rows) {
  const int tid = threadIdx.x;
  const i64 row = static_cast<i64>(blockIdx.x) * PRE_ROWS + tid / ROW_CHUNKS;
  const int chunk = tid % ROW_CHUNKS;
  float acc = 0.f;
  if (row < rows) {
    const i64 off = row * HEAD_DIM + chunk * CHUNK_ELEMS;
    const uint4 a = *reinterpret_cast<const uint4*>(o + off);
    const uint4 d = *reinterpret_cast<const uint4*>(dout + off);
    const u32 aw[4] = {a.x, a.y, a.z, a.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = fmaf(to_f32(static_cast<elem_t>(aw[i] & 0xffffu)), to_f32(static_cast<elem_t>(dw[i] & 0xffffu)), acc);
      acc = fmaf(to_f32(static_cast<elem_t>(aw[i] >> 16)), to_f32(static_cast<elem_t>(dw[i] >> 16)), acc);
    }
    if (dq_accum != nullptr) {
      float4* z = reinterpret_cast<float4*>(dq_accum + off);
      z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int w = 1; w < ROW_CHUNKS; w *= 2) acc += __shfl_xor_sync(FULL_MASK, acc, w);   // the row's lanes
  if (row < rows && chunk == 0) dvec[row] = acc;
}

// dQ = dQaccum * sm_scale in 16 bit; one thread per 8 elements.
extern "C" __global__ void __launch_bounds__(PRE_THREADS)
fa2_bwd_dq_convert(const float* __restrict__ dq_accum, elem_t* __restrict__ dq, i64 chunks, float sm_scale) {
  const i64 i = static_cast<i64>(blockIdx.x) * PRE_THREADS + threadIdx.x;
  if (i >= chunks) return;
  const float4* src = reinterpret_cast<const float4*>(dq_accum) + 2 * i;
  const float4 a = src[0], b = src[1];
  uint4 out;
  out.x = pack2(a.x * sm_scale, a.y * sm_scale);
  out.y = pack2(a.z * sm_scale, a.w * sm_scale);
  out.z = pack2(b.x * sm_scale, b.y * sm_scale);
  out.w = pack2(b.z * sm_scale, b.w * sm_scale);
  reinterpret_cast<uint4*>(dq)[i] = out;
}

}  // namespace fa2b

#include "dkdv.cuh"
#include "dq.cuh"
