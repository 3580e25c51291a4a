// Compile-time constants of fa3_bwd_sm90/kernel.cu: tile sizes, fragment sizes, the shared-memory
// layout, named barriers and register budgets, with the static checks on them. Included by
// kernel.cu after the -D macros and the PTX helpers of ../fa3_sm90.
#pragma once

namespace fa3b {

constexpr int kHeadDim = HEAD_DIM;
constexpr int kBlockN = 128;                      // KV rows per CTA: two consumers x 64
// TILE_M80 1 (session 16, bwd16; full attention at D = 128, off): 80 query rows per step (FA4's and C++ FA3's full-
// attention tile, HGMMA 64x80x16): S^T / dP^T are 64 x 80, dV / dK take 5 k-blocks, and dQ is computed transposed
// (dQ^T = K^T dS^T, m64n80: wgmma's M is 64 only), its dS operand stored K-major by stmatrix.trans, its parts 64 D
// columns x 80 queries in a tiled accumulator of its own order (tile_m80.cuh), one dQ slot (shared memory).
#ifndef TILE_M80
#define TILE_M80 0
#endif
constexpr bool kM80 = TILE_M80 == 1;
// DESC64 1 (session 16, bwd16; off): ISSUE's per-k-step wgmma descriptor as desc0 + offset / 16, one 64-bit add,
// instead of (desc0's high word) | (low word + offset / 16): the same 64-bit value (the 14-bit start address field
// cannot carry: shared addresses stay below 256 KB), but ptxas then keeps the high word in its uniform register
// instead of rewriting it (UMOV) before every HGMMA. nvdisasm, one unmasked step, D 128 bf16: the default 436 -> 397
// instructions (UMOV 71 -> 26; FA4's SM90 backward 440), TILE_M80 519 -> 488. Numerics unchanged (dK / dV bitwise).
#ifndef DESC64
#define DESC64 0
#endif
static_assert(DESC64 == 0 || (DESC64 == 1 && ISSUE >= 1), "DESC64=1 changes ISSUE's descriptors: it needs ISSUE>=1");
constexpr int kBlockM = kM80 ? 80 : 64;           // query rows per step of the Q / dO ring
constexpr int kStages = 2;                        // depth of the Q / dO ring
constexpr bool kCausal = IS_CAUSAL != 0;
// Performance options (NOTES.md "Options"; value 0 is the session-7 path, kept for A/B):
//   DQ_MODE 0: dQ += dS K by per-thread red.global.add.v2.f32 into a row-major [B, Hq, Nq, D]
//              accumulator; 1: each consumer writes its 64 x 64 part to shared memory (two slots)
//              and its thread 0 adds it with one cp.reduce.async.bulk (16 KB) into a tiled
//              accumulator (fragment order, converted by fa3_bwd_dq_convert_tiled).
//   SCHED   0: S, dP wait together, dV / dK / dQ issued, everything waited before the dQ atomics;
//           1: P computed under the dP GEMM, dV issued before the dS pass (which reads the
//              16-bit P), dQ then dK, the dQ part written out while the dK GEMM runs.
constexpr bool kDqBulk = DQ_MODE == 1;
//           2: SCHED 1 with FA4's issue order after the dS barrier: dQ issued at once, then the
//              wait for dV (dQ queued behind it: the tensor pipe does not drain between them),
//              then dK. SCHED 1 waits for dV before issuing dQ (its register budget).
constexpr bool kOverlap = SCHED >= 1;
constexpr bool kDqFirst = SCHED == 2;
//   LSE_SMEM 1 (with SCHED 1): the producer bulk-copies each query tile's 64 LSE (log2 units, +inf
//              for padding / rows that see no key) and Dvec values into the stage beside Q / dO,
//              from per-head padded copies the launcher makes; the passes read shared memory
//              instead of 16 + 16 global (L1) loads per thread, with no "row < Nq" branches.
constexpr bool kLseSmem = LSE_SMEM == 1;
//   TILE_ORDER 2: one linear grid, (b, kv head) pairs in sections of `l2_section` (a kernel
//              parameter the launcher sizes so a section's Q, dO, LSE, Dvec and fp32 dQ fit in L2),
//              tile-major inside a section: causal's longest tiles first within each section (FA4's
//              SingleTileLPTBwdScheduler sections, longest-first). Session 9's TILE_ORDER 1 (the KV
//              tile in blockIdx.z, every head tile-major at once) streamed every head together (bf16
//              8k: 64 heads x 8 MB of Q, dO, dQ against 50 MB of L2): causal 8k fell 450 -> 295
//              TFLOPS and full 510 -> 264 (H100); removed in session 10 (NOTES.md).
//   TILE_ORDER 3 (session 17, bwd17): TILE_ORDER 2's order (and decode) over a 3-D grid (KV tiles, kv heads, batch) as
//              TILE_ORDER 0 launches, the index linearised from blockIdx x, y, z (the same CTA order: the hardware
//              dispatches x fastest). A probe: session 17's rotated mid A/B read the TILE_ORDER 2 build 5% slower than
//              TILE_ORDER 0's at full attention, where both visit the same tiles in the same order (sections of one
//              pair); TILE_ORDER 3 tells a 1-D grid's dispatch from TILE_ORDER 2's decode code.
//   TILE_ORDER 4 (session 17, the mirror probe): TILE_ORDER 0's order and decode ((n, h, b) = x fastest) from a 1-D
//              grid of the same CTAs, decoded with integer divisions.
//   TILE_ORDER 5 (session 17, bwdc17): TILE_ORDER 2's order (sections of `section` pairs, tile-major inside) from a
//              3-D grid (section, KV tiles, pairs / section) read without a division: n = blockIdx.y, pair = x +
//              gridDim.x * z, b folded into the head (b = 0, h = b * Hkv + h: bh_q, bh_kv and the 3-D maps read
//              b * H + h; BNHD's 4-D maps divide). Why: session 17's final call read every decoded build (2, 3, 4)
//              5% below TILE_ORDER 0 at full attention, in the same CTA order; 5 keeps the coordinates as S2R reads
//              (as 0) so ptxas sees TILE_ORDER 0's code. The host needs section | pairs (it halves the section until
//              so). Dense only (the variants' mask_pred reads b).
constexpr bool kTileL2Sections = TILE_ORDER == 2 || TILE_ORDER == 3;
//   ARRIVE_ALL 1: every consumer thread arrives on the stage's q_empty (256 arrivals) instead of
//              lane 0 of each consumer warp (8). Same ordering on the hardware; what it changes is
//              what compute-sanitizer's racecheck can prove: it orders a thread's shared-memory read
//              before the producer's next bulk copy into that stage only through an mbarrier arrive
//              of that same thread. With LSE_SMEM's ld.shared of LSE / Dvec and one arrive per warp,
//              session 9 (H100) counted 10240 "Potential WAR hazard"s (12 shown) on the LSE rows, even
//              with __syncwarp and the two bar.syncs (ds_ready, the dQ part's wg_sync) in between.
constexpr bool kArriveAll = ARRIVE_ALL == 1;
//   LEAN 1 (with LSE_SMEM 1): the per-call fixed costs. The launcher runs one fa3_bwd_preprocess
//              (padded log2 LSE, padded Dvec, the whole tiled dQ accumulator zeroed) instead of
//              fa2_bwd_preprocess plus a handful of torch ops, and each consumer's thread 0 ends by
//              waiting for its last dQ bulk add to have READ shared memory (wait_group.read, as
//              FA3 / FA4 and CUTLASS's TMA-store epilogues end) instead of for its completion in L2:
//              the CTA exits (and the next one starts on the SM) an L2 round trip sooner; the kernel
//              boundary still orders the adds before the convert kernel's reads.
constexpr bool kLean = LEAN == 1;
//   ISSUE 1 (session 11; NOTES.md "Session 11"): fewer instructions per step on the consumers'
//              critical path, as FA4's SASS has them. (a) The consumer index is broadcast from lane
//              0 (__shfl_sync), so ptxas proves it warp-uniform and builds every wgmma descriptor in
//              uniform registers (ISSUE 0: the K / V rows' address depended on threadIdx, and each
//              of the 32 HGMMAs per step waited on 2 R2UR moves: 51 R2UR per step). (b) A GEMM's
//              descriptor is made once and each k-step adds its offset in 16-byte units to the low
//              word (make_desc per k-step: mask, shift, or, ~10 uniform ops per HGMMA). (c) dS^T goes
//              to its slot by 4 stmatrix.x4 per thread instead of 16 st.shared.u32, each with its
//              own swizzled address. (d) The step's (g, m) counted along, no division per step.
//              (e) The stage's LSE and the mask decision loaded under the S / dP GEMMs, its Dvec under
//              dV, so the passes after the waits do not start with a shared-memory round trip.
//              nvdisasm, D = 128 causal bf16: 748 -> 502 instructions per unmasked consumer step
//              (FA4's SM90 backward: 440). Numerics unchanged (same operations on the same values).
constexpr bool kIssue = ISSUE >= 1;
//   ISSUE 2: ISSUE 1, and the dS pass reads the f32 P^T (kept alive through the dV GEMM) instead of
//              unpacking its 16-bit copy: 32 integer instructions fewer per step (502 -> 470) and dS =
//              P (dP - Dvec) from the unrounded P, as SCHED 0, FA4 and the portable backward compute
//              it. Session 8 could not keep the f32 P (8-64 bytes of spill at D = 128); the registers
//              ISSUE 1 freed (descriptors in uniform registers) make it fit: all 8 spill-free.
constexpr bool kDsFromP32 = ISSUE == 2;
//   EPILOGUE 1 (with DQ_MODE 1): dK / dV leave through the consumer's dQ slots by stmatrix and 16-byte
//              row copies instead of 64 half-sector STG.32 per thread (epilogue.cuh; session 11).
constexpr bool kEpilogue = EPILOGUE == 1;
//   CARRY 1 (with SCHED 1; session 12): the step does not end by waiting for its dK GEMM. dK stays in
//              flight (its dS^T registers carried in the loop) while the warpgroup goes on to the next
//              step's q_full wait and issues S^T, dP^T behind it; that step's first wgmma wait (S^T
//              landed) then also covers dK, and the previous stage is released there. SCHED 1 drained
//              the tensor pipe at every step's end (wait 0, arrive, loop, wait, issue: the next S^T
//              queues behind nothing of its own warpgroup); FA4 drains the same way. Costs: the stage
//              is freed one S^T GEMM later (the producer's next load starts that much later) and the 16
//              dS^T registers stay live across the next issue.
constexpr bool kCarry = CARRY == 1;
//   DV_LATE 1 (with SCHED 1, ISSUE 2; session 12): FA4's order after the P pass. SCHED 1 issues dV
//              before the dS pass (dV runs under it) and waits for dV after the dS barrier, before
//              issuing dQ (the tensor pipe idles from dV's end to dQ's issue: dS pass tail, stores,
//              barrier). DV_LATE waits for dP^T, runs the dS pass, stores dS^T, then issues dV, so dV
//              runs under the fence and the dS barrier, and dQ is queued behind it (wait 1 = dV).
constexpr bool kDvLate = DV_LATE == 1;
//   DQ_WRITER 1 (with DQ_MODE 1, SCHED 1; session 13): FA4's dQ writer warp. Warp 1 of the producer
//              warpgroup owns the dQ bulk adds: consumer c stores its part to slot s = it % 2,
//              fences and arrives on dq_full[c][s] (bar.arrive, no wait), and waits on dq_empty[c][s]
//              only before overwriting the slot (step it - 2's add has read it). The writer syncs on
//              dq_full[c][s], issues the 16 KB cp.reduce.async.bulk, waits until it has read shared
//              memory and arrives on dq_empty[c][s]. DQ_WRITER 0: each consumer's thread 0 issues the add after a
//              warpgroup barrier and waits for its bulk group (wait_group.read) before the ds_ready
//              barrier, so a slow add stalls thread 0's warp and with it the 256-thread barrier.
constexpr bool kDqWriter = DQ_WRITER == 1;
//   ROWS_EARLY 1 (with ISSUE >= 1; session 14): the stage's LSE rows (and the mask decision's read of
//              Nk - Nq) are loaded BEFORE the S^T / dP^T GEMMs are issued, not after. Session 13's ncu
//              (H100, 8k, default): the P pass's first FFMA held 11.9% (causal) / 12.7% (full) of all
//              warp samples in short_scoreboard on an LSE register, twice the S^T wait before it: LDS
//              issued behind 16 HGMMAs return only as the SS GEMMs (128 B/clk of shared memory, all of
//              it) let them, i.e. near dP^T's end, so the P pass ran after dP^T instead of under it.
//              2: also the Dvec rows before the dV GEMM is issued (its FADD held 1.2-1.5%). Same
//              operations on the same values: dK / dV bitwise the option without it.
constexpr int kRowsEarly = ROWS_EARLY;
//   M_ROTATE 1 (with SCHED 1; session 14): full attention's CTAs start their sweep over the query tiles at tile
//              2n of their range (n = the KV tile, mod the range) and wrap around, instead of all at tile 0.
//              Causal CTAs already start at 2n (their range begins at the diagonal): they are unchanged. Why:
//              with every CTA of a head at the same query tile at once, the head's 64 (8k) or 128 (16k) CTAs
//              bulk-add into the same 32 KB of the fp32 dQ accumulator in the same step; ours loses 2-6% going
//              from full 8k to full 16k (same CTA count, twice the steps) where cuDNN and FA4 gain 1-3% and our
//              causal gains 5%. dK / dV sum the same terms in another order (the rule decides).
//   M_ROTATE 2 (session 15, bwd15): the same in groups of kRotGroup KV tiles: group j (tiles 64j .. 64j + 63) starts
//              at tile 128j of the range, all its CTAs together. At 8k (64 KV tiles) that is no rotation at all (the
//              default's order: a same-kernel control); at 16k the head's two groups sweep half a range apart, so each
//              dQ tile takes 64 CTAs' bulk adds per step (as at 8k) instead of 128, and each Q / dO tile is still read
//              by 64 CTAs at once (M_ROTATE 1 lost 7% at full 8k / 16k, taking that sharing away). A probe of why full
//              attention's per-step rate falls from 8k to 16k (NOTES "Session 15").
constexpr bool kMRotate = (M_ROTATE == 1 || M_ROTATE == 2) && !kCausal;   // causal builds: the option's code is not there
constexpr int kRotGroup = 64;
//   M_ROTATE 3 (session 17, bwd17; kMDescend): every CTA sweeps its query range from the last tile down to the first (causal:
//              the diagonal's masked steps come last). With the ascending sweep causal CTA n starts at tile 2n, so the
//              CTAs of a head in flight each read another Q / dO tile; descending, the CTAs that start together read
//              the same tile at once until each drops out at its diagonal, as full attention's do (M_ROTATE 1, the
//              staggered sweep for full attention, lost 7%). Same tiles, dK / dV summed in the reverse order.
constexpr bool kMDescend = M_ROTATE == 3;
__device__ __forceinline__ constexpr int m_rotation(int n_tile, int steps) {
  if constexpr (M_ROTATE == 2) return (kMRotate && steps > 0) ? (2 * (n_tile - n_tile % kRotGroup)) % steps : 0;
  return (kMRotate && steps > 0) ? (2 * n_tile) % steps : 0;
}
#if DTYPE_BF16
using MmaTag = TagBf16;
#else
using MmaTag = TagHalf;
#endif

constexpr int kElemBytes = 2;
constexpr int kWarpSize = 32;
constexpr int kWgThreads = 128;
constexpr int kWarpsPerWg = kWgThreads / kWarpSize;
constexpr int kWgRows = 64;                       // wgmma M: KV rows per consumer warpgroup
constexpr int kMmaK = 16;
constexpr int kConsumers = kBlockN / kWgRows;
constexpr int kThreads = (kConsumers + 1) * kWgThreads;
constexpr int kSwizzleBytes = 128;
constexpr int kPanelCols = kSwizzleBytes / kElemBytes;   // 64 columns per swizzled panel
constexpr int kPanels = kHeadDim / kPanelCols;
constexpr int kSwizzleAtomBytes = 8 * kSwizzleBytes;
constexpr int kKStepsPerPanel = kPanelCols / kMmaK;
constexpr int kKStepBytes = kMmaK * kElemBytes;          // along K inside a swizzled row (K-major)
constexpr int kRowStepBytes = kMmaK * kSwizzleBytes;     // along K across rows (MN-major)

// Per-thread fragments (64 x N f32 accumulators hold N / 2 floats).
constexpr int kSRegs = kBlockM / 2;               // S^T and dP^T: 64 KV rows x 64 queries
constexpr int kAccRegs = kHeadDim / 2;            // dK and dV: 64 KV rows x D
constexpr int kPRegs = kBlockM / 4;               // P^T, dS^T as 16-bit wgmma A operands
// dQ = dS K: with D = 128 each consumer computes 64 of the 128 columns over all 128 keys (N
// split: both halves of dS are read, hence the ds_ready barrier); with D = 64 each computes all
// 64 columns over its own 64 keys (K split: no cross-consumer wait, twice the atomics, small D).
constexpr bool kDqSplitN = kHeadDim == 128;
constexpr int kDqCols = 64;                       // wgmma N of the dQ GEMM in both splits (TILE_M80: its M, D columns)
constexpr int kDqRegs = kM80 ? kBlockM / 2 : kDqCols / 2;   // TILE_M80: dQ^T 64 columns x 80 queries
constexpr int kDqKSteps = (kDqSplitN ? kBlockN : kWgRows) / kMmaK;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = __builtin_bit_cast(float, 0xff800000u);
constexpr float kPosInf = __builtin_bit_cast(float, 0x7f800000u);

// Shared memory (byte offsets from a 1024-aligned base); tiles as panels of [rows][64 cols],
// 128B-swizzled as TMA writes them and wgmma reads them.
constexpr int kKVBytes = kBlockN * kHeadDim * kElemBytes;
constexpr int kKVPanelBytes = kBlockN * kSwizzleBytes;
constexpr int kQBytes = kBlockM * kHeadDim * kElemBytes;      // one Q (or dO) stage
constexpr int kQPanelBytes = kBlockM * kSwizzleBytes;
constexpr int kDsBytes = kBlockN * kBlockM * kElemBytes;      // dS^T [128 keys][64 queries] (TILE_M80: dS, 2 x [80][64 keys])
constexpr int kDsPanelBytes = kBlockM * kSwizzleBytes;        // TILE_M80: one consumer's 64 keys of dS, K-major
constexpr int kDsSlots = 2;   // double buffered: one ds_ready barrier per step suffices (NOTES.md)
constexpr int kSmemAlign = 1024;
constexpr int kSmemLimit = 227 * 1024;
constexpr int kOffK = 0;
constexpr int kOffV = kOffK + kKVBytes;
constexpr int kOffQ = kOffV + kKVBytes;
constexpr int kOffDo = kOffQ + kStages * kQBytes;
constexpr int kOffDs = kOffDo + kStages * kQBytes;
constexpr int kOffDq = kOffDs + kDsSlots * kDsBytes;
constexpr int kDqPartFloats = (kM80 ? kBlockM : kWgRows) * kDqCols;   // one consumer's 64 x 64 dQ part (M80: 80 x 64)
constexpr int kDqPartBytes = kDqPartFloats * 4;
constexpr int kDqChunks = kDqPartFloats / 4 / kWgThreads;     // float4 stores per thread (8)
constexpr int kDqParts = kHeadDim / kDqCols;                  // parts per query tile (tiled accum)
// slot it % 2: step it's bulk add reads it while step it + 1 writes the other. TILE_M80: one slot (2 x 20 KB; two
// would need 264 KB of shared memory), step it + 1's stores wait for step it's add to have read it
constexpr int kDqSlots = kM80 ? 1 : 2;
constexpr int kDqSmemBytes = kDqBulk ? kDqSlots * kConsumers * kDqPartBytes : 0;
constexpr int kRowTermBytes = kBlockM * 4;                   // one stage's LSE (or Dvec) floats
constexpr int kOffLse = kOffDq + kDqSmemBytes;
constexpr int kOffDvec = kOffLse + kStages * kRowTermBytes;
constexpr int kRowTermSmemBytes = kLseSmem ? 2 * kStages * kRowTermBytes : 0;
constexpr int kOffBar = kOffLse + kRowTermSmemBytes;
//   PERSIST 1 (variants; persist.cuh): one CTA per SM takes KV tiles from a queue in TILE_ORDER 2's order
//              (longest first within each section), hiding each tile's fixed cost (K / V load, first
//              stage, run scan, dK / dV epilogue) under its neighbours' steps. Three more mbarriers:
//              kv_empty (the consumers' last K / V read of a tile), sched_full / sched_empty (the next
//              tile's index and query runs written / the consumers done reading them).
constexpr bool kPersist = PERSIST == 1;
constexpr int kBarBytes = (1 + 2 * kStages + (kPersist ? 3 : 0)) * 8;   // kv_full, q_full[], q_empty[] (+ PERSIST's)
constexpr int kSmemBytes = kOffBar + kBarBytes + kSmemAlign;  // + slack to align the base
// q_empty's count: one arrive per consumer warp, or per consumer thread (ARRIVE_ALL)
constexpr int kEmptyArrivals = kConsumers * (kArriveAll ? kWgThreads : kWarpsPerWg);

// Named barriers (0 is __syncthreads).
constexpr int kBarDsReady = 1;                    // both consumers wrote their dS^T rows
constexpr int kBarWg0 = 2;                        // wg_sync[c] = kBarWg0 + c, 128 threads
// DQ_WRITER: dq_full and dq_empty per consumer c AND slot s (id base + s * kConsumers + c), each a
// consumer warpgroup and the writer warp. Per slot, not per consumer: with two slots a consumer
// reaches step it + 1's dq_full arrive without waiting for anything of the writer's, and a second
// arrive on a barrier phase its first has not completed would complete it early (count reached by
// 4 + 1 of 5 warps). Per slot, each arrive is ordered after the previous phase's completion by the
// other barrier of the pair.
constexpr int kBarDqFull0 = 4;
constexpr int kBarDqEmpty0 = kBarDqFull0 + kDqSlots * kConsumers;
__device__ __forceinline__ constexpr int dq_full_bar(int c, int it) { return kBarDqFull0 + (it % kDqSlots) * kConsumers + c; }
__device__ __forceinline__ constexpr int dq_empty_bar(int c, int it) { return kBarDqEmpty0 + (it % kDqSlots) * kConsumers + c; }
constexpr int kDqWriterWarp = 1;                  // warp 1 of the producer warpgroup (warp 0: TMA)
constexpr int kDqBarThreads = kWgThreads + kWarpSize;

// Register budgets after setmaxnreg: 24 for the one-thread producer, 240 for the consumers
// (dK, dV: 2 x D/2, S^T, dP^T: 2 x 32, dQ 32), inside the 65536 / 384 = 170 per thread that
// __launch_bounds__(kThreads, 1) gives the CTA.
constexpr int kRegFile = 65536;
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;

static_assert(kHeadDim == 64 || kHeadDim == 128, "HEAD_DIM must be 64 or 128");
static_assert(DQ_MODE == 0 || DQ_MODE == 1, "DQ_MODE must be 0 (atomics) or 1 (bulk reduce)");
static_assert(SCHED >= 0 && SCHED <= 2, "SCHED must be 0 (serial), 1 (overlap) or 2 (overlap, dQ first)");
// SCHED 1 with the atomics spilled 8 bytes at D = 128 causal (ptxas, nvcc 13.0): the overlapped
// order is built for the bulk dQ path only; (0, 0), (1, 0), (1, 1) still separate the two gains.
static_assert(!(SCHED >= 1 && DQ_MODE == 0), "SCHED=1 or 2 needs DQ_MODE=1");
static_assert(LSE_SMEM == 0 || (LSE_SMEM == 1 && SCHED >= 1), "LSE_SMEM=1 needs SCHED=1 or 2");
static_assert(TILE_ORDER == 0 || (TILE_ORDER >= 2 && TILE_ORDER <= 5), "TILE_ORDER must be 0, 2, 3, 4 or 5 (1 was removed: NOTES.md)");
static_assert(ARRIVE_ALL == 0 || ARRIVE_ALL == 1, "ARRIVE_ALL must be 0 (a lane per warp) or 1 (every thread)");
static_assert(EPILOGUE == 0 || (EPILOGUE == 1 && DQ_MODE == 1), "EPILOGUE=1 needs DQ_MODE=1 (it stages in the dQ slots)");
static_assert(ISSUE == 0 || ((ISSUE == 1 || ISSUE == 2) && LSE_SMEM == 1), "ISSUE=1 or 2 needs LSE_SMEM=1 (it preloads the stage's LSE / Dvec rows)");
static_assert(DV_LATE == 0 || (DV_LATE == 1 && SCHED == 1 && ISSUE == 2), "DV_LATE=1 needs SCHED=1 and ISSUE=2");
static_assert(DQ_WRITER == 0 || (DQ_WRITER == 1 && DQ_MODE == 1 && SCHED >= 1),
              "DQ_WRITER=1 needs DQ_MODE=1 and SCHED=1 or 2 (it hands their bulk dQ adds to a writer warp)");
static_assert(ROWS_EARLY >= 0 && ROWS_EARLY <= 2 && (ROWS_EARLY == 0 || (ISSUE >= 1 && SCHED >= 1)),
              "ROWS_EARLY=1 or 2 needs ISSUE>=1 and SCHED=1 or 2 (it moves ISSUE's row-term preloads)");
static_assert(M_ROTATE == 0 || M_ROTATE == 3 || ((M_ROTATE == 1 || M_ROTATE == 2) && SCHED == 1 && ISSUE >= 1),
              "M_ROTATE=1 or 2 needs SCHED=1 and ISSUE>=1 (it changes the flat step loop's tile); 3 is descending");
static_assert(M_ROTATE != 3 || (SCHED >= 1 && ISSUE >= 1 && TILE_M80 == 0 && PERSIST == 0),
              "M_ROTATE=3 needs SCHED=1 or 2 and ISSUE>=1 (the flat step loop's sweep_tile), no TILE_M80 / PERSIST");
static_assert(kBarDqEmpty0 + kDqSlots * kConsumers <= 16, "DQ_WRITER's named barriers exceed the 16 ids");
static_assert(CARRY == 0 || (CARRY == 1 && SCHED == 1), "CARRY=1 needs SCHED=1 (it changes SCHED 1's step end)");
static_assert(LEAN == 0 || (LEAN == 1 && LSE_SMEM == 1), "LEAN=1 needs LSE_SMEM=1 (its preprocess writes the padded rows)");
static_assert(PERSIST == 0 || (PERSIST == 1 && TILE_ORDER == 2 && SCHED == 1 && LEAN == 1 && EPILOGUE == 1 &&
                                DQ_WRITER == 0 && CARRY == 0 && DV_LATE == 0),
              "PERSIST=1 needs TILE_ORDER=2, SCHED=1, LEAN=1, EPILOGUE=1 and no DQ_WRITER / CARRY / DV_LATE");
static_assert(TILE_M80 == 0 || (TILE_M80 == 1 && HEAD_DIM == 128 && !IS_CAUSAL && DQ_MODE == 1 && SCHED == 1 && LEAN == 1 &&
                                 LSE_SMEM == 1 && ISSUE >= 1 && DV_LATE == 0 && CARRY == 0 && M_ROTATE == 0 &&
                                 PERSIST == 0),
              "TILE_M80=1 is built for full attention at D = 128 on the SCHED 1 / LEAN / ISSUE path (no CARRY, DV_LATE, "
              "M_ROTATE, PERSIST)");
static_assert(kSmemBytes <= kSmemLimit, "tiles do not fit in 227 KB of shared memory");
static_assert(kProducerRegs * kWgThreads + kConsumerRegs * kConsumers * kWgThreads <= kRegFile,
              "setmaxnreg budgets exceed the register file (setmaxnreg.inc would hang)");
static_assert(kOffDs % kSmemAlign == 0 && kOffQ % kSmemAlign == 0 && kOffDo % kSmemAlign == 0,
              "swizzled tiles must start on 1024-byte boundaries");
#ifdef HOST_SMEM_BYTES
static_assert(kSmemBytes == HOST_SMEM_BYTES,
              "cubridge/runtime/fa3_bwd_sm90.py launches with another shared-memory size: update it");
#endif

}  // namespace fa3b
