// hopper_ptx.cuh: the PTX wrappers fa3_sm90 uses (shared-memory addresses, mbarriers, TMA loads
// and stores, fences, named barriers, setmaxnreg, wgmma fences and waits, packing), split out of
// kernel.cu so that the kernel file holds the traits, the CuIR regions and the roles.
// Included by kernel.cu after its parameter macros (pack2 reads DTYPE_BF16), with -I
// ref_kernels/fa3_sm90; no variant-specific code lives here.
#pragma once
#if !defined(__CUDACC_RTC__)   // NVRTC: kernel.cu declares CUtensorMap and the fixed-width types
#include <cuda.h>
#include <stdint.h>
#endif

namespace fa3 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
#if MBAR_SLEEP
      // MBAR_SLEEP (Fa3Config.mbar_sleep, off; every head dim since session 15): try_wait with a
      // suspend-time hint, as CUTLASS's ClusterBarrier::wait (0x989680 ns): the warp sleeps in the barrier
      // (NANOSLEEP.SYNCS) until its phase completes instead of retrying. Session 14 mid ncu (D 256 causal
      // 8k): ours issued 19 SYNCS, 21 BRA and 14 YIELD per KV step per consumer warp (FA4 6 / 4 / 0),
      // retries of the K / V waits that take issue slots from the other consumer's softmax on the same
      // scheduler; session 14 final: D 256 frz 691.2 vs fr 690.8 TFLOPS (no gain there).
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity), "r"(0x989680) : "memory");
#else
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
#endif
}
// mbar_wait with the suspend-time hint whatever MBAR_SLEEP says (kernel.cu PRODUCER_SLEEP: the producer's waits).
__device__ __forceinline__ void mbar_wait_sleep(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity), "r"(0x989680) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)),
      "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
// 4-D: the forward kernel's maps are (D, N, H, B) with a box of one head of one batch, so any
// [B, H, N, D] view whose strides are 16-byte multiples is read in place ([B, N, H, D] memory too).
// kPolicy: an L2 cache policy (kL2EvictFirst / kL2EvictLast, CUTLASS's CacheHintSm90 values) for
// the `.L2::cache_hint` form; 0: no hint.
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kL2EvictLast = 0x14F0000000000000ull;
template <uint64_t kPolicy = 0>
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  if constexpr (kPolicy == 0) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)),
        "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)),
        "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(kPolicy) : "memory");
  }
}
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void tma_store_wait_read() {   // smem of earlier stores may be reused
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// A 4-D box of `map` into L2 (no shared memory, no barrier): the next tile's Q ahead of its load.
__device__ __forceinline__ void tma_prefetch_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void fence_async_smem() {   // generic-proxy writes -> TMA reads
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
template <int kRegs> __device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Registers touched by a wgmma must not be moved by the compiler across fence/wait.
template <int kN> __device__ __forceinline__ void reg_fence(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// Two floats -> one register of two 16-bit values (lo in the low half), round to nearest even.
// cvt packs its first source into the upper half. Plain PTX: no cuda_bf16.h, so NVRTC needs no
// toolkit headers.
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
#if DTYPE_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// A trivially copyable value stored / loaded word by word at a 32-bit shared-window address (no
// 64-bit generic pointer to keep in registers). The "memory" clobbers order them against the
// mbarrier arrive / wait that publish them.
// (memcpy: a device builtin under nvcc and NVRTC alike; __builtin_memcpy is not one under NVRTC.)
template <class T>
__device__ __forceinline__ void st_shared_words(uint32_t addr, const T& value) {
  static_assert(sizeof(T) % 4 == 0 && alignof(T) == 4, "32-bit words only");
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &value, sizeof(T));
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 4); ++i)
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr + 4 * i), "r"(w[i]) : "memory");
}
template <class T>
__device__ __forceinline__ T ld_shared_words(uint32_t addr) {
  static_assert(sizeof(T) % 4 == 0 && alignof(T) == 4, "32-bit words only");
  uint32_t w[sizeof(T) / 4];
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 4); ++i)
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[i]) : "r"(addr + 4 * i) : "memory");
  T value;
  memcpy(&value, w, sizeof(T));
  return value;
}

// The value, through an empty volatile asm: not merged with the same value computed elsewhere (CSE) nor
// hoisted, so what depends on it is computed where it is used.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// wgmma shared-memory descriptor, 128B swizzle. Address and offsets are encoded in 16-byte units.
constexpr uint64_t kDescSwizzle128 = 1ull << 62;
constexpr int kDescUnit = 16;
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, int lead_bytes, int stride_bytes) {
  return kDescSwizzle128 | (uint64_t(stride_bytes / kDescUnit) << 32) |
         (uint64_t(lead_bytes / kDescUnit) << 16) | uint64_t((addr & 0x3FFFF) / kDescUnit);
}

}  // namespace fa3
