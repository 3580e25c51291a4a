// TAIL_SPLIT's consumer side (kernel.cu includes this inside namespace fa3 after epilogue(), under
// #if TAIL_SPLIT; the work items and TailPlan are in tiles.cuh). It holds no region.
#pragma once

// A chunk of a split tail tile: this consumer's rows of the chunk's unnormalised O and their max /
// sum go to the workspace; the last chunk to arrive (per tile and consumer: a counter each) combines
// all of them, rescaled to the rows' overall max, and stores O and lse through epilogue(). Nothing
// waits for another CTA (the last to arrive does the work), and the combine order is fixed, so a
// rerun is bitwise equal.
__device__ __forceinline__ void tail_epilogue(const Consumer& cs, const Smem& sm, const CUtensorMap* tm_o,
                                              float* __restrict__ lse, float (&o)[kORegs],
                                              const SoftmaxState& st, const Tile& tl, const Problem& pb,
                                              int item) {
  const int tail = (item - pb.tail_start) / pb.tail_split, split = pb.tail_split;
  const Frag f = frag_coords(cs.wg_thread);
  const int row_base = cs.c * kWgRows + f.row0;
  // (read here, not carried in Problem: two more pointers there spilled in the 40-register producer)
  float* const ws_base = *reinterpret_cast<float* const*>(pb.tile_counter + 2);
  float* tile_ws = ws_base + size_t(tail) * split * kTailChunkFloats;
  float* chunk_ws = tile_ws + size_t((item - pb.tail_start) % split) * kTailChunkFloats;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = st.row_sum[half];
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    const int row = row_base + 8 * half;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j)
      *reinterpret_cast<float2*>(chunk_ws + row * kHeadDim + 8 * j + f.col0) =
          make_float2(o[4 * j + 2 * half], o[4 * j + 2 * half + 1]);
    if (cs.lane % 4 == 0) {
      chunk_ws[kBlockM * kHeadDim + row] = st.row_max[half];
      chunk_ws[kBlockM * (kHeadDim + 1) + row] = sum;
    }
  }
  __threadfence();                                         // every writer's stores before the count
  const uint32_t word = sm.o + cs.c * kOWgStride;          // a scratch word in this consumer's O rows
  if (cs.wg_thread == 0) tma_store_wait_read();            // (an earlier store has read them)
  cs.wg_sync();
  int* count = pb.tile_counter + 4 + tail * kConsumers + cs.c;
  if (cs.wg_thread == 0) st_shared_words(word, atomicAdd(count, 1));
  cs.wg_sync();
  if (ld_shared_words<int>(word) != split - 1) {           // not the last chunk: nothing to store
    if (kOInQ) {                                           // O staged in Q: free the slot as epilogue() does
      cs.wg_sync();                                        // (every thread has read the word)
      cs.release(sm.q_empty);
    }
    return;
  }
  __threadfence();
  float m[2], l[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    m[half] = kNegInf;
    for (int c = 0; c < split; ++c)
      m[half] = fmaxf(m[half], __ldcg(tile_ws + size_t(c) * kTailChunkFloats + kBlockM * kHeadDim + row_base + 8 * half));
    l[half] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
  for (int c = 0; c < split; ++c) {
    const float* ws = tile_ws + size_t(c) * kTailChunkFloats;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_base + 8 * half;
      const float mc = __ldcg(ws + kBlockM * kHeadDim + row);
      const float w = mc == kNegInf ? 0.f : exp2f((mc - m[half]) * kLog2e);
      l[half] += w * __ldcg(ws + kBlockM * (kHeadDim + 1) + row);
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        const float2 v = __ldcg(reinterpret_cast<const float2*>(ws + row * kHeadDim + 8 * j + f.col0));
        o[4 * j + 2 * half] += w * v.x;
        o[4 * j + 2 * half + 1] += w * v.y;
      }
    }
  }
  if (cs.wg_thread == 0) *count = 0;                       // all chunks counted: zero for the next launch
  SoftmaxState all;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    all.row_max[half] = m[half];
    all.row_sum[half] = cs.lane % 4 == 0 ? l[half] : 0.f;  // epilogue() sums the quad's four lanes
  }
  epilogue(cs, sm, tm_o, lse, o, all, tl, pb.seqlen_q, true);
}
