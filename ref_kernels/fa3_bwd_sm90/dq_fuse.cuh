// DQ_FUSE (session 16, vbwd16; off: the runtime's CUBRIDGE_BWD_FUSED_CONVERT=1 builds it; dq_store.cuh says what it
// does): the count launch before the preprocess. Included at the end of kernel.cu (outside namespace fa3b) with
// DQ_FUSE 1 only, so the other options' cubins stay as they were.
#pragma once

static_assert(LEAN == 1, "DQ_FUSE=1 needs LEAN=1 (its preprocess zeroes the unvisited tiles' dQ and no accumulator)");
static_assert(PERSIST == 0, "DQ_FUSE=1 counts the steps of one CTA per KV tile (no PERSIST queue)");
// BNHD's row addressing divides by the head count in the converter warps, which spilled 4-28 bytes under their 24
// registers: the fused convert writes contiguous [B, Hq, Nq, D] dq only (BNHD keeps the convert launch).
static_assert(BNHD == 0, "DQ_FUSE=1 writes contiguous [B, Hq, Nq, D] dq (BNHD keeps the tiled convert)");

// One warp per KV tile (n, kv head, batch) = blockIdx.x in that order: the query tiles its CTA will add into (the
// variant's runs / exact list from the same q_scan the main kernel runs, or the dense q_range), one count per step
// into ctr [B * Hq, num_m] for each query head of the group. ctr must be 0 before (the main kernel's last steps
// leave it so). GQA_SPLIT: heads_kv and group are the main kernel's virtual ones (Hkv * s, G / s), as it counts its
// steps. Grid (ceil(Nk / 128) * heads_kv * B), block 32.
extern "C" __global__ void __launch_bounds__(32)
fa3_bwd_dq_count(const __grid_constant__ fa3b::VariantArgs va, int* __restrict__ ctr, int seqlen_q, int seqlen_k,
                 int heads_q, int heads_kv, int group) {
  using namespace fa3b;
  const int tiles = (seqlen_k + kBlockN - 1) / kBlockN, num_m = (seqlen_q + kBlockM - 1) / kBlockM;
  const int n = int(blockIdx.x % tiles), bh_kv = int(blockIdx.x / tiles);
  const int h_kv = bh_kv % heads_kv, b = bh_kv / heads_kv, n0 = n * kBlockN, lane = int(threadIdx.x % kWarpSize);
  int steps = 0;
  QRange qr{0, 0};
  if constexpr (kRangeRuns) {
    q_scan(va, b, h_kv, group, n0, seqlen_q, seqlen_k, g_qruns);
    __syncwarp();
    steps = q_runs_count();
  } else {
    qr = q_range(n0, seqlen_q, seqlen_k - seqlen_q);
    steps = max(qr.m_end - qr.m_begin, 0);
  }
  int* head = ctr + (size_t(b) * heads_q + size_t(h_kv) * group) * num_m;
  for (int i = lane; i < steps; i += kWarpSize) {
    const int m = kRangeRuns ? q_runs_tile(i) : qr.m_begin + i;
    for (int g = 0; g < group; ++g) atomicAdd(head + size_t(g) * num_m + m, 1);
  }
}
