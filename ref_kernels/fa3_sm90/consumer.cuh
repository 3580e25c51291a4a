// The consumer warpgroups' loop of kernel.cu: tiles from the producer, the KV loop with its
// GEMM turns (ping-pong), and the epilogue. kernel.cu includes this inside namespace fa3 after
// its regions and epilogue(), which it calls; it holds no region itself.
#pragma once

#ifndef SOFTMAX_FIRST   // (an option, below; defined first: kSplitPvWait reads it)
#define SOFTMAX_FIRST 0
#endif

// Tiles overlap where O has its own staging buffer (kSeparateO, or O_HALF's shared one): a tile's
// last P V is issued in the same turn as the next tile's first QK, and its epilogue runs while that
// QK is on the tensor cores. With O staged in the (only) Q slot, the next tile's Q waits for that
// epilogue's store, so there each tile drains before the next one starts.
constexpr bool kOverlapTiles = kSeparateO || kOHalf;

// The steady loop waits for its P V between the two halves of the softmax (FA4's placement) where
// the softmax region provides them (FA3_SOFTMAX_SPLIT: the reference's online softmax, which a
// softmax variant keeps) and two consumers run: session 11's A/B, +5.8-7.3% full D 128 8k / 16k,
// +2.4-3.6% causal, prefixlm +3.3%; three consumers (D 64's 192 x 128) lost 0.5-2.7%, so they wait
// before the whole softmax as before (sigmoid / relu / composite regions always do).
// SOFTMAX_FIRST (below) brings three consumers the pinned wait too, after the whole softmax.
constexpr bool kSplitPvWait = kConsumers == 2 || SOFTMAX_FIRST;   // (and FA3_SOFTMAX_SPLIT, in the loop)

// The GEMM turns (ping-pong) between the consumers; WG_TURNS=0 drops them: each consumer issues
// its wgmma as soon as its operands are there. FA4's SM90 forward does so at head dim 256
// (flash_fwd_sm90.py: use_scheduler_barrier only where tile_hdim <= 128), where a KV step is
// twice the GEMM work per score and the softmax's share of it halves. An option until measured.
#ifndef WG_TURNS
#define WG_TURNS 1
#endif
constexpr bool kWgTurns = WG_TURNS != 0;

// Where O is rescaled by the softmax's factor: after this warpgroup's P V completed (default), or,
// RESCALE_BEFORE_PV=1, at the next KV step between the QK issue and the P V issue, while QK runs
// on the tensor cores (FA4's SM90 rescale_O_before_gemm, on where the O tile is wider than 128):
// the 64 x D rescale (128 FMUL per thread at D 256) leaves the path from the P V wait to the next
// GEMM issue. Same arithmetic, bitwise equal output. An option until measured.
#ifndef RESCALE_BEFORE_PV
#define RESCALE_BEFORE_PV 0
#endif
constexpr bool kRescaleBeforePv = RESCALE_BEFORE_PV != 0;

// SOFTMAX_FIRST=1: with the split wait (kSplitPvWait), the exponentials too run before this
// warpgroup's P V is waited for (FA4's SM90 source order: the whole online softmax, then
// wait_group 0), so after the P V completes only the rescale and the conversion to P remain before
// the next GEMM issue. The default splits the softmax around the wait (session 11, measured at
// D 128 with turns). Same arithmetic, bitwise equal output. An option until measured. With three
// consumers (D 64's 192 x 128, which wait for P V before the whole softmax by default) it gives them
// FA4's order too: the softmax, then the pinned wait (session 14, D 64's 0.91-0.98 of FA4).
constexpr bool kSoftmaxFirst = SOFTMAX_FIRST != 0;

// PV_WAIT_EARLY=1 (HEAD_DIM 256 only): the P V is waited for right after the QK, before the softmax,
// so that both consumers' V slot is freed a softmax earlier (the default frees it after the row max
// and the exp2 arguments, SOFTMAX_FIRST after the exponentials too, which measured 5% slower at
// D 256: session 13). The softmax then runs whole and hides under the other consumer's two GEMMs
// (1280 tensor cycles at 128 x 80 against ~700 of softmax) instead of under its own P V. Same
// arithmetic, bitwise equal output. An option until measured (session 14).
#ifndef PV_WAIT_EARLY
#define PV_WAIT_EARLY 0
#endif
constexpr bool kPvWaitEarly = PV_WAIT_EARLY != 0 && kHeadDim == 256;

// V_WAIT_FIRST=1 (HEAD_DIM 256 only): the steady step waits for V_{i-1} before it issues QK_i, so that the O
// rescale (RESCALE_BEFORE_PV) and both GEMMs' issue share one block after the waits: ptxas sinks the 128 FMUL of
// the rescale past a V wait that follows the QK issue, to just before the P V issue (session 15), where the
// P V's first HGMMA then waits on them; FA4's SASS has them between its QK HGMMAs. V_{i-1} was loaded before
// K_i (the default producer order), so the extra wait is short where K_i is there. Same arithmetic, bitwise
// equal output. An option until measured (session 16).
#ifndef V_WAIT_FIRST
#define V_WAIT_FIRST 0
#endif
constexpr bool kVWaitFirst = V_WAIT_FIRST != 0 && kHeadDim == 256;

// SPLIT_EXPS=1 (where the P V wait comes after the whole softmax: three consumers, D 64's 192 x 128): the row max and
// every exp2 argument, row half 0's exponentials, then the pinned P V wait, O's rescale and half 1's exponentials.
// By default ptxas hoists this warpgroup's P V wait (wait_group 0) to the top of the softmax, so the row max waits for
// the P V issued just after the QK (its 64 x 64 x 128 on the tensor core), and it issues the two rescale factors'
// MUFU and O's 32 FMUL after the 64 exponentials, at the end of the consumer's turn chain. Here the wait sits after
// half 0's exponentials (~256 MUFU cycles later; a block boundary pins it, as kSplitPvWait's) and O's FMUL fill the
// FMA pipe beside half 1's MUFU. (kSplitPvWait's pin after the arguments, before any exponential, measured -0.5..-2.7%
// at three consumers: all 64 exp2 arguments and half 1's max then precede the first MUFU.) Same arithmetic, bitwise
// equal output (session 17b). The reference softmax region only, without EXP2_EMU. An option until measured.
#ifndef SPLIT_EXPS
#define SPLIT_EXPS 0
#endif
#ifdef FA3_SOFTMAX_SPLIT
constexpr bool kSplitExps = SPLIT_EXPS != 0 && !kSplitPvWait && !kPvWaitEarly && !kRescaleBeforePv && kExp2Emu == 0;
// softmax_exps for one row half (the same operations in the same order)
__device__ __forceinline__ void softmax_exps_half(float (&s)[kSRegs], SoftmaxState& st, const float (&rescale)[2],
                                                  int half) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s[4 * j + 2 * half + e];
      x = fast_exp2(x);
      sum += x;
    }
  st.row_sum[half] = st.row_sum[half] * rescale[half] + sum;   // per-lane partial sum
}
#else
constexpr bool kSplitExps = false;
#endif

__device__ __forceinline__ void consumer(const Consumer& cs, const Smem& sm, const CUtensorMap* tm_o,
                                         float* __restrict__ lse, const Problem& pb,
                                         float softmax_scale) {
  const Frag f = frag_coords(cs.wg_thread);
  const float score_scale = kScoreModIdentity ? softmax_scale : kScoreFactor;   // what S still needs
  const bool last_consumer = cs.c == kConsumers - 1;
  // Turns (wg_turn): the consumers issue their GEMMs round-robin. The last consumer owes consumer
  // 0 the first turn, and after a turn that may be the CTA's last (a drain on its own) it defers
  // that pass to the start of its next turn, so that no arrival is left pending at exit.
  bool owe_turn = last_consumer;
  auto turn_begin = [&]() {
    if constexpr (kWgTurns) {
      if (owe_turn) named_arrive(kBarWgTurn0, 2 * kWgThreads);
      owe_turn = false;
      cs.turn_wait();
    }
  };
  auto turn_end = [&](bool maybe_last) {
    if constexpr (kWgTurns) {
      if (last_consumer && maybe_last) owe_turn = true;
      else cs.turn_pass();
    }
  };
  float o[kORegs];
  uint32_t p[kPRegs];
  float s[kSRegs];
  float rescale[2];   // the last softmax step's factor for O (owed until the next P V with kRescaleBeforePv)
  SoftmaxState st;
  // kRescaleBeforePv: O takes the factor it is owed just before the P V that accumulates into it.
  auto rescale_owed = [&]() {
    if constexpr (kRescaleBeforePv) {
      reg_fence(o);                                        // not hoisted above the QK issue
      rescale_o(o, rescale);
    }
  };
  // O_HALF's shared O stage (kOHalf): the consumers use it in turn, tile j's use by consumer c is
  // j * kConsumers + c (every consumer runs one epilogue, or tail_epilogue, per tile), and use u waits
  // for use u - 1's store to have read the stage. Thread 0 waits before the epilogue, whose first
  // warpgroup sync holds the others; it signals after the store has read O, before the next tile.
  int o_use = cs.c;
  auto o_stage_take = [&]() {
    if (kOHalf && cs.wg_thread == 0 && o_use > 0) mbar_wait(o_free_bar(sm), (o_use - 1) & 1);
  };
  auto o_stage_give = [&]() {
    if (kOHalf && cs.wg_thread == 0) {
      tma_store_wait_read();
      mbar_arrive(o_free_bar(sm));
    }
    o_use += kConsumers;
  };
  auto run_epilogue = [&](const Tile& t, bool holds_q) {
    o_stage_take();
    epilogue(cs, sm, tm_o, lse, o, st, t, pb.seqlen_q, holds_q);
    o_stage_give();
  };
  // The previous tile, while its last P V and epilogue are owed (pending).
  bool pending = false;
  int prev_m0 = 0, prev_sv = 0, prev_phase = 0;           // its rows, the ring slot of its last V
#if TAIL_SPLIT
  int prev_t = 0;                                          // its work item (a tail chunk or a tile)
#endif
  HeadMap prev_hm{};
  auto finish_prev = [&]() {                               // its last P V has completed
#if TAIL_SPLIT
    if (kTailSplit && prev_t >= pb.tail_start) {           // a chunk of a split tail tile
      reg_fence(o);
      cs.release(sm.v_empty + 8 * prev_sv);
      o_stage_take();
      tail_epilogue(cs, sm, tm_o, lse, o, st, Tile{prev_m0, prev_hm, KvRange{}}, pb, prev_t);
      o_stage_give();
      pending = false;
      return;
    }
#endif
    reg_fence(o);
    cs.release(sm.v_empty + 8 * prev_sv);
    run_epilogue(Tile{prev_m0, prev_hm, KvRange{}}, true);
    pending = false;
  };
  auto drain_alone = [&]() {
    turn_begin();
    rescale_owed();
    mbar_wait(sm.v_full + 8 * prev_sv, prev_phase);
    gemm_pv(o, p, sm.v_tile(prev_sv));
    turn_end(true);
    wgmma_wait<0>();
    finish_prev();
  };
  int it = 0, q_iter = 0;
  for (int k = 0;; ++k) {
    const int slot = k % kTileSlots;
    mbar_wait(sm.tile_full + 8 * slot, (k / kTileSlots) & 1);
    int t;
    Tile tl;
    if constexpr (kRangeViaSmem) {
      const TileMsg msg = ld_shared_words<TileMsg>(sm.tile_slot + kTileSlotBytes * slot);
      t = msg.t;
      tl = msg.tl;
    } else {
      t = ld_shared_words<int>(sm.tile_slot + kTileSlotBytes * slot);
    }
    mbar_arrive(sm.tile_empty + 8 * slot);                 // every reader arrives after its read
    if (t >= pb.num_tiles) break;
    if constexpr (!kRangeViaSmem) tl = pb.tile(t);         // a cheap range: recomputed here
    const int tiles = kv_count(tl.r);
    if (tiles == 0) {                                      // nothing attended: O = 0, lse = -inf
      if (kOverlapTiles && pending) drain_alone();       // (without overlap none is pending here)
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
      softmax_init(st);
      if constexpr (kOInQ) {                               // O goes through the Q slot: take it
        mbar_wait(sm.q_full + 8 * (q_iter % kQSlots), (q_iter / kQSlots) & 1);
        ++q_iter;
      }
      run_epilogue(tl, kOInQ);
      continue;
    }
#ifdef CUIR_FULL_BITS_HOOKS   // (a lowered block-table variant: its full tiles' classes, one round trip per warp,
                              // in flight through the waits for the first K and Q)
    int full_cls[kFullWords];
    full_bits_issue(pb.va, tl.r, cs.lane, full_cls);
#endif
    const int qs = q_iter % kQSlots;                        // this tile's Q slot
    const uint32_t q_rows = sm.q_tile(qs) + cs.c * kWgQBytes;
    const int q_row0 = tl.m0 + cs.c * kWgRows + f.row0 + pb.seqlen_k - pb.seqlen_q;   // a position
    // tile_partial of the next tile is asked one step ahead: for a block-table variant it is a
    // global load, whose latency then hides behind this tile's GEMMs.
    auto partial_at = [&](int i) { return i < tiles && tile_partial(pb.va, tl.r, tile_at(tl.r, i)); };
    auto process_scores = [&](int n, bool partial) {
      const int col0 = n * kBlockN + f.col0;
      if (partial) {
#ifdef CUIR_TABLE_ROWS_HOOKS   // (a lowered block-table variant: R's rows and X's column bits, one pass)
        score_and_mask_x(pb.va, s, softmax_scale, tl.hm, q_row0, col0, pb.seqlen_k, n == tl.r.r_only);
#else
        score_and_mask<true>(pb.va, s, softmax_scale, tl.hm, q_row0, col0, pb.seqlen_k);
#endif
      } else if constexpr (kSaturates) {
        // the tile's distances kv - q (positions; rows past Nq included): [k0 - q_last, k_last - q0]
        const int q0 = tl.m0 + pb.seqlen_k - pb.seqlen_q, k0 = n * kBlockN;
        if (k0 - (q0 + kBlockM - 1) >= kSatHi) score_and_mask<false, 1>(pb.va, s, softmax_scale, tl.hm, q_row0, col0, pb.seqlen_k);
        else if (k0 + kBlockN - 1 - q0 <= kSatLo) score_and_mask<false, -1>(pb.va, s, softmax_scale, tl.hm, q_row0, col0, pb.seqlen_k);
        else score_and_mask<false>(pb.va, s, softmax_scale, tl.hm, q_row0, col0, pb.seqlen_k);
      } else {
        score_and_mask<false>(pb.va, s, softmax_scale, tl.hm, q_row0, col0, pb.seqlen_k);
      }
    };

    // First KV tile: S only, with the previous tile's last P V in the same turn (then its
    // epilogue, while this QK runs).
    // (Each branch retires its own wgmma groups: ptxas serialises wgmma when a group in flight
    // crosses the join.)
    auto first_qk = [&]() {
      mbar_wait(sm.k_full + 8 * ring_stage(it), ring_phase(it));
      mbar_wait(sm.q_full + 8 * qs, (q_iter / kQSlots) & 1);
      gemm_qk(s, q_rows, sm.k_tile(ring_stage(it)));
    };
    auto fresh_o = [&]() {
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
#ifdef CUIR_FULL_BITS_HOOKS   // (once per tile, after the first QK is issued: a ballot per word while it runs;
      full_bits_take(tl.r, full_cls);   // tile_partial then a bit test)
#endif
    };
    turn_begin();
    if (kOverlapTiles && pending) {
      rescale_owed();
      mbar_wait(sm.v_full + 8 * prev_sv, prev_phase);
      gemm_pv(o, p, sm.v_tile(prev_sv));
      first_qk();
      turn_end(false);
      wgmma_wait<1>();                                     // the P V (the older group) is done
      finish_prev();
      fresh_o();
      wgmma_wait<0>();
    } else {
      first_qk();
      turn_end(false);
      fresh_o();
      wgmma_wait<0>();
    }
    softmax_init(st);
    bool partial = partial_at(0), partial_next = partial_at(1);
    reg_fence(s);
    cs.release(sm.k_empty + 8 * ring_stage(it));
    process_scores(tile_at(tl.r, 0), partial);
    softmax_update(pb.va, s, st, rescale, score_scale);
    convert_p(p, s);

    // Steady state: S_i = Q K_i^T and O += P_{i-1} V_{i-1} in flight while softmax(S_i) runs.
    for (int i = 1; i < tiles; ++i) {
      const int sk = ring_stage(it + i), sv = ring_stage(it + i - 1);
      turn_begin();
      mbar_wait(sm.k_full + 8 * sk, ring_phase(it + i));
      if constexpr (kVWaitFirst) mbar_wait(sm.v_full + 8 * sv, ring_phase(it + i - 1));
      gemm_qk(s, q_rows, sm.k_tile(sk));
      rescale_owed();                                      // (kRescaleBeforePv) while QK_i runs
      if constexpr (!kVWaitFirst) mbar_wait(sm.v_full + 8 * sv, ring_phase(it + i - 1));
      gemm_pv(o, p, sm.v_tile(sv));
      turn_end(false);
      partial = partial_next;
      partial_next = partial_at(i + 1);
      wgmma_wait<1>();
      reg_fence(s);
      cs.release(sm.k_empty + 8 * sk);
      if constexpr (kPvWaitEarly) {
        wgmma_wait<0>();
        reg_fence(o);
        cs.release(sm.v_empty + 8 * sv);
      }
      process_scores(tile_at(tl.r, i), partial);
#ifdef FA3_SOFTMAX_SPLIT
      if constexpr (kSplitPvWait && !kPvWaitEarly) {
        // The row max and the exp2 arguments before this warpgroup's P V is waited for, the
        // exponentials after (FA4's order in SASS). A lone wait_group 0 is hoisted by ptxas to the
        // top of the softmax (NOTES v17 item 3); a block boundary pins it: a warp-uniform branch
        // on a value of this iteration, whose else arm (NaN only) differs so the arms stay apart.
        softmax_args(pb.va, s, st, rescale, score_scale);
        if constexpr (kSoftmaxFirst) softmax_exps(s, st, rescale);
        if (__all_sync(kFullMask, s[0] == s[0])) {
          wgmma_wait<0>();
        } else {
          wgmma_wait<0>();
          __threadfence_block();
        }
        if constexpr (!kSoftmaxFirst) softmax_exps(s, st, rescale);
      } else if constexpr (kSplitExps) {
        softmax_args(pb.va, s, st, rescale, score_scale);
        softmax_exps_half(s, st, rescale, 0);
        if (__all_sync(kFullMask, s[0] == s[0])) {          // (the pin: a block boundary, as above)
          wgmma_wait<0>();
        } else {
          wgmma_wait<0>();
          __threadfence_block();
        }
        reg_fence(o);
        rescale_o(o, rescale);
        softmax_exps_half(s, st, rescale, 1);
      } else
#endif
      {
        softmax_update(pb.va, s, st, rescale, score_scale);
        if constexpr (!kPvWaitEarly) wgmma_wait<0>();
      }
      if constexpr (!kPvWaitEarly) {
        reg_fence(o);
        cs.release(sm.v_empty + 8 * sv);
      }
      if constexpr (!kRescaleBeforePv && !kSplitExps) rescale_o(o, rescale);
      convert_p(p, s);
    }
    if (!kOInQ) cs.release(sm.q_empty + 8 * qs);         // every QK of this tile is done

    // The last P V and the epilogue are owed: issued with the next tile's first QK, or here.
    pending = true;
    prev_m0 = tl.m0;
#if TAIL_SPLIT
    prev_t = t;
#endif
    prev_hm = tl.hm;
    prev_sv = ring_stage(it + tiles - 1);
    prev_phase = ring_phase(it + tiles - 1);
    it += tiles;
    ++q_iter;
    if (!kOverlapTiles) drain_alone();
  }
  if (kOverlapTiles && pending) drain_alone();
  if (cs.wg_thread == 0) tma_store_wait_read();            // smem must outlive the last store
}
