// fa2_bwd_sm80/common.cuh: PTX helpers and warp-level GEMM building blocks of the backward kernels
// (mma.sync.m16n8k16, ldmatrix, cp.async). No other header: nvcc and NVRTC build the same text.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, tq = lane % 4):
//   A 16x16: a0 (row g, k 2tq..2tq+1), a1 (g + 8, same k), a2 (g, k + 8), a3 (g + 8, k + 8)
//   B 16x8:  b0 (k 2tq..2tq+1, col g), b1 (k + 8, col g)
//   C 16x8:  c0 c1 (row g, cols 2tq, 2tq + 1), c2 c3 (row g + 8, same cols)
// Two adjacent n8 C tiles, rounded to 16 bit, are exactly one A fragment: that is how P^T and dS^T
// feed the dV, dK (and deterministic dQ) GEMMs from registers.
//
// Shared tiles are [rows][cols] of 16-bit elements with 16-byte chunks XOR-swizzled by row % 8
// (rows are whole multiples of 128 bytes), so ldmatrix phases and cp.async are bank-conflict free.
#pragma once

namespace fa2b {

typedef unsigned int u32;
typedef unsigned short elem_t;   // raw 16-bit storage of fp16 / bf16
typedef long long i64;

constexpr int WARP_SIZE = 32;
constexpr int MMA_M = 16, MMA_N = 8, MMA_K = 16;
constexpr int ELEM_BYTES = 2;
constexpr int CHUNK_BYTES = 16;                    // one cp.async / one ldmatrix row
constexpr int CHUNK_ELEMS = CHUNK_BYTES / ELEM_BYTES;
constexpr int SWIZZLE_ROWS = 8;
constexpr int QUAD = 4;                            // lanes sharing one fragment row
constexpr u32 FULL_MASK = 0xffffffffu;

constexpr float LOG2E = 1.4426950408889634f;
constexpr u32 NEG_INF_BITS = 0xff800000u;

__device__ __forceinline__ float neg_inf() { return __int_as_float(NEG_INF_BITS); }

// ---------------------------------------------------------------- PTX helpers
// Every inline-PTX statement of the backward is in this block; FA2B_HOST_EMU (the CPU tests)
// swaps in the C++ emulation of emu/ptx_emu.h, which runs the kernels on fibers.
#ifndef FA2B_HOST_EMU
__device__ __forceinline__ float ex2(float x) {   // ex2.approx(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// 16-byte async copies (L2 only); the zfill form copies src_bytes and zero-fills the rest.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_16_zfill(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4-byte async copy (LSE, D of one query row); src_bytes = 0 writes 0.f and reads nothing.
__device__ __forceinline__ void cp_async_4_zfill(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
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
#define FA2B_MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#define FA2B_CVT "cvt.rn.bf16x2.f32"
#else
#define FA2B_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define FA2B_CVT "cvt.rn.f16x2.f32"
#endif

__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm(FA2B_MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 -> one register of two 16-bit values (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm(FA2B_CVT " %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// One 16-bit element (raw bits) -> fp32, exactly.
__device__ __forceinline__ float to_f32(elem_t x) {
#if IS_BF16
  return __uint_as_float(static_cast<u32>(x) << 16);
#else
  float f;
  asm("{.reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "h"(x));
  return f;
#endif
}

__device__ __forceinline__ void st_shared_u32(u32 addr, u32 x) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
}

// Adds (a, b) into p[0], p[1] of global memory (fp32, result unused: a reduction, not an atomic
// read-modify-write round trip). sm_90 has a 2-wide form: half the operations.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(b) : "memory");
#endif
}

#else
#include "emu/ptx_emu.h"
#endif  // FA2B_HOST_EMU

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Byte offset of (row, chunk) in a tile with ROW_BYTES per row, chunks XOR-swizzled by row % 8.
template <int ROW_BYTES>
__device__ __forceinline__ u32 swizzle(int row, int chunk) {
  static_assert(ROW_BYTES % (SWIZZLE_ROWS * CHUNK_BYTES) == 0, "swizzled rows are multiples of 128 bytes");
  return static_cast<u32>(row * ROW_BYTES + (chunk ^ (row % SWIZZLE_ROWS)) * CHUNK_BYTES);
}

// ldmatrix lane addresses. Lane L addresses row L % 8 of matrix L / 8; every row it addresses has
// row % 8 == L % 8 and tiles start on 128-byte boundaries, so chunk (2 step + hi) ^ (L % 8) differs
// from chunk hi ^ (L % 8) by an XOR with (2 step % 8) << 4 in address bits 4-6 plus whole groups
// of 8 chunks: one base per operand (lane_base), each step an XOR and an add (ldsm_addr).
template <int ROW_BYTES>
__device__ __forceinline__ u32 lane_base(u32 tile, int row, int hi, int lane) {
  return tile + row * ROW_BYTES + (hi ^ (lane % SWIZZLE_ROWS)) * CHUNK_BYTES;
}
template <int ROW_BYTES>
__device__ __forceinline__ u32 ldsm_addr(u32 base, int step, int row_offset) {
  return (base ^ ((2 * step) % SWIZZLE_ROWS) * CHUNK_BYTES) + (2 * step / SWIZZLE_ROWS) * SWIZZLE_ROWS * CHUNK_BYTES +
         row_offset * ROW_BYTES;
}
// Lane bases of the three operand shapes (row0: the warp's first row / column in the tile).
//   a_rows: A [m][k] stored row-major (ldmatrix):             rows m, chunks k
//   b_rows: B stored [n][k] (ldmatrix), i.e. X^T of a [n][k] tile: rows n, chunks k
//   t_rows: stored [k][x] read transposed (ldmatrix.trans):   rows k, chunks x (B [k][n] or A [k][m])
template <int ROW_BYTES>
__device__ __forceinline__ u32 a_rows(u32 tile, int row0, int lane) {
  return lane_base<ROW_BYTES>(tile, row0 + lane % 16, lane / 16, lane);
}
template <int ROW_BYTES>
__device__ __forceinline__ u32 b_rows(u32 tile, int row0, int lane) {
  return lane_base<ROW_BYTES>(tile, row0 + lane % 8 + (lane / 16) * 8, (lane / 8) % 2, lane);
}
template <int ROW_BYTES>
__device__ __forceinline__ u32 bt_rows(u32 tile, int lane) {   // B [k][n] transposed: matrices (k, n) 00 10 01 11
  return lane_base<ROW_BYTES>(tile, lane % 8 + ((lane / 8) % 2) * 8, lane / 16, lane);
}
template <int ROW_BYTES>
__device__ __forceinline__ u32 at_rows(u32 tile, int lane) {   // A [k][m] transposed: matrices (k, m) 00 01 10 11
  return lane_base<ROW_BYTES>(tile, lane % 8 + (lane / 16) * 8, (lane / 8) % 2, lane);
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&c)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.f;
}

// c[MT x NT] += A B^T with A [m][k] (a_lane = a_rows) and B [n][k] (b_lane = b_rows), K = 16 KSTEPS.
template <int MT, int NT, int KSTEPS, int RB_A, int RB_B>
__device__ __forceinline__ void gemm_ss_abt(float (&c)[MT][NT][4], u32 a_lane, u32 b_lane) {
  static_assert(NT % 2 == 0, "B is read as n16 pairs");
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], ldsm_addr<RB_A>(a_lane, kk, mt * MMA_M));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      ldmatrix_x4(b, ldsm_addr<RB_B>(b_lane, kk, np * 2 * MMA_N));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816(c[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816(c[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// c[MT x NT] += A B with A in registers (16-bit A fragments, KSTEPS of them) and B [k][n] in
// shared memory (b_lane = bt_rows); n_step0 = first n16 pair of this warp's columns.
template <int MT, int NT, int KSTEPS, int RB_B>
__device__ __forceinline__ void gemm_rs_ab(float (&c)[MT][NT][4], const u32 (&a)[MT][KSTEPS][4], u32 b_lane,
                                           int n_step0) {
  static_assert(NT % 2 == 0, "B is read as n16 pairs");
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      ldmatrix_x4_trans(b, ldsm_addr<RB_B>(b_lane, n_step0 + np, kk * MMA_K));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816(c[mt][2 * np], a[mt][kk], b[0], b[1]);
        mma_16816(c[mt][2 * np + 1], a[mt][kk], b[2], b[3]);
      }
    }
}

// c[MT x NT] += A B with A stored [k][m] (a_lane = at_rows, m_step0 = first m16 tile of the warp)
// and B stored [k][n] (b_lane = bt_rows, n_step0 = first n16 pair), both read transposed.
template <int MT, int NT, int KSTEPS, int RB_A, int RB_B>
__device__ __forceinline__ void gemm_ss_atb(float (&c)[MT][NT][4], u32 a_lane, int m_step0, u32 b_lane,
                                            int n_step0) {
  static_assert(NT % 2 == 0, "B is read as n16 pairs");
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4_trans(a[mt], ldsm_addr<RB_A>(a_lane, m_step0 + mt, kk * MMA_K));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      ldmatrix_x4_trans(b, ldsm_addr<RB_B>(b_lane, n_step0 + np, kk * MMA_K));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816(c[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816(c[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// fp32 C fragments [MT][2 KSTEPS] -> 16-bit A fragments [MT][KSTEPS] (round to nearest even).
template <int MT, int KSTEPS>
__device__ __forceinline__ void to_a_frags(u32 (&a)[MT][KSTEPS][4], const float (&c)[MT][2 * KSTEPS][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      a[mt][kk][0] = pack2(c[mt][2 * kk][0], c[mt][2 * kk][1]);
      a[mt][kk][1] = pack2(c[mt][2 * kk][2], c[mt][2 * kk][3]);
      a[mt][kk][2] = pack2(c[mt][2 * kk + 1][0], c[mt][2 * kk + 1][1]);
      a[mt][kk][3] = pack2(c[mt][2 * kk + 1][2], c[mt][2 * kk + 1][3]);
    }
}

// Copies of [ROWS][COLS] tiles global -> swizzled shared memory by THREADS threads: each thread owns
// one chunk column, so its global and shared offsets are computed once and each further row is an
// immediate. Rows at or past `len` are zero-filled from a clamped, valid address.
template <int COLS, int THREADS>
struct TileLoader {
  static constexpr int ROW_CHUNKS = COLS / CHUNK_ELEMS;
  static constexpr int ROW_BYTES = COLS * ELEM_BYTES;
  static constexpr int LOAD_ROWS = THREADS / ROW_CHUNKS;   // rows one pass of the CTA covers
  static_assert(LOAD_ROWS > 0 && LOAD_ROWS % SWIZZLE_ROWS == 0, "one copy pass must keep the swizzle phase");
  int g_off, row0;
  u32 s_off;

  __device__ __forceinline__ explicit TileLoader(int tid)
      : g_off((tid / ROW_CHUNKS) * COLS + (tid % ROW_CHUNKS) * CHUNK_ELEMS), row0(tid / ROW_CHUNKS),
        s_off(swizzle<ROW_BYTES>(tid / ROW_CHUNKS, tid % ROW_CHUNKS)) {}

  template <int ROWS>
  __device__ __forceinline__ void load(u32 s_tile, const elem_t* head, int row_begin, int len) const {
    static_assert(ROWS % LOAD_ROWS == 0, "tiles load in whole passes");
    const elem_t* src = head + static_cast<i64>(row_begin) * COLS + g_off;
    if (row_begin + ROWS <= len) {   // whole tile inside the sequence (CTA-uniform): no predicates
#pragma unroll
      for (int i = 0; i < ROWS / LOAD_ROWS; ++i)
        cp_async_16(s_tile + s_off + i * LOAD_ROWS * ROW_BYTES, src + i * LOAD_ROWS * COLS);
      return;
    }
    const int rows_left = len - row_begin - row0;
#pragma unroll
    for (int i = 0; i < ROWS / LOAD_ROWS; ++i) {
      const bool in = i * LOAD_ROWS < rows_left;
      cp_async_16_zfill(s_tile + s_off + i * LOAD_ROWS * ROW_BYTES, in ? src + i * LOAD_ROWS * COLS : head,
                        in ? CHUNK_BYTES : 0);
    }
  }
};

// ROWS floats of one query tile (LSE or D) -> shared memory; rows at or past `len` read as 0.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_row_vec(u32 s_vec, const float* head, int row_begin, int len, int tid) {
#pragma unroll
  for (int r = tid; r < ROWS; r += THREADS) {
    const bool in = row_begin + r < len;
    cp_async_4_zfill(s_vec + r * 4, in ? head + row_begin + r : head, in ? 4 : 0);
  }
}

}  // namespace fa2b
