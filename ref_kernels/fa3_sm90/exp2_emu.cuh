// EXP2_EMU (Fa3Config.exp2_emu; off, session 17): part of the softmax's exponentials on the FMA pipe.
// kernel.cu includes this after the regions, just before consumer.cuh; it holds no region.
//
// Why: at D 64 a KV step's exponentials cost the MUFU what its GEMMs cost the tensor core. 192 x 128
// (three consumers): 3 warps x 66 MUFU x 8 cycles = 1584 MUFU cycles per sub-partition per step against
// 1536 tensor cycles per SM (both GEMMs of all three consumers), and the step takes ~2610 (FA4) / ~2730
// (ours) cycles under ncu (session 15, fwd15_ncu.json: tensor pipe 60-63% of active cycles in both). Two
// consumers at D 64 (128 x 128) are the same balance (1056 / 1024). The FMA pipe has room (242 fp32
// instructions a warp-step, ~0.3 of its issue), so moving a share of the exp2 there shortens the MUFU's
// part of the step. At D 128 the tensor core's part is twice the MUFU's: no gain expected there.
//
// EXP2_EMU=m (1..7): of the exponentials in a row's softmax, those of column groups j with j % 8 < m (m of
// every 8, i.e. m / 8 of them) are computed as 2^x = 2^round(x) * p(x - round(x)) with p a degree-3
// polynomial (relative error <= 1.02e-4 over [-0.5, 0.5], below bf16's 2^-9 rounding of P by 20x):
// FMNMX, 3 FADD, 3 FFMA and one LEA instead of one MUFU.EX2. The clamp at -127 makes -inf (a masked
// score) exactly +0 (n = -127, f = 0, p = 1: the exponent field becomes 0), so a row with nothing attended
// keeps row_sum == 0; between -127 and -126 the result is a denormal below 2^-126 (ex2.approx.ftz gives 0:
// negligible beside a row sum >= 1). Not bitwise equal to the MUFU path (a different approximation):
// checked by the rule against the float64 golden (tests/gpu/test_fa3_sm90.py -k s17).
//
// The dense kernel only (kDenseKernel: a lowered variant's softmax is its own), and only where the softmax
// region is the reference's (FA3_SOFTMAX_SPLIT). consumer.cuh's loop calls softmax_update / softmax_exps;
// with EXP2_EMU set they name the two functions below (macros scoped to this kernel's text after this
// point), so the loop's text, and the experiment patches that anchor on it, stay as they are.
#pragma once

#ifndef EXP2_EMU
#define EXP2_EMU 0
#endif

#if EXP2_EMU && defined(FA3_DENSE_KV_RANGE) && defined(FA3_SOFTMAX_SPLIT)
static_assert(EXP2_EMU >= 1 && EXP2_EMU <= 7, "EXP2_EMU is the number of every 8 column groups emulated, 1..7");
constexpr int kExp2Emu = EXP2_EMU;

// 2^x for x <= ~1 (the softmax's exp2 arguments: score * scale - row max, or -inf)
__device__ __forceinline__ float poly_exp2(float x) {
  constexpr float kRound = 12582912.f;                     // 1.5 * 2^23: x + this rounds x to an integer
  constexpr float kC1 = 0.6932829022f, kC2 = 0.2422109693f, kC3 = 0.05500892922f;   // minimax, rel. error
  x = fmaxf(x, -127.f);
  const float j = __fadd_rn(x, kRound);                    // round(x) in the low mantissa bits of j
  const float f = __fsub_rn(x, __fsub_rn(j, kRound));      // x - round(x) in [-0.5, 0.5], exact
  float p = __fmaf_rn(f, kC3, kC2);
  p = __fmaf_rn(p, f, kC1);
  p = __fmaf_rn(p, f, 1.f);                                // p(0) = 1 exactly
  // (j's bits << 23) = round(x) << 23 (mod 2^32: the constant's high bits shift out): add to p's exponent
  return __builtin_bit_cast(float, (__builtin_bit_cast(int, j) << 23) + __builtin_bit_cast(int, p));
}

// softmax_exps (the softmax region) with m of every 8 column groups through poly_exp2; the same sums in
// the same order.
__device__ __forceinline__ void softmax_exps_emu(float (&s)[kSRegs], SoftmaxState& st,
                                                 const float (&rescale)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        x = j % 8 < kExp2Emu ? poly_exp2(x) : fast_exp2(x);
        sum += x;
      }
    st.row_sum[half] = st.row_sum[half] * rescale[half] + sum;   // per-lane partial sum
  }
}
// softmax_update = softmax_args, then the exponentials (bitwise the same as the region's one-piece form)
__device__ __forceinline__ void softmax_update_emu(const VariantArgs& va, float (&s)[kSRegs], SoftmaxState& st,
                                                   float (&rescale)[2], float score_scale) {
  softmax_args(va, s, st, rescale, score_scale);
  softmax_exps_emu(s, st, rescale);
}
#define softmax_exps softmax_exps_emu
#define softmax_update softmax_update_emu
#else
constexpr int kExp2Emu = 0;
#endif
