// PERSIST 1 (params.cuh; variants only): a persistent grid of min(tiles, SMs) CTAs, each looping over
// KV tiles taken from one queue in TILE_ORDER 2's order (tile_coord_at: longest first inside each
// section of heads), the first tile blockIdx.x, later ones gridDim.x + atomicAdd(tile_ctr) (a zeroed
// int per launch). Why: a variant's CTAs are short and uneven (8k: global_sliding_window 1-128 steps,
// mean 8.8; share_question 2-128, mean 41) and each non-persistent CTA pays a fixed cost (fitted 20 us
// beside 2.6 us per step, experiments/bwd_cta_model.py: 47% / 16% of those two specs' time) for its
// launch, run scan, K / V load, first stage and dK / dV epilogue, one after the other. Here the next
// tile's scan and loads run while the consumers finish the current tile's last step and epilogue.
//
// Roles (included by kernel.cu inside namespace fa3b, after consumer.cuh):
//   warp 1 of the producer warpgroup (kSchedWarp, 24 registers): per tile, its 32 lanes wait
//     sched_empty (the producer and every consumer thread have read the previous tile's runs), take the
//     next tile, scan its query runs into g_qruns / the list (q_scan), publish the index in g_tile and
//     arrive on sched_full.
//   thread 0 (the producer): per published tile, streams its stages through the ring (`it` continues
//     across tiles), loading its K / V after the first stage once kv_empty says the consumers' last
//     GEMMs of the previous tile have read K / V, then arrives on sched_empty. (Scan and producer in one
//     warp spilled 48 bytes under the 24 registers; apart, 0.)
//   consumers: per tile, wait sched_full, read g_tile, run its steps (the last one arrives on
//     sched_empty once it has read its tile and mask flag, then on kv_empty after its GEMMs), then the
//     dK / dV epilogue (through the dQ slots, EPILOGUE 1) while the producer loads the next tile.
// Barrier phases cannot be skipped: sched_full's phase t completes only after sched_empty's phase
// t - 1, which needs every reader's arrival inside tile t - 1; kv_full / kv_empty count rounds (tiles
// with at least one step) on both sides.
#pragma once

#if PERSIST
static_assert(kRangeRuns, "PERSIST=1 builds for a lowered variant only (its scheduler scans the q_range runs)");
__shared__ int g_tile;   // the published tile index; -1: the queue is empty
constexpr int kSchedWarp = 1;   // of the producer warpgroup (warp 0 holds the producer thread)

__device__ __forceinline__ Problem tile_problem(int tile, int tiles_total, int seqlen_q, int seqlen_k, int heads_q,
                                                int heads_kv, int group, int section) {
  const TileCoord tc = tile_coord_at(tile, tiles_total, seqlen_k, heads_kv, section);
  return Problem{seqlen_q, seqlen_k, heads_q, heads_kv, group, tc.b, tc.h_kv, tc.n * kBlockN};
}

// K / V of round `round` (the CTA's round-th tile with work), once round - 1's have been read.
__device__ __forceinline__ void load_kv(const Smem& sm, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                        const Problem& pb, int round) {
  if (round > 0) mbar_wait(sm.kv_empty(), (round - 1) & 1);
  mbar_expect_tx(sm.kv_full(), 2 * kKVBytes);
#pragma unroll
  for (int p = 0; p < kPanels; ++p) {
    tma_load_3d(sm.k() + p * kKVPanelBytes, tm_k, sm.kv_full(), p * kPanelCols, pb.n0, pb.bh_kv());
    tma_load_3d(sm.v() + p * kKVPanelBytes, tm_v, sm.kv_full(), p * kPanelCols, pb.n0, pb.bh_kv());
  }
}

// The producer thread: one tile's stages (the first one before K / V: its ring slot is free while the
// consumers still run the previous tile's last step, K / V are not). Returns the ring position after it.
__device__ __forceinline__ int produce_tile(const Smem& sm, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                            const CUtensorMap* tm_v, const CUtensorMap* tm_do, const Problem& pb,
                                            const float* __restrict__ lse, const float* __restrict__ dvec, int it,
                                            int round) {
  const int count = q_runs_count();
  for (int g = 0; g < pb.group; ++g)
    for (int i = 0; i < count; ++i, ++it) {
      load_stage(sm, tm_q, tm_do, pb, g, q_runs_tile(i), it, lse, dvec);
      if (g == 0 && i == 0) load_kv(sm, tm_k, tm_v, pb, round);
    }
  return it;
}

// Thread 0: the producer, tile after tile as warp 1 publishes them; arrives on sched_empty once it has
// issued the tile's last stage (read its last run).
__device__ __forceinline__ void persist_producer(const Smem& sm, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                                 const CUtensorMap* tm_v, const CUtensorMap* tm_do,
                                                 const float* __restrict__ lse, const float* __restrict__ dvec,
                                                 int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int group,
                                                 int section, int tiles_total) {
  int it = 0, round = 0;
  for (int t = 0;; ++t) {
    mbar_wait(sm.sched_full(), t & 1);
    const int tile = *static_cast<volatile int*>(&g_tile);
    if (tile < 0) return;
    const Problem pb = tile_problem(tile, tiles_total, seqlen_q, seqlen_k, heads_q, heads_kv, group, section);
    if (q_runs_count() > 0) {
      it = produce_tile(sm, tm_q, tm_k, tm_v, tm_do, pb, lse, dvec, it, round);
      ++round;
    }
    mbar_arrive(sm.sched_empty());
  }
}

// Warp 1 (kSchedWarp): the queue and the run scans.
__device__ __forceinline__ void persist_scheduler(const VariantArgs& va, const Smem& sm, int seqlen_q, int seqlen_k,
                                                  int heads_q, int heads_kv, int group, int section,
                                                  int* __restrict__ tile_ctr, int tiles_total) {
  const int lane = int(threadIdx.x % kWarpSize);
  for (int t = 0;; ++t) {
    int tile = int(blockIdx.x);
    if (t > 0) {
      mbar_wait(sm.sched_empty(), (t - 1) & 1);
      if (lane == 0) tile = int(gridDim.x) + atomicAdd(tile_ctr, 1);
      tile = __shfl_sync(0xffffffffu, tile, 0);
    }
    if (tile >= tiles_total) {
      if (lane == 0) g_tile = -1;
      __syncwarp();
      mbar_arrive(sm.sched_full());
      return;
    }
    const Problem pb = tile_problem(tile, tiles_total, seqlen_q, seqlen_k, heads_q, heads_kv, group, section);
    q_scan(va, pb.b, pb.h_kv, group, pb.n0, seqlen_q, seqlen_k, g_qruns);
    if (lane == 0) g_tile = tile;
    __syncwarp();
    mbar_arrive(sm.sched_full());   // every lane: its own run / list writes released
  }
}

// A consumer warpgroup: the tiles kSchedWarp publishes, each as consumer()'s SCHED 1 loop, then its epilogue.
__device__ __forceinline__ void persist_consumer(const VariantArgs& va, const Consumer& cs, const Smem& sm,
                                                 const float* __restrict__ lse, const float* __restrict__ dvec,
                                                 float* __restrict__ dq_accum, uint16_t* __restrict__ dk,
                                                 uint16_t* __restrict__ dv, int seqlen_q, int seqlen_k, int heads_q,
                                                 int heads_kv, int group, float softmax_scale, int section,
                                                 int tiles_total) {
  const float scale_log2 = softmax_scale * kLog2e;
  const uint32_t k_rows = sm.k() + cs.c * kWgRows * kSwizzleBytes;
  const uint32_t v_rows = sm.v() + cs.c * kWgRows * kSwizzleBytes;
  int it = 0, round = 0;
  for (int t = 0;; ++t) {
    mbar_wait(sm.sched_full(), t & 1);
    const int tile = *static_cast<volatile int*>(&g_tile);
    if (tile < 0) break;
    const Problem pb = tile_problem(tile, tiles_total, seqlen_q, seqlen_k, heads_q, heads_kv, group, section);
    const int steps = q_runs_count(), it_end = it + steps * group;
    float dk_acc[kAccRegs], dv_acc[kAccRegs];
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dk_acc[i] = dv_acc[i] = 0.f;
    if (it_end == it) mbar_arrive(sm.sched_empty());   // nothing to read: dK = dV = 0
    else mbar_wait(sm.kv_full(), round & 1);
    int g_run = 0, i_run = 0;
    uint32_t ds16[kPRegs];
#pragma unroll
    for (int i = 0; i < kPRegs; ++i) ds16[i] = 0u;
    for (; it < it_end; ++it) {
      const int g = g_run, m0 = q_runs_tile(i_run) * kBlockM, st = it % kStages;
      i_run = i_run + 1 == steps ? 0 : i_run + 1;
      g_run += i_run == 0;
      mbar_wait(sm.q_full() + 8 * st, (it / kStages) & 1);
      uint32_t kr = k_rows, vr = v_rows, kt = sm.k();   // opaque per step, as consumer()
      asm volatile("" : "+r"(kr), "+r"(vr), "+r"(kt));
      const bool last = it + 1 == it_end;
      overlap_step(va, cs, sm, pb, st, it, g, m0, kr, vr, kt, dk_acc, dv_acc, ds16, lse, dvec, dq_accum, scale_log2,
                   last ? sm.sched_empty() : 0u);
      if (last) mbar_arrive(sm.kv_empty());   // its S / dP / dQ GEMMs (waited for) have read K / V
    }
    round += steps > 0;
    store_rows_staged(cs, sm, dk, dv, dk_acc, dv_acc, softmax_scale, pb);
  }
  if (cs.wg_thread == 0) bulk_wait_read<0>();   // LEAN: the last dQ add has read shared memory
}

__device__ __forceinline__ void persist_cta(const VariantArgs& va, const Smem& sm, const CUtensorMap* tm_q,
                                            const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                            const CUtensorMap* tm_do, const float* __restrict__ lse,
                                            const float* __restrict__ dvec, float* __restrict__ dq_accum,
                                            uint16_t* __restrict__ dk, uint16_t* __restrict__ dv, int seqlen_q,
                                            int seqlen_k, int heads_q, int heads_kv, int group, float softmax_scale,
                                            int section, int* __restrict__ tile_ctr, int tiles_total) {
  if (threadIdx.x == 0) {
    g_q_shift = seqlen_k - seqlen_q;
    mbar_init(sm.kv_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.q_full() + 8 * s, 1);
      mbar_init(sm.q_empty() + 8 * s, kEmptyArrivals);
    }
    mbar_init(sm.kv_empty(), kConsumers * kWgThreads);
    mbar_init(sm.sched_full(), kWarpSize);
    mbar_init(sm.sched_empty(), kConsumers * kWgThreads + 1);   // + the producer
    fa3::fence_barrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / kWgThreads;
  if (wg == 0) {
    fa3::reg_dealloc<kProducerRegs>();
    // warp index broadcast from lane 0: a warp-uniform branch for ptxas (as DQ_WRITER's)
    const int warp = __shfl_sync(0xffffffffu, threadIdx.x / kWarpSize, 0);
    if (warp == kSchedWarp) {
      persist_scheduler(va, sm, seqlen_q, seqlen_k, heads_q, heads_kv, group, section, tile_ctr, tiles_total);
    } else if (threadIdx.x == 0) {
      fa3::tma_prefetch_map(tm_q);
      fa3::tma_prefetch_map(tm_do);
      persist_producer(sm, tm_q, tm_k, tm_v, tm_do, lse, dvec, seqlen_q, seqlen_k, heads_q, heads_kv, group, section,
                       tiles_total);
    }
  } else {
    fa3::reg_alloc<kConsumerRegs>();
    const int c = __shfl_sync(0xffffffffu, wg - 1, 0);
    const Consumer cs{c, int(threadIdx.x % kWgThreads), int(threadIdx.x % kWarpSize)};
    persist_consumer(va, cs, sm, lse, dvec, dq_accum, dk, dv, seqlen_q, seqlen_k, heads_q, heads_kv, group,
                     softmax_scale, section, tiles_total);
  }
}
#endif  // PERSIST
