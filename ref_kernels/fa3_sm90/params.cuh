// Compile-time constants of kernel.cu: tile sizes from its -D macros, the accumulator fragment
// sizes and layout, the shared-memory layout, named barriers, and the static checks on them.
// kernel.cu includes this after the macros (and after wgmma.cuh / hopper_ptx.cuh, whose tags and
// helpers it names).
// The register budgets per role sit in kernel.cu after the regions: they read region flags.
#pragma once

namespace fa3 {

constexpr int kHeadDim = HEAD_DIM;
constexpr int kBlockM = BLOCK_M;
constexpr int kBlockN = BLOCK_N;
constexpr int kStages = STAGES;
constexpr bool kCausal = IS_CAUSAL != 0;
#if DTYPE_BF16
using MmaTag = TagBf16;
#else
using MmaTag = TagHalf;
#endif

constexpr int kElemBytes = 2;
constexpr int kWarpSize = 32;
constexpr int kWgThreads = 128;
constexpr int kWarpsPerWg = kWgThreads / kWarpSize;
constexpr int kWgRows = 64;                       // wgmma M: rows of Q per consumer warpgroup
constexpr int kMmaK = 16;                         // wgmma K for 16-bit inputs
constexpr int kConsumers = kBlockM / kWgRows;
constexpr int kThreads = (kConsumers + 1) * kWgThreads;
constexpr int kSwizzleBytes = 128;                // TMA / wgmma 128-byte swizzle span
constexpr int kPanelCols = kSwizzleBytes / kElemBytes;
constexpr int kPanels = kHeadDim / kPanelCols;
constexpr int kSwizzleAtomBytes = 8 * kSwizzleBytes;   // 8 rows x 128 B: the swizzle pattern repeat
constexpr int kKStepsPerPanel = kPanelCols / kMmaK;
constexpr int kKStepBytes = kMmaK * kElemBytes;        // advance along K inside a swizzled row

// Register budget per thread after setmaxnreg (kProducerRegs / kConsumerRegs, set after the
// regions): the producer gives its registers to the consumers. setmaxnreg only moves registers
// inside the CTA's allocation, which __launch_bounds__(kThreads, 1) fixes at kEntryRegs per
// thread: asking for more makes setmaxnreg.inc wait forever.
constexpr int kRegFile = 65536;
constexpr int kRegGranule = 8;
constexpr int kEntryRegs = (kRegFile / ((kConsumers + 1) * kWgThreads)) / kRegGranule * kRegGranule;

// Per-thread fragment sizes of a 64 x N f32 wgmma accumulator: N/2 floats.
constexpr int kSRegs = kBlockN / 2;
constexpr int kORegs = kHeadDim / 2;
constexpr int kPRegs = kBlockN / 4;                // two 16-bit values per register

// Fragment coordinates of a consumer thread: element s[4*j + 2*half + e] of a 64 x N accumulator
// sits at row 16*warp + lane/4 + 8*half, column 8*j + 2*(lane%4) + e.
struct Frag { int row0; int col0; };
__device__ __forceinline__ Frag frag_coords(int wg_thread) {
  const int warp = wg_thread / kWarpSize, lane = wg_thread % kWarpSize;
  return Frag{16 * warp + lane / 4, 2 * (lane % 4)};
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = __builtin_bit_cast(float, 0xff800000u);   // -inf (nvcc and NVRTC)
constexpr unsigned kFullMask = 0xffffffffu;

// Shared-memory layout (byte offsets from a 1024-aligned base). Tiles are stored as panels of
// [rows][64 cols] in the 128B-swizzled layout that TMA writes and wgmma reads.
constexpr int kQBytes = kBlockM * kHeadDim * kElemBytes;
constexpr int kKVBytes = kBlockN * kHeadDim * kElemBytes;
constexpr int kQPanelBytes = kBlockM * kSwizzleBytes;
constexpr int kKVPanelBytes = kBlockN * kSwizzleBytes;
constexpr int kWgQBytes = kWgRows * kSwizzleBytes;     // one consumer's rows inside a Q panel
constexpr int kTileSlots = 2;                        // depth of the tile hand-over ring
constexpr int kTileSlotBytes = 128;                  // one TileMsg (static_assert below)
constexpr int kSmemAlign = 1024;
constexpr int kSmemLimit = 227 * 1024;
constexpr int kRingBytes = kStages * kKVBytes;           // the K ring; the V ring the same
// Barriers and the tile_slot ring with q_slots Q slots: q full/empty per slot, tile full/empty
// per slot, k/v full/empty per stage.
__host__ __device__ constexpr int bar_bytes(int q_slots) {
  return (2 * q_slots + 2 * kTileSlots + 4 * kStages) * 8 + kTileSlots * kTileSlotBytes;
}
// Q slots: with two, the producer loads the next tile's Q while this tile's GEMMs run (one slot:
// the load waits for this tile's last QK and its latency shows at short lengths). Two only with
// a separate O stage beside them, when that fits; Q_SLOTS=1 forces one (A/B, the tuner).
#ifndef Q_SLOTS
#define Q_SLOTS 2
#endif
constexpr bool kTwoQ = Q_SLOTS >= 2 && 3 * kQBytes + 2 * kRingBytes + bar_bytes(2) + kSmemAlign <= kSmemLimit;
constexpr int kQSlots = kTwoQ ? 2 : 1;
constexpr int kBarBytes = bar_bytes(kQSlots);
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kQSlots * kQBytes;
constexpr int kOffV = kOffK + kRingBytes;
// O is staged for its TMA store in its own buffer when that fits, so the next tile's Q can load
// during the epilogue; otherwise it reuses the (only) Q slot and Q is released after the store.
constexpr bool kSeparateO = kTwoQ || kOffV + kRingBytes + kQBytes + kBarBytes + kSmemAlign <= kSmemLimit;
// O_HALF=1 (Fa3Config.o_half; session 14, an option until measured): where no O stage fits (D 128
// 128 x 176: Q 32 KB + ring 176 KB + O 32 KB > 227 KB), O is staged in a buffer of one consumer's 64
// rows (16 KB, after the V ring; 18 KB are free there) that the consumers use in turn (o_free, an
// mbarrier after the tile slots), instead of in the only Q slot. Q is then freed after a tile's last
// QK, so the next Q loads during the drain and tiles overlap as with a separate O stage (consumer.cuh).
#ifndef O_HALF
#define O_HALF 0
#endif
// Two consumers: use u of the stage waits for use u - 1's phase by parity, which with a third
// consumer could alias (u - 2 not yet complete).
constexpr bool kOHalf = O_HALF && !kSeparateO && kConsumers == 2;
constexpr bool kOInQ = !kSeparateO && !kOHalf;          // O staged in the (only) Q slot
constexpr int kOHalfBytes = kWgRows * kHeadDim * kElemBytes;
constexpr int kOWgStride = kOHalf ? 0 : kWgQBytes;         // consumer c's O rows at o + c * this
constexpr int kOPanelBytes = kOHalf ? kWgQBytes : kQPanelBytes;   // a 64-column panel of the O stage
constexpr int kOffO = kSeparateO || kOHalf ? kOffV + kRingBytes : kOffQ;
constexpr int kOffBar = kOffV + kRingBytes + (kSeparateO ? kQBytes : kOHalf ? kOHalfBytes : 0);
constexpr int kOFreeBytes = kOHalf ? 8 : 0;                // the o_free mbarrier after the tile slots
constexpr int kSmemBytes = kOffBar + kBarBytes + kOFreeBytes + kSmemAlign;   // + slack to align the base
constexpr int kEmptyArrivals = kConsumers * kWarpsPerWg;             // one arrive per consumer warp

// Named barriers (0 is __syncthreads).
constexpr int kBarWgTurn0 = 1;                       // wg_turn[c] = kBarWgTurn0 + c
constexpr int kBarEpilogue0 = kBarWgTurn0 + kConsumers;   // epilogue_sync[c], 128 threads
constexpr int kMaxNamedBarriers = 16;

static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "HEAD_DIM must be 64, 128 or 256");
static_assert(kHeadDim != 256 || kBlockM == 128,
              "HEAD_DIM 256 needs BLOCK_M 128: a third consumer's 64 x 256 O accumulator does not fit");
static_assert(kBlockM == 128 || kBlockM == 192, "BLOCK_M must be 128 (2 consumers) or 192 (3)");
static_assert(kBlockN % kMmaK == 0 && kBlockN >= kMmaK && kBlockN <= 256,
              "BLOCK_N must be a multiple of 16 in [16, 256] (wgmma N, TMA box)");
static_assert(kBlockM <= 256, "TMA box rows are at most 256");
static_assert(kStages >= 2, "STAGES must be >= 2 so loads overlap compute");
static_assert(Q_SLOTS == 1 || Q_SLOTS == 2, "Q_SLOTS must be 1 or 2");
static_assert(kSmemBytes <= kSmemLimit, "tiles do not fit in 227 KB of shared memory");
static_assert(!O_HALF || kSeparateO || kOffO % kSmemAlign == 0, "O_HALF: the O stage must be 1024-aligned");
#ifdef HOST_SMEM_BYTES   // the launcher's size (Fa3Config.smem_bytes): a layout change must reach it
static_assert(kSmemBytes == HOST_SMEM_BYTES,
              "the host launches with another shared-memory size than this layout needs: update "
              "Fa3Config (cubridge/runtime/fa3_sm90.py) with params.cuh");
#endif
static_assert(kBarEpilogue0 + kConsumers <= kMaxNamedBarriers, "too many named barriers");

}  // namespace fa3
