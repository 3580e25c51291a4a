// Host emulation of the CUDA device API the backward kernels use, for CPU tests (no GPU here or in
// CI). Every CUDA thread of a CTA runs as a fiber (own stack, cooperative switches); warp-wide
// operations (ldmatrix, mma.sync, shfl) complete when all 32 lanes of the warp reached the same
// one, __syncthreads when all threads of the CTA did. Out-of-bounds shared-memory addresses,
// divergent warp operations, deadlocks and cp.async still in flight at exit abort with a message.
// Force-included (g++ -include) before kernel.cu, built with -DFA2B_HOST_EMU.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n)
#define __restrict__ __restrict

struct EmuDim { unsigned x, y, z; };
extern EmuDim threadIdx, blockIdx, gridDim, blockDim;
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __int_as_float(unsigned x) { return __uint_as_float(x); }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

constexpr size_t EMU_SMEM_MAX = 232448;
extern unsigned char smem[];

namespace emu {
[[noreturn]] void fail(const char* what, long long a = 0, long long b = 0);
void syncthreads();
float shfl_xor(float v, int lane_mask);
void ldmatrix(uint32_t (&r)[4], uint32_t addr, bool trans);
void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16);
void cp_async(uint32_t dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);
void check_smem(uint32_t addr, int bytes);
void set_schedule(const char* text);
}  // namespace emu

inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<size_t>(static_cast<const unsigned char*>(p) - smem);
}
inline void __syncthreads() { emu::syncthreads(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) { return emu::shfl_xor(v, lane_mask); }
