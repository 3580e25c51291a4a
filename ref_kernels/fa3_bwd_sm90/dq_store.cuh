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

// ---- DQ_FUSE (session 16, vbwd16; off: the runtime's CUBRIDGE_BWD_FUSED_CONVERT=1 builds it): the dQ convert fused
// into the main kernel. fa3_bwd_dq_count (dq_fuse.cuh) counts, per (query head, query tile), the steps of every CTA that
// will add into the tile (the same runs / range the writer walks); the writer warp, once a step's adds have completed
// (wait_group, not .read), takes one off the tile's counter; the CTA that takes the last converts the tile (dQ =
// accumulator * scale, 16 bit) and writes zeros back over its accumulator lines (dirty in L2 already), so the next call
// needs no zeroing pass and no convert launch: the counters are back at 0 and the accumulator all zeros (the runtime
// keeps both per shape and stream). Tiles no step visits: the preprocess writes their dQ rows as zeros.
#ifndef DQ_FUSE
#define DQ_FUSE 0
#endif
constexpr bool kDqFuse = DQ_FUSE >= 1;
static_assert(DQ_FUSE >= 0 && DQ_FUSE <= 2, "DQ_FUSE must be 0 (convert launch), 1 (per-step counts) or 2 (per-CTA counts)");
#if DQ_FUSE
static_assert(kDqWriter && kDqBulk, "DQ_FUSE=1 needs DQ_WRITER=1 (the writer warp counts the completed adds)");
constexpr int kBarFuse = kBarDqEmpty0 + kDqSlots * kConsumers;   // the writer's last tile is queued: writer + consumers
static_assert(kBarFuse < 16, "DQ_FUSE's named barrier exceeds the 16 ids");
// The tiles this CTA completes go through a ring in shared memory, as units of one part's 16 rows (a row block: 8
// float4 per lane of a warp): the writer warp's lane 0 queues a completed tile's kFuseUnits units (head), the producer
// warpgroup's two idle warps (kFuseWarp0, kFuseWarp0 + 1) take them one at a time while the main loop runs (tail,
// claimed by compare-and-swap), and after their epilogue the consumers' 8 warps take what is left, so that a CTA's
// last tiles are converted by 10 warps, not 2, and a converter warp holds the CTA's end by one unit at most. `read`
// counts the entries read out of the ring (a slot is free again once read); the writer waits while the ring holds
// kFuseRing unread entries.
constexpr int kFuseUnits = kDqParts * 4;   // units per tile: (part, row block of 16 rows)
constexpr int kFuseRing = 8 * kFuseUnits;
constexpr int kFuseWarp0 = 2;
static_assert(kFuseWarp0 != kDqWriterWarp && kFuseWarp0 + 1 != kDqWriterWarp && kFuseWarp0 + 1 < kWarpsPerWg,
              "DQ_FUSE's converter warps are the producer warpgroup's warps other than TMA's and the writer's");
__shared__ int g_fuse_ring[kFuseRing];
__shared__ int g_fuse_head, g_fuse_tail, g_fuse_read, g_fuse_closed;
// The conversion's kernel arguments, stored once by thread 0 and loaded where used (volatile: no register holds them
// through the converter warps' claim loop, which spilled 4-44 bytes under the producer warpgroup's 24 registers).
struct FuseParams { float* accum; uint16_t* dq; int seqlen_q, heads_q; float scale; };
__shared__ FuseParams g_fuse_params;

struct FuseArgs {
  int* ctr;        // [B * Hq * num_m] steps still to complete per tile (0 at rest)
  uint16_t* dq;    // the 16-bit dQ, [B, Hq, Nq, D]
};

// Thread 0 before the CTA's first __syncthreads.
__device__ __forceinline__ void fuse_init(float* dq_accum, uint16_t* dq, int seqlen_q, int heads_q, float scale) {
  g_fuse_head = g_fuse_tail = g_fuse_read = g_fuse_closed = 0;
  g_fuse_params = FuseParams{dq_accum, dq, seqlen_q, heads_q, scale};
}

__device__ __forceinline__ float4 ld_cg_f4(const float4* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
// The converter warps' one load in flight per lane: the unit's 8 lines prefetched into L1 first (no register), then
// read from L1 (after the claim's acquire fence invalidated L1: no stale line of an earlier call can be hit).
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}
__device__ __forceinline__ float4 ld_ca_f4(const float4* p) {
  float4 v;
  asm volatile("ld.global.ca.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
template <int kPending> __device__ __forceinline__ void bulk_wait_done() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// One warp: unit `unit` = (tile * kDqParts + part) * 4 + rb, tile = bh * num_m + m, of the tiled accumulator (fragment
// order, dq_tile_offset) into dq = accumulator * scale (the tiled convert's multiply and pack per element: the same
// bits), then zeros over the unit's floats. Float4 number (4 j + rb) * 32 + lane of the part is thread t = 32 rb +
// lane's chunk j: rows 16 rb + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) of the part. kBatch of the 8 loads in flight
// (the converter warps' 24 registers take 1, the consumers' 240 take all 8).
template <int kBatch>
__device__ __forceinline__ void fuse_convert_unit(int unit, int lane) {
  static_assert(kDqChunks % kBatch == 0 && kWgThreads == 4 * kWarpSize, "a unit is 8 float4 per lane");
  const volatile FuseParams& fp = g_fuse_params;
  const int seqlen_q = fp.seqlen_q, num_m = (seqlen_q + kBlockM - 1) / kBlockM;
  const int tile = unit / kFuseUnits, part = (unit / 4) % kDqParts, rb = unit % 4;
  const int row = (tile % num_m) * kBlockM + 16 * rb + lane / 4, bh = tile / num_m;
  float4* src = reinterpret_cast<float4*>(fp.accum) + (size_t(tile) * kDqParts + part) * (kDqPartFloats / 4) +
                rb * kWarpSize + lane;
  if constexpr (kBatch == 1) {
#pragma unroll
    for (int j = 0; j < kDqChunks; ++j) prefetch_l1(src + j * kWgThreads);
  }
#pragma unroll 1
  for (int j0 = 0; j0 < kDqChunks; j0 += kBatch) {
    float4 a[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) a[k] = kBatch == 1 ? ld_ca_f4(src + (j0 + k) * kWgThreads) : ld_cg_f4(src + (j0 + k) * kWgThreads);
#pragma unroll
    for (int k = 0; k < kBatch; ++k) src[(j0 + k) * kWgThreads] = make_float4(0.f, 0.f, 0.f, 0.f);
    // row's element offset in 32 bits (the runtime fuses only dq of < 2^31 elements; rows past Nq: row 0's, not
    // stored), then row + 8 is hi_step further; the base pointer loaded where used
    const unsigned lo = unsigned(bh * seqlen_q + (row < seqlen_q ? row : 0)) * kHeadDim + part * kDqCols +
                        2 * (lane % 4) + 8 * j0;   // [B, Hq, Nq, D] dq (no BNHD: dq_fuse.cuh)
    const unsigned hi_step = 8 * kHeadDim;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (row < seqlen_q)
        *reinterpret_cast<uint32_t*>(fp.dq + (lo + 8 * k)) = fa3::pack2(a[k].x * fp.scale, a[k].y * fp.scale);
      if (row + 8 < seqlen_q)
        *reinterpret_cast<uint32_t*>(fp.dq + (lo + hi_step + 8 * k)) =
            fa3::pack2(a[k].z * fp.scale, a[k].w * fp.scale);
    }
  }
}

// The writer warp, after the adds of the step on `tile` completed (lane 0: all but the kPending newest bulk groups):
// one step off the tile's counter; the step that takes the last queues the tile's units in the ring (waiting for free
// slots).
// Lane 0 of the writer warp: queue a completed tile's units (waiting for free slots).
__device__ __forceinline__ void fuse_push(int tile) {
  const int head = g_fuse_head;                              // lane 0 of the writer alone writes it
  while (head + kFuseUnits - *static_cast<volatile int*>(&g_fuse_read) > kFuseRing) __nanosleep(256);
#pragma unroll 1
  for (int u = 0; u < kFuseUnits; ++u) static_cast<volatile int*>(g_fuse_ring)[(head + u) % kFuseRing] = tile * kFuseUnits + u;
  __threadfence_block();
  *static_cast<volatile int*>(&g_fuse_head) = head + kFuseUnits;
}

__device__ __forceinline__ int fuse_count_down(const FuseArgs& fa, int tile) {
  int old;   // release: this CTA's adds before the count (no L1 invalidation per step, as a full fence has)
  asm volatile("atom.release.gpu.global.add.s32 %0, [%1], -1;" : "=r"(old) : "l"(fa.ctr + tile) : "memory");
  return old;
}

template <int kPending>
__device__ __forceinline__ void fuse_step_done(const FuseArgs& fa, int tile, int lane) {
  if (lane != 0) return;
  bulk_wait_done<kPending>();
  asm volatile("fence.proxy.async.global;" ::: "memory");   // the async-proxy adds before the generic atomic
  if (fuse_count_down(fa, tile) != 1) return;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");          // the other CTAs' adds before the converters' reads
  fuse_push(tile);
}

// DQ_FUSE 2 (session 16, after the mid call; not yet run on a GPU): the completions counted once per CTA, after the
// writer's loop, instead of per step (DQ_FUSE 1 ran at half speed: its writer waited on every step's completion and
// fences). One wait for all adds and one proxy fence by lane 0, then the CTA's steps counted down 32 at a time (lane
// l: step base + l, the writer's own (g, tile) order), the tiles whose count reached 0 queued in lane order. Tiles
// complete only when their last visiting CTA ends, so the conversions run in the CTAs' tails (converter warps and
// consumers together).
__device__ __forceinline__ void fuse_cta_done(const FuseArgs& fa, const Problem& pb, QRange qr, int steps, int total,
                                              int num_m, int lane) {
  if (lane == 0 && total > 0) {
    bulk_wait_done<0>();
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("fence.acq_rel.gpu;" ::: "memory");        // lane 0's adds at gpu scope before any lane's count
  }
  __syncwarp();
#pragma unroll 1
  for (int base = 0; base < total; base += kWarpSize) {
    const int it = base + lane;
    int tile = -1, last = 0;
    if (it < total) {
      const int g = it / steps, i = it - g * steps;
      tile = pb.bh_q(g) * num_m + (kRangeRuns ? q_runs_tile(i) : sweep_tile(qr, i, steps));
      last = fuse_count_down(fa, tile) == 1;
    }
    unsigned bits = __ballot_sync(0xffffffffu, last);
    if (bits) asm volatile("fence.acq_rel.gpu;" ::: "memory");   // the other CTAs' adds before the converters' reads
    while (bits) {
      const int src = __ffs(bits) - 1;
      bits &= bits - 1;
      const int t = __shfl_sync(0xffffffffu, tile, src);
      if (lane == 0) fuse_push(t);
      __syncwarp();
    }
  }
}

// Any warp: the next queued unit, or -1 if the ring is empty now. The entry is read BEFORE the compare-and-swap that
// claims it: `read` counts claims, and claims are ordered by the tail, so read >= t + 1 (the writer's condition for
// reusing entry t's slot) implies entry t was read. (Session 16 mid call: reading it after the claim let a claim of a
// later entry count first, the writer then overwrote slot t under a slow claimer: a lost unit, its dQ rows poisoned
// and its accumulator lines never zeroed: 10 rule failures on the specs whose CTAs complete many tiles.)
__device__ __forceinline__ int fuse_claim(int lane) {
  int unit = -1;
  if (lane == 0) {
    volatile int* vol_tail = &g_fuse_tail;
    for (int t = *vol_tail; t < *static_cast<volatile int*>(&g_fuse_head); t = *vol_tail) {
      __threadfence_block();   // entry t was written before head passed it
      const int entry = static_cast<volatile int*>(g_fuse_ring)[t % kFuseRing];
      if (atomicCAS(&g_fuse_tail, t, t + 1) == t) {
        unit = entry;
        atomicAdd(&g_fuse_read, 1);
        break;
      }
    }
  }
  unit = __shfl_sync(0xffffffffu, unit, 0);
  if (unit >= 0) __threadfence();   // acquire: the writer's fence after its atomic saw the other CTAs' adds
  return unit;
}

// The producer warpgroup's converter warps: take units while the main loop runs, until the writer closed the ring
// and it is empty.
__device__ __forceinline__ void fuse_converter(int lane) {
  for (;;) {
    const int closed = *static_cast<volatile int*>(&g_fuse_closed);   // read before the claim: nothing queued after
    const int unit = fuse_claim(lane);
    if (unit >= 0) {
      fuse_convert_unit<1>(unit, lane);
    } else {
      if (__shfl_sync(0xffffffffu, closed, 0)) return;
      __nanosleep(512);
    }
  }
}

// The consumers after their epilogue: once the writer queued its last tile (kBarFuse), their 8 warps take what the
// converter warps have not.
__device__ __noinline__ void fuse_tail() {
  named_sync(kBarFuse, kDqBarThreads + kWgThreads);   // DQ_FUSE 1: the ring is closed by then; 2: it is being filled
  const int lane = int(threadIdx.x % kWarpSize);
  for (;;) {
    const int closed = *static_cast<volatile int*>(&g_fuse_closed);   // read before the claim, as fuse_converter
    const int unit = fuse_claim(lane);
    if (unit >= 0) {
      fuse_convert_unit<kDqChunks>(unit, lane);
    } else {
      if (__shfl_sync(0xffffffffu, closed, 0)) return;
      __nanosleep(128);
    }
  }
}
#endif  // DQ_FUSE

// DQ_WRITER: warp kDqWriterWarp of the producer warpgroup (24 registers), the steps in the consumers'
// order (g, then the query tiles). Per step and consumer: wait for its part (dq_full), lane 0 adds it;
// then lane 0 waits until both adds have read shared memory and the warp frees the slots (dq_empty).
#if DQ_FUSE
__device__ __forceinline__ void dq_writer(const Smem& sm, const Problem& pb, QRange qr, bool has_work,
                                          float* __restrict__ dq_accum, int lane, const FuseArgs& fa) {
#else
__device__ __forceinline__ void dq_writer(const Smem& sm, const Problem& pb, QRange qr, bool has_work,
                                          float* __restrict__ dq_accum, int lane) {
#endif
  const int num_m = (pb.seqlen_q + kBlockM - 1) / kBlockM;
  const int steps = kRangeRuns ? q_runs_count() : qr.m_end - qr.m_begin, total = has_work ? steps * pb.group : 0;
  int g = 0, i = 0;
#if DQ_FUSE == 1
  int prev = -1;   // the previous step's tile
#endif
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
#if DQ_FUSE == 1   // the previous step's adds (all but this step's kConsumers groups) completed: its tile's count
    if (prev >= 0)
      fuse_step_done<kConsumers>(fa, prev, lane);
    __syncwarp();   // lane 0's wait and queueing done before the warp's next barrier
    prev = pb.bh_q(g) * num_m + m;
#endif
    i = i + 1 == steps ? 0 : i + 1;
    g += i == 0;
  }
#if DQ_FUSE
#if DQ_FUSE == 2   // the consumers join at once (fuse_tail takes units until the ring is closed and empty)
  named_arrive(kBarFuse, kDqBarThreads + kWgThreads);
  fuse_cta_done(fa, pb, qr, steps, total, num_m, lane);
#else
  if (prev >= 0) fuse_step_done<0>(fa, prev, lane);
#endif
  if (lane == 0) {
    __threadfence_block();   // the last head before closed
    *static_cast<volatile int*>(&g_fuse_closed) = 1;
  }
  __syncwarp();
#if DQ_FUSE == 1
  named_arrive(kBarFuse, kDqBarThreads + kWgThreads);   // the ring gets no more tiles: the consumers help (fuse_tail)
#endif
#endif
}

static_assert(kDqChunks * 4 * kWgThreads == kDqPartFloats && kDqRegs == 4 * kDqChunks,
              "a dQ part is 8 float4 per consumer thread");
