// Shared-memory handles and work tiles of kernel.cu: the K/V ring's stage / phase, a work tile's
// decode (query block, heads, KV range) and what the producer hands the consumers per tile.
// kernel.cu includes this inside namespace fa3 after its regions (decode_tile calls head_map and
// kv_range) and before the roles, which all use it; it holds no region itself.
#pragma once

struct Smem {
  uint32_t q, k, v, o;            // tile bases (shared-window addresses)
  uint32_t q_full, q_empty, k_full, k_empty, v_full, v_empty;   // barriers (arrays 8 bytes apart)
  uint32_t tile_full, tile_empty, tile_slot;
  __device__ __forceinline__ uint32_t q_tile(int s) const { return q + s * kQBytes; }
  __device__ __forceinline__ uint32_t k_tile(int s) const { return k + s * kKVBytes; }
  __device__ __forceinline__ uint32_t v_tile(int s) const { return v + s * kKVBytes; }
};
// O_HALF's mbarrier (kOHalf): one phase per use of the shared 64-row O stage, completed when that
// use's TMA store has read it. After the tile slots (kOFreeBytes in params.cuh).
__device__ __forceinline__ uint32_t o_free_bar(const Smem& sm) { return sm.tile_slot + kTileSlots * kTileSlotBytes; }
// The K/V ring is shared by all tiles of a CTA: `it` counts KV tiles since the CTA started.
__device__ __forceinline__ int ring_stage(int it) { return it % kStages; }
__device__ __forceinline__ int ring_phase(int it) { return (it / kStages) & 1; }

// A work tile: query block, head, batch; the query blocks of one head are consecutive so that
// CTAs running at the same time share K/V in L2. Causal: the longest rows (last m_block) first.
// A tile_order array (from fa3_sm90_tile_counts and the host) overrides this: entry t is
// bh * num_m + m_block, longest tiles of every head first.
// TILE_SECTIONS (Fa3Config.tile_sections; off unless set): without a tile_order, the tiles go in
// sections of S consecutive heads (bh), S the largest power of two whose K and V fit in 50 MB of L2
// (8k D 256: 8 MB a head, S = 4), and inside a section the longest query blocks of all its heads first
// (heads minor). Head by head (the default), the last head's longest tiles start when only that head's
// tiles are left: at causal 8k, 32 heads, 128 x 80 on 132 CTAs a greedy schedule of that order ends
// 48 KV steps (5.6%) after the ideal (expkit tile_model order="heads"; session 15's ncu: our SMs active
// 94.3% of the elapsed cycles, FA4 98.6%), in sections of 4 heads 3 steps (0.4%). bh_all = #heads x batch.
// TILE_SECTIONS=1: sections sized to L2 as above; TILE_SECTIONS=n > 1: n heads a section whatever the length
// (an experiment: n >= #heads x batch is one section, every tile longest first).
#ifndef TILE_SECTIONS
#define TILE_SECTIONS 0
#endif
constexpr bool kTileSections = TILE_SECTIONS != 0 && !TAIL_SPLIT;
// (Computed per tile from opaque inputs: hoisted out of the producer's tile loop, the values live there
// spilled in its 24 registers at D 256 128 x 80.)
__device__ __forceinline__ int section_heads(int seqlen_k) {
  if constexpr (TILE_SECTIONS > 1) return TILE_SECTIONS;
  const float fit = __fdividef(52428800.f, float(opaque(seqlen_k)) * float(2 * kHeadDim * kElemBytes));
  return fit < 2.f ? 1 : 1 << (31 - __clz(int(fminf(fit, 1073741824.f))));   // (heads in 50 MB)
}
struct Tile { int m0; HeadMap hm; KvRange r; };
__device__ __forceinline__ Tile decode_tile(const VariantArgs& va, const int* tile_order, int t, int num_m,
                                            int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
                                            int bh_all = 0) {
  int m_block, bh;
  if (tile_order != nullptr) {
    const int code = tile_order[t];
    m_block = code % num_m;
    bh = code / num_m;
  } else if (kTileSections) {
    const unsigned sec_heads = min(unsigned(section_heads(seqlen_k)), unsigned(bh_all));
    const unsigned per_sec = sec_heads * unsigned(num_m);
    const unsigned sec = unsigned(t) / per_sec, r = unsigned(t) - sec * per_sec;
    const unsigned heads_here = min(sec_heads, unsigned(bh_all) - sec * sec_heads);   // the last one may be short
    const unsigned m_idx = r / heads_here;
    bh = int(sec * sec_heads + (r - m_idx * heads_here));
    m_block = (kCausal || kLongestFirst) ? num_m - 1 - int(m_idx) : int(m_idx);
  } else {
    const int m_idx = t % num_m;
    bh = t / num_m;
    m_block = (kCausal || kLongestFirst) ? num_m - 1 - m_idx : m_idx;
  }
  const int m0 = m_block * kBlockM - (kAlignEnd && m_block > 0 ? num_m * kBlockM - seqlen_q : 0);   // (ALIGN_END)
  const HeadMap hm = head_map(bh / heads_q, bh % heads_q, heads_q, heads_kv);
  // kv_range sees query positions (queries end-aligned): row m0 sits at m0 + Nk - Nq, the last
  // query at Nk - 1.
  return Tile{m0, hm, kv_range(va, hm.b, hm.h, m_block, m0 + seqlen_k - seqlen_q, seqlen_k, seqlen_k)};
}

// What the producer hands the consumers for each tile. With kRangeViaSmem (set by the kv_range
// region) the whole tile goes through shared memory: the range is computed once per tile (a
// variant's range scans tiles, maybe a block table in global memory), not once per thread.
// Otherwise only t does, and each consumer thread decodes the tile itself (a few integer ops).
struct TileMsg { int t; Tile tl; };
static_assert(sizeof(TileMsg) <= kTileSlotBytes, "a variant's KvRange is too large for a tile slot");

#if TAIL_SPLIT
// kTailSplit: with G CTAs and T > G tiles, the last R = T mod G tiles become R x S work items, S =
// min(G / R, KV tiles, kTailMaxChunks / R) chunks each (8k x 32 heads x B 2 at 128 rows on 132 SMs:
// R 4, S 33). A chunk keeps its tile and narrows the KV range to its share of the visit order.
// The workspace holds kTailMaxChunks chunks of kTailChunkFloats (O rows, then row max, row sum);
// the counters kTailMaxChunks * kConsumers ints (cubridge/runtime/fa3_sm90.py TAIL_MAX_CHUNKS).
constexpr bool kTailSplit = !kCausal && kDenseKernel && !KV_ROTATE;   // (TAIL_SPLIT set)
constexpr int kTailMaxChunks = 160;
constexpr int kTailChunkFloats = kBlockM * (kHeadDim + 2);
struct TailPlan { int items, start, split; };
__device__ __forceinline__ TailPlan tail_plan(int num_tiles, int seqlen_k) {
  const int grid = int(gridDim.x), r = num_tiles % grid;
  if (!kTailSplit || num_tiles <= grid || r == 0) return TailPlan{num_tiles, num_tiles, 1};
  const int split = min(min(grid / r, (seqlen_k + kBlockN - 1) / kBlockN), kTailMaxChunks / r);
  if (split < 2) return TailPlan{num_tiles, num_tiles, 1};
  return TailPlan{num_tiles - r + r * split, num_tiles - r, split};
}
#endif

struct Problem {
  int seqlen_q, seqlen_k, heads_q, heads_kv, num_m, num_tiles;   // (with TAIL_SPLIT: work items)
  int* tile_counter;
  const int* tile_order;          // nullptr: the default order
  VariantArgs va;
#if TAIL_SPLIT
  // items >= tail_start: chunk j % split of tile tail_start + j / split. The workspace's address and
  // the chunk counters follow the scheduler's pair in tile_counter (tail_epilogue reads them).
  int tail_start, tail_split;
  __device__ __forceinline__ Tile tile(int t) const {
    if (!kTailSplit || t < tail_start)
      return decode_tile(va, tile_order, t, num_m, seqlen_q, seqlen_k, heads_q, heads_kv);
    const int j = t - tail_start, chunk = j % tail_split;
    Tile tl = decode_tile(va, tile_order, tail_start + j / tail_split, num_m, seqlen_q, seqlen_k, heads_q,
                          heads_kv);
    // visit indices [a, b) of the tile's KV list (tile_at visits n = n_end - 1 - i; no rotation here)
    const int kv = tl.r.n_end - tl.r.n_begin, end = tl.r.n_end;
    const int a = chunk * kv / tail_split, b = (chunk + 1) * kv / tail_split;
    tl.r.n_begin = end - b;
    tl.r.n_end = end - a;
    return tl;
  }
#else
  __device__ __forceinline__ Tile tile(int t) const {
    return decode_tile(va, tile_order, t, num_m, seqlen_q, seqlen_k, heads_q, heads_kv,
                       kTileSections ? int(unsigned(opaque(num_tiles)) / unsigned(num_m)) : 0);
  }
#endif
};
