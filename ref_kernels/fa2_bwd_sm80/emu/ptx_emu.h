// C++ stand-ins for the PTX helpers of common.cuh (included inside namespace fa2b when
// FA2B_HOST_EMU is defined; see host.h). Same names and signatures, same numerics up to the order
// of fp32 additions inside one mma.
__device__ __forceinline__ float ex2(float x) { return std::exp2(x); }
__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) { emu::cp_async(dst, src, 16, 16); }
__device__ __forceinline__ void cp_async_16_zfill(u32 dst, const void* src, int src_bytes) {
  emu::cp_async(dst, src, 16, src_bytes);
}
__device__ __forceinline__ void cp_async_4_zfill(u32 dst, const void* src, int src_bytes) {
  emu::cp_async(dst, src, 4, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(PENDING); }
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) { emu::ldmatrix(r, addr, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) { emu::ldmatrix(r, addr, true); }
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  emu::mma(c, a, b0, b1, IS_BF16 != 0);
}

__device__ __forceinline__ u32 f32_to_16(float f) {   // round to nearest even, as cvt.rn
#if IS_BF16
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#else
  _Float16 h = static_cast<_Float16>(f);
  unsigned short bits;
  std::memcpy(&bits, &h, 2);
  return bits;
#endif
}
__device__ __forceinline__ u32 pack2(float lo, float hi) { return f32_to_16(lo) | (f32_to_16(hi) << 16); }

__device__ __forceinline__ float to_f32(elem_t x) {
#if IS_BF16
  return __uint_as_float(static_cast<u32>(x) << 16);
#else
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return static_cast<float>(h);
#endif
}

__device__ __forceinline__ void st_shared_u32(u32 addr, u32 x) {
  emu::check_smem(addr, 4);
  std::memcpy(smem + addr, &x, 4);
}
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
  p[0] += a;   // one fiber runs at a time: a plain add is atomic here
  p[1] += b;
}
