// cuir_sigmoid_fma: a sigmoid on the FMA pipe instead of MUFU tanh.approx. Not emitted by the lowering
// (every share of FMA-pipe sigmoids measured slower on H100: cubridge/lower/NOTES.md v11);
// experiments/sigmoid_fma_share.py splices it into a lowered source, tests/gpu/test_cexpr_math.py
// checks its precision. Needs cexpr.PRELUDE before it.
// sigmoid without the MUFU pipe (about 18 FP32/INT ops, relative error under 2^-13.6 for every x;
// exactly 0 at -inf): exp(-z) = 2^(j + f) with j an integer (rounded by the 1.5 * 2^23 trick) and
// 2^f, |f| <= 1/2, a degree-3 minimax polynomial (relative error 2^-13.7) whose exponent field
// gets j added; then 1 / (1 + exp(-z)) by two Newton steps from the integer-subtraction guess.
__device__ __forceinline__ float cuir_sigmoid_fma(float x) {
  const float kMinusLog2e = -1.4426950408889634f, kRound = 12582912.f;
  const float z = fminf(fmaxf(x, -80.f), 80.f);
  const float t = __fmaf_rn(z, kMinusLog2e, kRound);
  const float j = __fsub_rn(t, kRound);
  const float f = __fmaf_rn(z, kMinusLog2e, -j);
  float p = __fmaf_rn(0.0551716685f, f, 0.2426111400f);
  p = __fmaf_rn(p, f, 0.6932609677f);
  p = __fmaf_rn(p, f, 0.9999280572f);
  const float d = 1.f + __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
  float r = __int_as_float(0x7ef311c3 - __float_as_int(d));
  r = __fmaf_rn(r, __fmaf_rn(-d, r, 1.f), r);
  r = __fmaf_rn(r, __fmaf_rn(-d, r, 1.f), r);
  return x > -80.f ? r : 0.f;
}
