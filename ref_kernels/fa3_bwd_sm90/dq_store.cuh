// How fa3_bwd_sm90 adds each step's dQ part (64 queries x 64 columns, f32 wgmma fragment) into
// the fp32 accumulator: DQ_MODE 0 per-thread atomics, DQ_MODE 1 shared memory + one bulk
// reduce-add per consumer (included by kernel.cu inside namespace fa3b, after consumer.cuh's
// Consumer). Why DQ_MODE 1: mode 0 issues 16 red.global.add.v2 per consumer thread per step
// (4096 per CTA step, each warp instruction 8 sectors) from the warps that should be issuing the
// next GEMMs; mode 1 costs them 8 st.shared.v4, a warpgroup barrier and one bulk
// instruction (thread 0); the L2 sees 16 KB bulk adds. (A writer warp in the producer warpgroup,
// as FlashAttention-3/4 do it, spilled 4-40 bytes under that warpgroup's 24 registers.)
#pragma once

// ---- DQ_MODE 0: row-major accumulator [B, Hq, Nq, D], red.global.add.v2.f32 per thread pair.
__device__ __forceinline__ void red_add2(float* addr, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

__device__ __forceinline__ void add_dq_atomic(const Consumer& cs, float* __restrict__ dq_accum,
                                              const float (&dq)[kDqRegs], int bh_q, int m0, int seqlen_q) {
  const int col_base = kDqSplitN ? cs.c * kDqCols : 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q_row = m0 + cs.row0() + 8 * h;
    if (q_row >= seqlen_q) continue;
    float* row = dq_accum + (size_t(bh_q) * seqlen_q + q_row) * kHeadDim + col_base + cs.col0();
#pragma unroll
    for (int j = 0; j < kDqCols / 8; ++j) red_add2(row + 8 * j, dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
  }
}

// ---- DQ_MODE 1: tiled accumulator. Per (bh_q, query tile m, part p) a block of kDqPartFloats
// floats in fragment order: float4 number (j * 128 + t) holds thread t's dq[4j .. 4j + 3], i.e.
// rows r, r + 8 (r = 16 (t / 32) + (t % 32) / 4) and columns 64p + 8j + 2 (t % 4) + {0, 1}.
// Consecutive threads store consecutive float4s: no bank conflicts, one contiguous 16 KB block.
__device__ __forceinline__ size_t dq_tile_offset(int bh_q, int m, int part, int num_m) {
  return ((size_t(bh_q) * num_m + m) * kDqParts + part) * kDqPartFloats;
}

__device__ __forceinline__ void bulk_reduce_add(float* gdst, uint32_t ssrc, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(gdst), "r"(ssrc), "r"(bytes) : "memory");
}
template <int kPending> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Before the step's dS barrier (ds_ready / wg_sync): thread 0's bulk add of two steps ago has
// read slot it % 2, so after the barrier every thread may overwrite it. The bulk groups are per
// thread: thread 0 commits one per step, so "all but the newest one read" is that add.
__device__ __forceinline__ void dq_slot_wait(const Consumer& cs) {
  if (kDqBulk && !kDqWriter && cs.wg_thread == 0) bulk_wait_read<kDqSlots - 1>();
}

__device__ __forceinline__ uint32_t dq_slot(uint32_t dq_smem, int it, int c) {
  return dq_smem + ((it % kDqSlots) * kConsumers + c) * kDqPartBytes;
}

// Store the fragment into slot it % 2 of this consumer, make it visible to the bulk copy (async
// proxy), and let thread 0 add the 16 KB block into the tiled accumulator. DQ_WRITER: the slot is
// first waited for (dq_empty of the slot: the writer's add of step it - 2 has read it), and the writer
// warp is told (dq_full of the slot, an arrive: the warpgroup goes on to its dK wait at once) instead.
__device__ __forceinline__ void put_dq_smem(const Consumer& cs, uint32_t dq_smem, const float (&dq)[kDqRegs],
                                            int it, float* __restrict__ dst) {
  const uint32_t slot = dq_slot(dq_smem, it, cs.c);
  const uint32_t base = slot + cs.wg_thread * 16;
  if (kDqWriter && it >= kDqSlots) named_sync(dq_empty_bar(cs.c, it), kDqBarThreads);
#pragma unroll
  for (int j = 0; j < kDqChunks; ++j)
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(base + j * kWgThreads * 16),
                 "f"(dq[4 * j]), "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3]) : "memory");
  fa3::fence_async_smem();
  if constexpr (kDqWriter) {
    named_arrive(dq_full_bar(cs.c, it), kDqBarThreads);
    return;
  }
  cs.wg_sync();
  if (cs.wg_thread == 0) {
    bulk_reduce_add(dst, slot, kDqPartBytes);
    fa3::tma_store_commit();
  }
}

// DQ_WRITER: the consumer's last kDqSlots parts are read before its slots are reused (EPILOGUE
// stages dK / dV there) or the CTA ends: one dq_empty wait per writer arrive the loop did not wait
// for (steps total - 2, total - 1), so every barrier phase the writer opened completes.
__device__ __forceinline__ void dq_drain(const Consumer& cs, int total) {
  if constexpr (kDqWriter)
    for (int it = max(total - kDqSlots, 0); it < total; ++it) named_sync(dq_empty_bar(cs.c, it), kDqBarThreads);
}

// DQ_WRITER: warp kDqWriterWarp of the producer warpgroup (24 registers), the steps in the consumers'
// order (g, then the query tiles). Per step and consumer: wait for its part (dq_full), lane 0 adds it;
// then lane 0 waits until both adds have read shared memory and the warp frees the slots (dq_empty).
__device__ __forceinline__ void dq_writer(const Smem& sm, const Problem& pb, QRange qr, bool has_work,
                                          float* __restrict__ dq_accum, int lane) {
  const int num_m = (pb.seqlen_q + kBlockM - 1) / kBlockM;
  const int steps = kRangeRuns ? q_runs_count() : qr.m_end - qr.m_begin, total = has_work ? steps * pb.group : 0;
  int g = 0, i = 0;
  for (int it = 0; it < total; ++it) {
    const int m = kRangeRuns ? q_runs_tile(i) : sweep_tile(qr, i, steps);   // qr.m_begin + i unless M_ROTATE
    float* tile = dq_accum + dq_tile_offset(pb.bh_q(g), m, 0, num_m);
#pragma unroll
    for (int c = 0; c < kConsumers; ++c) {
      named_sync(dq_full_bar(c, it), kDqBarThreads);
      if (lane == 0) {
        bulk_reduce_add(tile + (kDqSplitN ? c : 0) * kDqPartFloats, dq_slot(sm.dq(), it, c), kDqPartBytes);
        fa3::tma_store_commit();
      }
    }
    if (lane == 0) bulk_wait_read<0>();
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kConsumers; ++c) named_arrive(dq_empty_bar(c, it), kDqBarThreads);
    i = i + 1 == steps ? 0 : i + 1;
    g += i == 0;
  }
}

static_assert(kDqChunks * 4 * kWgThreads == kDqPartFloats && kDqRegs == 4 * kDqChunks,
              "a dQ part is 8 float4 per consumer thread");
