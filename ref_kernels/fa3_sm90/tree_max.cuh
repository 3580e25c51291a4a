// TREE_MAX (Fa3Config.tree_max; off, session 17b): the softmax's row max as a tree, both row halves at once.
// kernel.cu includes this after exp2_emu.cuh, just before consumer.cuh; it holds no region.
//
// Why: at D 64 the step is the consumers' turn chain (session 17: exp2 on the FMA pipe lengthened it; the MUFU
// is busy, not binding), and the first thing after a consumer's QK wait is its row max. The region's softmax
// folds each row half's 32 scores into one running max, a chain of 17 dependent FMNMX (its SASS: half 0's chain,
// its two shuffles, then half 1's chain interleaved with half 0's exponentials, half 1's shuffles ~100
// instructions later). Here each half is a pairwise tree (16 independent FMNMX, then 8, 4, 2, 1: depth 5), both
// halves' trees and their shuffles side by side, so both halves' exp2 arguments are ready ~12 FMNMX latencies
// and a shuffle round trip earlier.
//
// Bitwise the same result: max is exact in any order. The region starts its chain at -inf, the tree does not;
// they differ only where all of a lane's 32 scores of a half are NaN (-inf against NaN), and both then give
// row_max through fmaxf(row_max, x * scale), which drops a NaN. (The sign of a zero max may differ: exp2 of
// either zero is 1.)
//
// The dense kernel only, and only where the softmax region is the reference's (FA3_SOFTMAX_SPLIT):
// consumer.cuh's loop calls softmax_update / softmax_args; with TREE_MAX set they name the functions below
// (macros, as exp2_emu.cuh's), so the loop's text and the patches anchored on it stay as they are. With
// EXP2_EMU too, softmax_exps is already exp2_emu's.
#pragma once

#ifndef TREE_MAX
#define TREE_MAX 0
#endif

#if TREE_MAX && defined(FA3_DENSE_KV_RANGE) && defined(FA3_SOFTMAX_SPLIT)
constexpr bool kTreeMax = true;

// v[0] = the max of v[0, N): the upper part folded onto the lower, N -> ceil(N / 2) values a level (any N, e.g.
// 22 at BLOCK_N 176); a template level by level, so that every index is a constant (v stays in registers)
template <int N, int M>
__device__ __forceinline__ void fold_max(float (&v)[M]) {
  if constexpr (N > 1) {
    constexpr int kHalf = (N + 1) / 2;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) v[i] = fmaxf(v[i], v[i + kHalf]);
    fold_max<kHalf>(v);
  }
}

// softmax_args (the softmax region) with the row max of both halves as trees, their shuffles paired
__device__ __forceinline__ void softmax_args_tree(const VariantArgs& va, float (&s)[kSRegs],
                                                  SoftmaxState& st, float (&rescale)[2],
                                                  float score_scale) {
  const float scale_log2 = score_scale * kLog2e;
  constexpr int kGroups = kBlockN / 8;                     // column groups: two scores of a half each
  float mx[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float v[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) v[j] = fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]);
    fold_max<kGroups>(v);
    mx[half] = v[0];
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) mx[half] = fmaxf(mx[half], __shfl_xor_sync(kFullMask, mx[half], 1));
#pragma unroll
  for (int half = 0; half < 2; ++half) mx[half] = fmaxf(mx[half], __shfl_xor_sync(kFullMask, mx[half], 2));
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float m = fmaxf(st.row_max[half], mx[half] * score_scale);
    const float base = (m == kNegInf ? 0.f : m) * kLog2e;   // a row with nothing attended yet
    rescale[half] = fast_exp2(st.row_max[half] * kLog2e - base);
    st.row_max[half] = m;
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        x = fmaf(x, scale_log2, -base);
      }
  }
}
// softmax_update = the tree's arguments, then the exponentials (softmax_exps: the region's, or exp2_emu's)
__device__ __forceinline__ void softmax_update_tree(const VariantArgs& va, float (&s)[kSRegs], SoftmaxState& st,
                                                    float (&rescale)[2], float score_scale) {
  softmax_args_tree(va, s, st, rescale, score_scale);
  softmax_exps(s, st, rescale);
}
#undef softmax_update
#define softmax_args softmax_args_tree
#define softmax_update softmax_update_tree
#else
constexpr bool kTreeMax = false;
#endif
