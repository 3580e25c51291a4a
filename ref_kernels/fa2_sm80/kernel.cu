// fa2_sm80: FlashAttention-2-class forward attention for sm_80+ (mma.sync, ldmatrix, cp.async).
//
// One CTA computes one query tile (BLOCK_M rows) of one (batch, query head) against the KV tiles
// that the kv_range region selects. K and V tiles stream through a STAGES-deep ring of swizzled
// shared-memory slots; Q stays in shared memory and is re-read with ldmatrix at every tile; S, P
// and O live in registers. No headers: nvcc and NVRTC build this same text.
//
// Glossary
//   B, Hq, Hkv   batch, query heads, key/value heads (Hq % Hkv == 0; G = Hq / Hkv queries per kv head)
//   Nq, Nk       query length, key length (independent; any value >= 0)
//   D            head dim (HEAD_DIM)
//   q_idx        absolute query position in [Nk - Nq, Nk): queries are aligned to the end of the
//                keys (query row r sits at r + Nk - Nq, as in FlashAttention); kv_idx in [0, Nk)
//   query tile   BLOCK_M consecutive query rows, one per CTA
//   KV tile      BLOCK_N consecutive key rows; "full" = nothing masked, "partial" = some element
//                masked (causal diagonal, ragged tail kv_idx >= Nk)
//   S            scores of one KV tile, fp32 in registers; natural score = S * S_UNIT (s_unit())
//   P            exp2((S - m) * S_UNIT * LOG2E): unnormalised probabilities, overwrite S in place
//   O            fp32 output accumulator in registers, divided by l in the epilogue
//   m            running row max of S;  l  running row sum of P
//   LSE          natural-log logsumexp of each query row over attended keys (-inf if none)
//   slot         one K/V stage of the shared-memory ring
//   chunk        16 bytes = 8 elements, the unit of cp.async, ldmatrix rows and the swizzle
//   g, tq        lane / 4 (row in an mma fragment) and lane % 4 (column pair in it)
//
// Lifting map: each `// @cuir-region NAME` ... `// @cuir-end NAME` pair is a region that CuIR
// names and that lowering may replace by regenerated code (see README.md beside this file).
//
// Layout: q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D], o [B, Hq, Nq, D] (16-bit elements), lse [B, Hq, Nq]
// (float32), all contiguous. Grid (ceil(Nq / BLOCK_M), Hq, B), block WARPS * 32 threads, dynamic
// shared memory SMEM_BYTES (the launcher computes the same number).

// ---------------------------------------------------------------- compile-time parameters (-D)
#ifndef BLOCK_M
#define BLOCK_M 128      // query rows per CTA
#endif
#ifndef BLOCK_N
#define BLOCK_N 64       // key rows per KV tile
#endif
#ifndef STAGES
#define STAGES 2         // K/V shared-memory ring depth (>= 2)
#endif
#ifndef WARPS
#define WARPS 4          // warps per CTA; each owns BLOCK_M / WARPS query rows
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128     // 64 or 128
#endif
#ifndef IS_CAUSAL
#define IS_CAUSAL 0      // 1: kv_idx <= q_idx (positions; bottom-right aligned when Nq < Nk)
#endif
#ifndef IS_BF16
#define IS_BF16 0        // 0: float16, 1: bfloat16
#endif
#ifndef KV_SPLIT
#define KV_SPLIT 1       // S, P and the softmax of a KV tile in KV_SPLIT column blocks (fewer live registers)
#endif
#ifndef QK_ROLLED
#define QK_ROLLED 0      // N > 0: S = Q K^T's k16 steps unrolled only N-fold (1 with KV_SPLIT 2: D 128 spill-free)
#endif
#define FA2_PRAGMA_STR(x) #x
#define FA2_PRAGMA(x) _Pragma(FA2_PRAGMA_STR(x))
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1     // __launch_bounds__ minimum resident CTAs per SM (register cap)
#endif

// ---------------------------------------------------------------- traits: tile sizes first
namespace fa2 {

typedef unsigned int u32;
typedef unsigned short elem_t;   // raw 16-bit storage of fp16 / bf16
typedef long long i64;

constexpr int WARP_SIZE = 32;
constexpr int MMA_M = 16, MMA_N = 8, MMA_K = 16;   // mma.sync.m16n8k16
constexpr int ELEM_BYTES = 2;
constexpr int CHUNK_BYTES = 16;                    // one cp.async / one ldmatrix row
constexpr int CHUNK_ELEMS = CHUNK_BYTES / ELEM_BYTES;
constexpr int SWIZZLE_ROWS = 8;                    // chunk ^= row % 8: 8 rows hit 8 bank groups
constexpr int QUAD = 4;                            // lanes sharing one fragment row

constexpr int THREADS = WARPS * WARP_SIZE;
constexpr int WARP_ROWS = BLOCK_M / WARPS;         // query rows per warp
constexpr int M_TILES = WARP_ROWS / MMA_M;         // m16 tiles per warp
constexpr int SUB_N = BLOCK_N / KV_SPLIT;          // key columns of S computed at once
constexpr int N_TILES = SUB_N / MMA_N;             // n8 tiles of S per column block
constexpr int D_TILES = HEAD_DIM / MMA_N;          // n8 tiles of O
constexpr int QK_K_STEPS = HEAD_DIM / MMA_K;       // k16 steps of S = Q K^T
constexpr int PV_K_STEPS = SUB_N / MMA_K;          // k16 steps of O += P V per column block
constexpr int ROW_CHUNKS = HEAD_DIM / CHUNK_ELEMS; // chunks per K/V/Q row
constexpr int ROW_BYTES = HEAD_DIM * ELEM_BYTES;
constexpr int LOAD_ROWS = THREADS / ROW_CHUNKS;    // tile rows one pass of 16-byte copies covers

constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * ELEM_BYTES;
constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * ELEM_BYTES;
constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_TILE_BYTES;   // Q + K ring + V ring

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 800
constexpr int SMEM_LIMIT = 166912;   // sm_80: 163 KB opt-in per block
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int SMEM_LIMIT = 232448;   // sm_90: 227 KB opt-in per block
#else
constexpr int SMEM_LIMIT = 101376;   // sm_86 / sm_89: 99 KB opt-in per block
#endif

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM must be 64 or 128");
static_assert(ROW_CHUNKS >= SWIZZLE_ROWS, "the swizzle needs at least 8 chunks per row");
static_assert(STAGES >= 2, "the K/V ring needs at least 2 slots (prefetch while computing)");
static_assert(BLOCK_M % (WARPS * MMA_M) == 0, "each warp owns a whole number of m16 tiles");
static_assert(KV_SPLIT >= 1 && BLOCK_N % KV_SPLIT == 0, "KV_SPLIT divides BLOCK_N");
static_assert(SUB_N % (2 * MMA_N) == 0, "K tiles are loaded as n16 pairs (ldmatrix.x4)");
static_assert(HEAD_DIM % (2 * MMA_N) == 0, "V tiles are loaded as n16 pairs (ldmatrix.x4.trans)");
static_assert(LOAD_ROWS % SWIZZLE_ROWS == 0, "rows one pass of the CTA loads keep the swizzle phase");
static_assert(BLOCK_M % LOAD_ROWS == 0 && BLOCK_N % LOAD_ROWS == 0, "tiles load in whole passes");
static_assert(SMEM_BYTES <= SMEM_LIMIT, "shared memory over the per-block limit of this arch");

constexpr float LOG2E = 1.4426950408889634f;   // log2(e): exp(x) = exp2(x * LOG2E)
constexpr float LN2 = 0.6931471805599453f;     // ln(2): ln(x) = log2(x) * LN2
constexpr u32 NEG_INF_BITS = 0xff800000u;

// ---------------------------------------------------------------- PTX helpers
__device__ __forceinline__ float neg_inf() { return __int_as_float(NEG_INF_BITS); }

__device__ __forceinline__ float ex2(float x) {   // ex2.approx(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte async copies global -> shared (L2 only: .cg). The zfill form copies src_bytes and
// zero-fills the rest: src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_16_zfill(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

#if IS_BF16
#define FA2_MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#define FA2_CVT "cvt.rn.bf16x2.f32"
#else
#define FA2_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define FA2_CVT "cvt.rn.f16x2.f32"
#endif

// c += a * b  (a: m16k16 row-major fragment, b: k16n8 col-major fragment, c: m16n8 fp32)
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm(FA2_MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 -> one register of two 16-bit values (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm(FA2_CVT " %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Byte offset of (row, chunk) in a [rows][HEAD_DIM] tile whose chunks are XOR-swizzled by row % 8,
// so the 8 rows one ldmatrix phase reads land in 8 different bank groups.
__device__ __forceinline__ u32 swizzle(int row, int chunk) {
  return static_cast<u32>(row * ROW_CHUNKS + (chunk ^ (row % SWIZZLE_ROWS))) * CHUNK_BYTES;
}

// ldmatrix addresses. An x4 ldmatrix reads four 8x8 matrices; lane L gives the address of row L % 8
// of matrix L / 8. Each tile row a lane addresses has row % 8 == L % 8, and tiles and rows start on
// 128-byte boundaries, so the swizzled chunk (2j + hi) ^ (L % 8) of k16 step j sits in address bits
// 4-6 and only differs from step 0 by an XOR with (2j % 8) << 4: one base register per operand
// (lane_base), the step an XOR and the rest immediates (ldsm_addr).
__device__ __forceinline__ u32 lane_base(u32 tile, int row, int hi, int lane) {
  return tile + row * ROW_BYTES + (hi ^ (lane % SWIZZLE_ROWS)) * CHUNK_BYTES;
}
__device__ __forceinline__ u32 ldsm_addr(u32 base, int step, int row_offset) {
  return (base ^ ((2 * step) % SWIZZLE_ROWS) * CHUNK_BYTES) + (2 * step / SWIZZLE_ROWS) * SWIZZLE_ROWS * CHUNK_BYTES +
         row_offset * ROW_BYTES;
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------- regions
// Every thread copies the same chunk column of rows row0, row0 + LOAD_ROWS, ... of a tile, so its
// global offset and its swizzled shared offset are computed once (LoadLane) and each further row is
// an immediate. Rows past the sequence end are zero-filled (src-size 0) from a clamped, valid address.
struct LoadLane {
  int g_off;   // element offset of (row0, chunk) in a [rows][HEAD_DIM] global tile
  u32 s_off;   // swizzled byte offset of (row0, chunk) in a shared tile
  int row0;
};
__device__ __forceinline__ LoadLane load_lane(int tid) {
  const int row0 = tid / ROW_CHUNKS, chunk = tid % ROW_CHUNKS;
  return LoadLane{row0 * HEAD_DIM + chunk * CHUNK_ELEMS, swizzle(row0, chunk), row0};
}

template <int ROWS>
__device__ __forceinline__ void load_tile(u32 s_tile, const elem_t* head, int row_begin, int len, LoadLane ll) {
  const elem_t* src = head + static_cast<i64>(row_begin) * HEAD_DIM + ll.g_off;
  if (row_begin + ROWS <= len) {   // whole tile inside the sequence (CTA-uniform): no predicates
#pragma unroll
    for (int i = 0; i < ROWS / LOAD_ROWS; ++i)
      cp_async_16(s_tile + ll.s_off + i * LOAD_ROWS * ROW_BYTES, src + i * LOAD_ROWS * HEAD_DIM);
    return;
  }
  const int rows_left = len - row_begin - ll.row0;   // rows of this lane still inside the sequence
#pragma unroll
  for (int i = 0; i < ROWS / LOAD_ROWS; ++i) {
    const bool in = i * LOAD_ROWS < rows_left;
    cp_async_16_zfill(s_tile + ll.s_off + i * LOAD_ROWS * ROW_BYTES, in ? src + i * LOAD_ROWS * HEAD_DIM : head,
                      in ? CHUNK_BYTES : 0);
  }
}

// @cuir-region load_q
// Q tile [q_begin, q_begin + BLOCK_M) -> shared memory; rows >= Nq are zero-filled.
__device__ __forceinline__ void load_q(u32 s_q, const elem_t* q_head, int q_begin, int len_q, LoadLane ll) {
  load_tile<BLOCK_M>(s_q, q_head, q_begin, len_q, ll);
}
// @cuir-end load_q

// @cuir-region load_kv
// One K or V tile (key rows [tile * BLOCK_N, +BLOCK_N)) -> one ring slot; rows >= Nk are zero-filled
// so that a masked P = 0 never meets garbage (0 * NaN) in P V.
__device__ __forceinline__ void load_kv_tile(u32 s_slot, const elem_t* head, int tile, int len_k, LoadLane ll) {
  load_tile<BLOCK_N>(s_slot, head, tile * BLOCK_N, len_k, ll);
}
// @cuir-end load_kv

// @cuir-region extra_io
// A variant's extra kernel arguments (captured tensors, shape-dependent scalars); none here.
// kLongestFirst: schedule the query tiles with the most KV tiles first (short tail); causal does.
struct VariantArgs { int unused; };
constexpr bool kLongestFirst = false;
// @cuir-end extra_io

// @cuir-region kv_range
// KV tiles one query tile visits: [begin, partial_begin) are full (no mask code runs),
// [partial_begin, end) are partial (mask_pred and the Nk bound are applied per element).
// The skeleton only uses kv_count, tile_at (the i-th tile to visit) and tile_partial, so a variant
// may replace the range by any set of tiles.
struct KvRange {
  int begin, partial_begin, end;
};
__device__ __forceinline__ KvRange kv_range(const VariantArgs& va, int b, int h, int q_tile, int q_begin,
                                            int len_q, int len_k) {
  const int n_tiles = ceil_div(len_k, BLOCK_N);
  const int whole_tiles = len_k / BLOCK_N;                 // tiles with no row >= Nk
#if IS_CAUSAL
  const int q_last = min(q_begin + BLOCK_M, len_q) - 1;    // last stored query row of the tile
  const int end = min(n_tiles, q_last / BLOCK_N + 1);      // tiles holding some kv_idx <= q_last
  const int diag = (q_begin + 1) / BLOCK_N;                // tiles whose every kv_idx <= q_begin
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

// @cuir-region qk
// S = Q K^T for one KV tile (raw dot products, fp32). q_lane / k_lane: this lane's ldmatrix bases.
__device__ __forceinline__ void qk_tile(float (&s)[M_TILES][N_TILES][4], u32 q_lane, u32 k_lane) {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[mt][nt][c] = 0.f;
  // QK_ROLLED: one k-step at a time. Unrolled, ptxas loads later steps' fragments early, into
  // registers a D 128 tile does not have (NOTES "Session 13"); the step is an XOR of the base
  // (ldsm_addr), so the loop indexes no array.
#if QK_ROLLED
  FA2_PRAGMA(unroll QK_ROLLED)
#else
#pragma unroll
#endif
  for (int kk = 0; kk < QK_K_STEPS; ++kk) {
    u32 a[M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
      ldmatrix_x4(a[mt], ldsm_addr(q_lane, kk, mt * MMA_M));
#pragma unroll
    for (int np = 0; np < N_TILES / 2; ++np) {   // b[0..1]: n-tile 2np, b[2..3]: n-tile 2np + 1
      u32 b[4];
      ldmatrix_x4(b, ldsm_addr(k_lane, kk, np * 2 * MMA_N));
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}
// @cuir-end qk

// @cuir-region score
// Per-element score transform of the natural-unit score s = q . k * sm_scale. Declaring it the
// identity lets the skeleton keep S as raw dot products and fold sm_scale into the softmax's exp2
// prescale (one FFMA per element instead of three multiplies); a regenerated score_mod sets it false.
constexpr bool SCORE_MOD_IS_IDENTITY = true;
__device__ __forceinline__ float score_mod(const VariantArgs& va, float s, int b, int h, int q_idx, int kv_idx) {
  return s;
}
// @cuir-end score

// @cuir-region mask
// Per-element mask: true = attended. Applied only in partial tiles (kv_range guarantees full
// tiles need none).
__device__ __forceinline__ bool mask_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx) {
#if IS_CAUSAL
  return kv_idx <= q_idx;
#else
  return true;
#endif
}
// @cuir-end mask

// Skeleton (not a region): one loop over the S fragment, each element with its (q_idx, kv_idx):
// score_mod (unless it is the identity), and in partial tiles the Nk bound and mask_pred.
// Afterwards S holds scores in units of S_UNIT(sm_scale): natural score = S * S_UNIT.
// q_row0 = q_idx of this lane's first fragment row, kv_col0 = kv_idx of its first column.
__device__ __forceinline__ float s_unit(float sm_scale) { return SCORE_MOD_IS_IDENTITY ? sm_scale : 1.f; }

template <bool PARTIAL>
__device__ __forceinline__ void score_tile(const VariantArgs& va, float (&s)[M_TILES][N_TILES][4], int b,
                                           int h, int q_row0, int kv_col0, int len_k, float sm_scale) {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {   // c: (row g, col 2tq), (g, 2tq+1), (g+8, 2tq), (g+8, 2tq+1)
        const int q_idx = q_row0 + mt * MMA_M + (c / 2) * 8;
        const int kv_idx = kv_col0 + nt * MMA_N + c % 2;
        float x = s[mt][nt][c];
        if (!SCORE_MOD_IS_IDENTITY) x = score_mod(va, x * sm_scale, b, h, q_idx, kv_idx);
        if (PARTIAL && !((kv_idx < len_k) & mask_pred(va, b, h, q_idx, kv_idx))) x = neg_inf();
        s[mt][nt][c] = x;
      }
}

// @cuir-region softmax
// Online softmax state of this lane's 2 * M_TILES rows, exp2-based: scores are prescaled by
// scale_log2 = S_UNIT * LOG2E inside one FFMA, P = exp2(S * scale_log2 - m * scale_log2).
// update() turns S into P in place and rescales O and l by exp2((m_old - m_new) * scale_log2)
// (O only when some row max of the warp moved).
// m is the running row max in S units; l stays a per-lane partial row sum (the quad reduces it
// once, in the epilogue).
struct OnlineSoftmax {
  float m[M_TILES][2];
  float l[M_TILES][2];
  float scale_log2;

  __device__ __forceinline__ void init(const VariantArgs& va, float s_unit_) {
    scale_log2 = s_unit_ * LOG2E;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m[mt][r] = neg_inf();
        l[mt][r] = 0.f;
      }
  }

  __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float (&o)[M_TILES][D_TILES][4]) {
    float alpha[M_TILES][2];
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {   // r = 0: fragment row g, r = 1: row g + 8
        float mx = m[mt][r];
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with nothing attended so far keeps max -inf; subtract 0 so P = exp2(-inf) = 0, not NaN.
        const float base = mx == neg_inf() ? 0.f : mx * scale_log2;
        // __fmul_rn is never contracted into an FFMA: an unchanged max gives alpha = exp2(0) = 1 exactly.
        alpha[mt][r] = ex2(__fmul_rn(m[mt][r], scale_log2) - base);
        rescale |= mx != m[mt][r];
        m[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
          for (int c = 2 * r; c < 2 * r + 2; ++c) {
            s[mt][nt][c] = ex2(fmaf(s[mt][nt][c], scale_log2, -base));
            sum += s[mt][nt][c];
          }
        l[mt][r] = l[mt][r] * alpha[mt][r] + sum;
      }
    // Once the row maxima settle, most tiles leave every max of the warp unchanged (alpha == 1
    // exactly): skip the D_TILES * 4 multiplies per row then; the result is bit-identical.
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
          for (int c = 0; c < 4; ++c) o[mt][dt][c] *= alpha[mt][c / 2];
    }
  }
};
// @cuir-end softmax

// @cuir-region pv
// O += P V for one KV tile. P (fp32) is first rounded to the input dtype, all at once, which frees
// the fp32 S registers before the MMAs: the m16n8 accumulator layout of two n-tiles is the m16k16
// A-operand layout.
__device__ __forceinline__ void pv_tile(float (&o)[M_TILES][D_TILES][4], const float (&p32)[M_TILES][N_TILES][4],
                                        u32 v_lane) {
  u32 p[M_TILES][PV_K_STEPS][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int kk = 0; kk < PV_K_STEPS; ++kk) {
      p[mt][kk][0] = pack2(p32[mt][2 * kk][0], p32[mt][2 * kk][1]);
      p[mt][kk][1] = pack2(p32[mt][2 * kk][2], p32[mt][2 * kk][3]);
      p[mt][kk][2] = pack2(p32[mt][2 * kk + 1][0], p32[mt][2 * kk + 1][1]);
      p[mt][kk][3] = pack2(p32[mt][2 * kk + 1][2], p32[mt][2 * kk + 1][3]);
    }
#pragma unroll
  for (int kk = 0; kk < PV_K_STEPS; ++kk)
#pragma unroll
    for (int dp = 0; dp < D_TILES / 2; ++dp) {   // b[0..1]: d-tile 2dp, b[2..3]: d-tile 2dp + 1
      u32 b[4];
      ldmatrix_x4_trans(b, ldsm_addr(v_lane, dp, kk * MMA_K));
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        mma_16816(o[mt][2 * dp], p[mt][kk], b[0], b[1]);
        mma_16816(o[mt][2 * dp + 1], p[mt][kk], b[2], b[3]);
      }
    }
}
// @cuir-end pv

// @cuir-region epilogue
// O / l -> o (rows < Nq), LSE = ln(sum exp(score)) -> lse. A row with l == 0 attended nothing:
// O = 0, LSE = -inf.
__device__ __forceinline__ void epilogue(const float (&o)[M_TILES][D_TILES][4], const OnlineSoftmax& sm,
                                         elem_t* o_head, float* lse_head, int q_row0, int len_q, int lane) {
  const int tq = lane % QUAD;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = sm.l[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv_l = l > 0.f ? 1.f / l : 0.f;
      const int q_idx = q_row0 + mt * MMA_M + r * 8;
      if (q_idx >= len_q) continue;
      u32* dst = reinterpret_cast<u32*>(o_head + static_cast<i64>(q_idx) * HEAD_DIM + 2 * tq);
#pragma unroll
      for (int dt = 0; dt < D_TILES; ++dt)
        dst[dt * MMA_N / 2] = pack2(o[mt][dt][2 * r] * inv_l, o[mt][dt][2 * r + 1] * inv_l);
      if (tq == 0) lse_head[q_idx] = l > 0.f ? fmaf(sm.m[mt][r], sm.scale_log2, lg2(l)) * LN2 : neg_inf();
    }
}
// @cuir-end epilogue

// ---------------------------------------------------------------- the CTA: pipeline skeleton
struct Cta {
  const elem_t *k, *v;        // kernel parameters (constant bank: cost no registers)
  i64 kv_head;                // element offset of this CTA's kv head in k and v
  u32 s_k;                    // shared-memory base of the K ring; the V ring follows it
  u32 q_lane, k_lane, v_lane; // ldmatrix bases (lane_base) into Q, slot 0 of K, slot 0 of V
  LoadLane ll;
  int b, h, q_row0, len_k;    // q_row0: row of this lane's first fragment row (in [0, Nq))
  int q_shift;                // Nk - Nq: row r is query position q_idx = r + q_shift
  int kv_col_lane;            // column of this lane's first S element within a KV tile
  float sm_scale;
  const VariantArgs* va;      // the kernel's variant arguments (parameter space)
  KvRange kv;
  int count;                  // KV tiles to visit (kv_count)
  int slot;                   // ring slot of the current tile

  // K and V of the i-th visited tile into ring slot `fill` as one commit group; an empty group past
  // the end keeps the wait count in step() right at the ragged end too.
  __device__ __forceinline__ void prefetch(int i, int fill) {
    if (i < count) {
      const int tile = tile_at(kv, i);
      load_kv_tile(s_k + fill * KV_TILE_BYTES, k + kv_head, tile, len_k, ll);
      load_kv_tile(s_k + (STAGES + fill) * KV_TILE_BYTES, v + kv_head, tile, len_k, ll);
    }
    cp_async_commit();
  }

  // One KV tile, one barrier. Commit groups: Q, tile 0, tile 1, ...; STAGES - 1 tiles are in flight
  // ahead. The barrier publishes this tile's K and V to every warp and tells the CTA that the slot
  // of tile - 1 is free for the next prefetch; no other barrier is needed, so warps drift apart
  // within a tile and one warp's softmax overlaps another's MMAs.
  template <bool PARTIAL>
  __device__ __forceinline__ void step(int i, int tile, float (&o)[M_TILES][D_TILES][4], OnlineSoftmax& sm) {
    cp_async_wait<STAGES - 2>();   // K(tile), V(tile) (and Q before them) landed for this thread
    __syncthreads();
    prefetch(i + STAGES - 1, slot == 0 ? STAGES - 1 : slot - 1);
#pragma unroll 1
    for (int part = 0; part < KV_SPLIT; ++part) {   // SUB_N rows further in the slot: same swizzle phase
      const u32 rows = slot * KV_TILE_BYTES + part * SUB_N * ROW_BYTES;
      float s[M_TILES][N_TILES][4];
      qk_tile(s, q_lane, k_lane + rows);
      score_tile<PARTIAL>(*va, s, b, h, q_row0 + q_shift, tile * BLOCK_N + part * SUB_N + kv_col_lane, len_k,
                          sm_scale);
      sm.update(s, o);
      pv_tile(o, s, v_lane + rows);
    }
    slot = slot + 1 == STAGES ? 0 : slot + 1;
  }
};

}  // namespace fa2

extern "C" __global__ void __launch_bounds__(fa2::THREADS, MIN_BLOCKS)
fa2_sm80_fwd(const fa2::elem_t* __restrict__ q, const fa2::elem_t* __restrict__ k,
             const fa2::elem_t* __restrict__ v, fa2::elem_t* __restrict__ o, float* __restrict__ lse,
             int batch, int heads_q, int heads_kv, int len_q, int len_k, float sm_scale,
             const __grid_constant__ fa2::VariantArgs va) {
  using namespace fa2;
  extern __shared__ __align__(128) unsigned char smem[];
  // Causal query tiles differ in cost: launch the heaviest (last) first so the tail is short.
  const int q_tile = (IS_CAUSAL || fa2::kLongestFirst) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int q_begin = q_tile * BLOCK_M;

  // @cuir-region head_map
  const int b = blockIdx.z, h = blockIdx.y;
  const int h_kv = h / (heads_q / heads_kv);   // GQA / MQA: G consecutive query heads share one kv head
  const i64 q_off = (static_cast<i64>(b) * heads_q + h) * len_q;     // in rows
  const i64 kv_off = (static_cast<i64>(b) * heads_kv + h_kv) * len_k;
  // @cuir-end head_map

  const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp_row0 = (tid / WARP_SIZE) * WARP_ROWS;
  const u32 s_q = smem_u32(smem);
  Cta cta;
  cta.ll = load_lane(tid);
  cta.b = b;
  cta.h = h;
  cta.q_row0 = q_begin + warp_row0 + lane / QUAD;
  cta.kv_col_lane = 2 * (lane % QUAD);
  cta.len_k = len_k;
  cta.q_shift = len_k - len_q;
  cta.sm_scale = sm_scale;
  cta.k = k;
  cta.v = v;
  cta.kv_head = kv_off * HEAD_DIM;
  cta.s_k = s_q + Q_BYTES;
  // Q: lanes 0-15 rows 0-15 / k 0-7, lanes 16-31 the same rows / k 8-15 (A fragment a0..a3).
  cta.q_lane = lane_base(s_q, warp_row0 + lane % 16, lane / 16, lane);
  // K: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) = b0 b1 of two n-tiles.
  cta.k_lane = lane_base(cta.s_k, lane % 8 + (lane / 16) * 8, (lane / 8) % 2, lane);
  // V (transposed): (kv 0-7, d 0-7), (kv 8-15, d 0-7), (kv 0-7, d 8-15), (kv 8-15, d 8-15).
  cta.v_lane = lane_base(cta.s_k + STAGES * KV_TILE_BYTES, lane % 8 + ((lane / 8) % 2) * 8, lane / 16, lane);
  cta.va = &va;
  // kv_range sees query positions: the tile's rows [q_begin, ...) sit at q_begin + Nk - Nq, ...,
  // and the last query at Nk - 1.
  cta.kv = kv_range(va, b, h, q_tile, q_begin + cta.q_shift, len_k, len_k);
  cta.count = kv_count(cta.kv);
  cta.slot = 0;

  load_q(s_q, q + q_off * HEAD_DIM, q_begin, len_q, cta.ll);
  cp_async_commit();
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) cta.prefetch(i, i);

  float acc[M_TILES][D_TILES][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][dt][c] = 0.f;
  OnlineSoftmax sm;
  sm.init(va, s_unit(sm_scale));

  // The leading full tiles run with no mask code; from the first partial tile on, every tile is
  // masked (one loop body each keeps register pressure as low as two straight loops; a full tile
  // after a partial one is only slower, not wrong: its mask is all true).
  int i = 0;
  for (; i < cta.count; ++i) {
    const int tile = tile_at(cta.kv, i);
    if (tile_partial(va, cta.kv, tile)) break;
    cta.step<false>(i, tile, acc, sm);
  }
  for (; i < cta.count; ++i) cta.step<true>(i, tile_at(cta.kv, i), acc, sm);
  cp_async_wait<0>();   // nothing may be in flight at exit (no tile visited: Q only)

  epilogue(acc, sm, o + q_off * HEAD_DIM, lse + q_off, cta.q_row0, len_q, lane);
}
