"""Build and launch the Hopper reference kernel ref_kernels/fa3_sm90/kernel.cu from PyTorch.

The kernel reads Q, K, V and writes O through TMA, so each launch needs four CUtensorMap
descriptors encoded on the host. They are encoded with `cuTensorMapEncodeTiled` called through
ctypes on the driver library (libcuda) that PyTorch has already loaded, and the cubin is loaded and
launched through the same driver API. Why ctypes and not cuda-python: six driver calls with plain C
signatures need no extra dependency, behave the same under every cuda-python major version (their
Python signatures changed between 12.x and 13.x), and the launch runs on PyTorch's current stream
and primary context with no interop layer. The cubin is built by nvcc through the shared compile
cache (cubridge.runtime.build.compile_cubin).

Example (on an sm_90 GPU):
    >>> import torch
    >>> from cubridge.runtime.fa3_sm90 import fa3_forward
    >>> q = torch.randn(1, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> k = v = torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> o, lse = fa3_forward(q, k, v, causal=True)  # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from cubridge.errors import LaunchError
from cubridge.paths import REF_KERNELS_DIR
from cubridge.runtime.build import compile_cubin, default_compiler
from cubridge.runtime.driver import capability, current_stream, driver, pack_params, scratch_tensor, sm_count
from cubridge.runtime.lpt import section_shift

KERNEL_DIR = REF_KERNELS_DIR / "fa3_sm90"
KERNEL_SOURCE = KERNEL_DIR / "kernel.cu"
ENTRY = b"fa3_sm90_fwd"
COUNTS_ENTRY = b"fa3_sm90_tile_counts"   # KV tiles per work tile, for the longest-first order
MAPS_4D_MARK = b"fa3_sm90_maps_4d"         # kernel.cu's marker: Q, K, V, O through 4-D TMA maps
ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)   # wgmma/setmaxnreg need sm_90a
NVCC_FLAGS = ("-cubin", "-std=c++17", "-O3", *ARCH_FLAGS)

# Shared-memory arithmetic mirrored from kernel.cu (checked by static_assert there).
ELEM_BYTES = 2
SMEM_ALIGN = 1024
SMEM_LIMIT = 227 * 1024
PANEL_COLS = 64          # TMA box width: 128 bytes, the swizzle span
WG_ROWS = 64             # rows of Q per consumer warpgroup (wgmma M)
WG_THREADS = 128
SUPPORTED_HEAD_DIMS = (64, 128, 256)
TILE_SLOTS = 2           # depth of the producer -> consumer tile ring
TILE_SLOT_BYTES = 128    # one TileMsg (tile index, heads, KV range)
MAX_STRIDE_BYTES = 1 << 40   # cuTensorMapEncodeTiled: global strides below 2^40 and multiples of 16 B
STRIDE_ALIGN = 16


@dataclass(frozen=True)
class Fa3Config:
    """Compile-time parameters of kernel.cu (its -D macros)."""
    head_dim: int = 128
    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    causal: bool = False
    bf16: bool = True
    persistent: bool = False   # launch-time only: grid = #SMs (each CTA loops over tiles) vs #tiles
    q_slots: int = 2           # at most this many Q tiles in shared memory (2 where they fit)
    # Full attention only (no effect with causal; kernel.cu KV_ROTATE / L2_HINTS): each query block
    # starts its KV loop at its own tile; L2 evict-last on K / V, evict-first on Q. Off until an
    # H100 A/B shows the gain (session 9 on the kernel before: +4.0-5.6% together at full 8k / 16k).
    kv_rotate: bool = False
    l2_hints: bool = False
    # Full attention, persistent grid (kernel.cu TAIL_SPLIT): the last #tiles mod #CTAs tiles split
    # along KV, combined by the last chunk (session 13, fa3_sm90 NOTES). Off until an H100 A/B shows it.
    tail_split: bool = False
    # The consumers' GEMM turns (ping-pong, consumer.cuh kWgTurns). False drops them, as
    # FlashAttention-4's SM90 forward does at head dim 256 (no scheduler barrier above D 128).
    # On until an H100 A/B at D 256 shows the gain (session 13, experiments/bench_d256.py rows "f").
    wg_turns: bool = True
    # O rescaled between the next QK issue and its P V issue instead of after the P V wait
    # (consumer.cuh kRescaleBeforePv; FA4's rescale_O_before_gemm at D > 128). Off until measured;
    # at D 256 128 x 80 causal spill-free only with wg_turns=False (with turns: 8 bytes).
    rescale_before_pv: bool = False
    # With the split P V wait, the exponentials before the wait too (consumer.cuh kSoftmaxFirst;
    # FA4's source order). Off until measured; spill-free at D 256 with wg_turns=False.
    softmax_first: bool = False
    # Where no O stage fits (D 128 128 x 176), O staged in a 64-row buffer that the two consumers use
    # in turn, so the Q slot is freed after a tile's last QK and tiles overlap (params.cuh O_HALF,
    # session 14); no effect where O has its own stage. Off until an H100 A/B shows the gain.
    o_half: bool = False
    # Head dim 256 only: the producer issues K_i before V_{i-1} (kernel.cu K_BEFORE_V; FA4's SM90
    # producer order). On in the D 256 causal default since session 16 (with tile_sections: frkul 750.4 vs frul
    # 745.0 TFLOPS, the fifth small positive reading; bench_d256 rows "k"); off elsewhere.
    k_before_v: bool = False
    # Head dim 256 only: the P V waited for right after the QK, before the softmax, freeing the V slot
    # earlier (consumer.cuh PV_WAIT_EARLY). Off until an H100 A/B shows the gain (bench_d256 rows "e").
    pv_wait_early: bool = False
    # mbarrier waits sleep in the barrier (try_wait with a suspend-time hint, CUTLASS's) instead of retrying
    # (hopper_ptx.cuh MBAR_SLEEP; D 256 only until session 15, now every head dim). Off until an H100 A/B
    # shows it (bench_d256 rows "z"; ab_peer_patches --options mbar_sleep at D 64 / 128).
    mbar_sleep: bool = False
    # Three consumers (D 64's 192 x 128), dense kernel: each GEMM's wgmma descriptors built once, the k-steps
    # added (kernel.cu DESC_ONCE; two consumers always do). Off until an H100 A/B shows it (session 15).
    desc_once: bool = False
    # Head dim 256 only: the consumer index made warp-uniform in the consumers' branch, so the Q descriptor
    # lives in uniform registers (kernel.cu UNIFORM_Q; no R2UR pair before each QK HGMMA). On in the D 256
    # causal default (session 15 mid: +0.6%, bench_d256 rows "u"); off elsewhere.
    uniform_q: bool = False
    # The producer's mbarrier waits (its slot waits) with MBAR_SLEEP's suspend-time hint, the consumers' waits
    # without (kernel.cu PRODUCER_SLEEP; every head dim). Session 16 mid: 0.998-1.011 at D 64 / 128, 1k / 8k
    # (noise); off until the clock probe (experiments/clock_power_fwd.py --options producer_sleep) shows a gain.
    producer_sleep: bool = False
    # Without a tile order (the dense kernel), tiles in sections of as many heads as have K and V fit in L2
    # (a power of two), longest query blocks of the section first, instead of head by head (kernel tiles.cuh
    # TILE_SECTIONS): head by head, causal 8k's last head starts its longest tiles when only its own are left
    # (a greedy schedule ends 5.6% late at D 256 128 x 80, 32 heads). On in the D 256 causal default (session 16
    # mid: frul 745.0 vs fru 721.1 TFLOPS at 8k, bench_d256 rows "l"); off elsewhere (D 128 / 64: A/B pending).
    # 0: off, 1: sections sized to L2; n > 1 (an experiment): n heads a section at every length.
    tile_sections: int = 0
    # Head dim 256 only: the steady step waits for V_{i-1} before the QK issue, so that O's rescale and both GEMMs'
    # issue share one block (consumer.cuh V_WAIT_FIRST; ptxas otherwise sinks the rescale to the P V issue).
    # Off until an H100 A/B shows it (session 16 mid: fruv 734.4 vs fru 721.1, frulv 748.2 vs frul 745.0; rows "v").
    v_wait_first: bool = False
    # The dense kernel's softmax computes m of every 8 column groups' exponentials with a degree-3 polynomial on
    # the FMA pipe instead of MUFU.EX2 (kernel exp2_emu.cuh EXP2_EMU; 0 off, 1..7): at D 64 the exponentials cost
    # the MUFU as much as the GEMMs cost the tensor core (session 17). Off: it measured 0.82-0.90x at D 64 1k / 4k
    # (session 17 mid call; the softmax's latency in the consumers' turn chain, not the MUFU, sets the step).
    exp2_emu: int = 0
    # Dense causal: the query blocks after the first end at Nq, so where block_m does not divide Nq no block is partial
    # (the last, longest one padded; now the first overlaps the second by those rows) (kernel.cu ALIGN_END; D 64
    # 192 x 128 at 4k: 5.2% fewer KV steps, 8k / 16k 1.4%; session 17). No effect on full attention. On in D 64's
    # dense causal default from 4k (default_config).
    align_end: bool = False
    # The dense kernel's softmax takes each row half's max as a pairwise tree (depth 5 at N 128, not a 17-deep chain),
    # both halves and their shuffles side by side (kernel tree_max.cuh TREE_MAX; bitwise the same output): the row max
    # heads each consumer's softmax latency in the turn chain that sets D 64's step (session 17b). Off until an H100 A/B.
    tree_max: bool = False
    # Three consumers (D 64's 192 x 128): row half 0's exponentials, then the P V wait (pinned; ptxas otherwise hoists it
    # to the top of the softmax), O's rescale and half 1's exponentials (consumer.cuh SPLIT_EXPS; bitwise the same
    # output; not with exp2_emu). Off until an H100 A/B (session 17b).
    split_exps: bool = False

    def defines(self) -> list[str]:
        """The -D flags; `persistent` is not one (it only changes the grid). HOST_SMEM_BYTES makes
        the kernel check that its shared-memory layout is the size this class launches with."""
        flags = [f"-DHEAD_DIM={self.head_dim}", f"-DBLOCK_M={self.block_m}",
                 f"-DBLOCK_N={self.block_n}", f"-DSTAGES={self.stages}",
                 f"-DIS_CAUSAL={int(self.causal)}", f"-DDTYPE_BF16={int(self.bf16)}"]
        if self.q_slots != 2:
            flags.append(f"-DQ_SLOTS={self.q_slots}")
        flags += ["-DKV_ROTATE=1"] * self.kv_rotate + ["-DL2_HINTS=1"] * self.l2_hints
        flags += ["-DTAIL_SPLIT=1"] * self.tail_split
        flags += ["-DWG_TURNS=0"] * (not self.wg_turns) + ["-DRESCALE_BEFORE_PV=1"] * self.rescale_before_pv
        flags += ["-DSOFTMAX_FIRST=1"] * self.softmax_first + ["-DO_HALF=1"] * self.o_half
        flags += ["-DK_BEFORE_V=1"] * self.k_before_v
        flags += ["-DPV_WAIT_EARLY=1"] * self.pv_wait_early
        flags += ["-DMBAR_SLEEP=1"] * self.mbar_sleep + ["-DDESC_ONCE=1"] * self.desc_once
        flags += ["-DUNIFORM_Q=1"] * self.uniform_q + ["-DPRODUCER_SLEEP=1"] * self.producer_sleep
        flags += [f"-DTILE_SECTIONS={int(self.tile_sections)}"] * bool(self.tile_sections)
        flags += ["-DV_WAIT_FIRST=1"] * self.v_wait_first
        flags += [f"-DEXP2_EMU={int(self.exp2_emu)}"] * bool(self.exp2_emu) + ["-DALIGN_END=1"] * self.align_end
        flags += ["-DTREE_MAX=1"] * self.tree_max + ["-DSPLIT_EXPS=1"] * self.split_exps
        return flags + [f"-DHOST_SMEM_BYTES={self.smem_bytes}"]

    @property
    def threads(self) -> int:
        return (self.block_m // WG_ROWS + 1) * WG_THREADS

    @property
    def q_slots_used(self) -> int:
        """Q tiles in shared memory (kQSlots in params.cuh): two, beside a separate O stage, where
        they fit and q_slots allows; else one."""
        two = 3 * self._q_bytes + self._kv_bytes + self._barrier_bytes_for(2) + SMEM_ALIGN <= SMEM_LIMIT
        return 2 if self.q_slots >= 2 and two else 1

    @property
    def separate_o(self) -> bool:
        """O gets its own staging buffer when it fits (kSeparateO in params.cuh)."""
        return (self.q_slots_used == 2 or 2 * self._q_bytes + self._kv_bytes + self._barrier_bytes
                + SMEM_ALIGN <= SMEM_LIMIT)

    @property
    def o_half_used(self) -> bool:
        """O_HALF takes effect: no O stage of its own, two consumers (kOHalf in params.cuh)."""
        return self.o_half and not self.separate_o and self.block_m == 2 * WG_ROWS

    @property
    def smem_bytes(self) -> int:
        o = self._q_bytes if self.separate_o else 0
        if self.o_half_used:   # one consumer's O rows and the o_free mbarrier
            o = WG_ROWS * self.head_dim * ELEM_BYTES + 8
        return self.q_slots_used * self._q_bytes + self._kv_bytes + o + self._barrier_bytes + SMEM_ALIGN

    @property
    def _q_bytes(self) -> int:
        return self.block_m * self.head_dim * ELEM_BYTES

    @property
    def _kv_bytes(self) -> int:
        return 2 * self.stages * self.block_n * self.head_dim * ELEM_BYTES

    @property
    def _barrier_bytes(self) -> int:
        return self._barrier_bytes_for(self.q_slots_used)

    def _barrier_bytes_for(self, q_slots: int) -> int:
        """q full/empty per Q slot, tile full/empty per tile slot, k/v full/empty per stage (8 B
        each), and the tile messages (bar_bytes in params.cuh)."""
        return 8 * (2 * q_slots + 2 * TILE_SLOTS + 4 * self.stages) + TILE_SLOT_BYTES * TILE_SLOTS


def default_config(head_dim: int, causal: bool, bf16: bool = True, seqlen: int = 8192,
                   variant: bool = False, wide: bool | int = False) -> Fa3Config:
    """Tile sizes and grid mode for a shape class. Pure; each branch cites its measurement
    (H100, bf16, 16k tokens; experiments/results/fa3_sm90_v3_sweep_h100.json, then
    fa3_sm90_v11_sweep_h100.json after the scale fold; P = persistent with the dynamic tile
    scheduler, G = one tile per CTA). `variant`: a lowered variant (its own mask) runs with the
    pre-v11 tiles, the ones its benchmarks measured, unless `wide` (cubridge.lower.fa3_sm90.wide_tile:
    a softmax variant with no score_mod, no block table and one interval of keys per row, e.g.
    prefixlm, causal_blockwise, the corpus's causal / prefix / chunk masks; not a window, whose edges
    cut more of a 176-wide tile: lower/tileshare.py), which takes 128 x 176 from 8k at D 128 (session
    12's variant_tiles; the dense kernel takes 176 from 8k full / 16k causal since session 14); an
    int `wide` is the length from which it does (lower/fa3_sm90.py range_wide_from); the tuner
    searches the rest.

    >>> [default_config(128, causal=True, seqlen=n).block_n for n in (1024, 8192, 16384)]
    [128, 128, 176]
    >>> [default_config(128, causal=False, seqlen=n).block_n for n in (1024, 4096, 8192)]
    [128, 128, 176]
    >>> default_config(128, False, seqlen=8192).tail_split, default_config(128, True, seqlen=16384).tail_split
    (True, False)
    >>> default_config(128, False, variant=True).block_n
    128
    >>> default_config(128, False, variant=True, wide=True).block_n, default_config(128, False, seqlen=4096, variant=True, wide=True).block_n
    (176, 128)
    >>> [default_config(128, False, seqlen=n, variant=True, wide=16384).block_n for n in (8192, 16384)]
    [128, 176]
    """
    if head_dim == 256:
        # FlashAttention-3's hdim-256 tiles (hopper/tile_size.h): 128 x 80 (64 with a window), two
        # stages; 64 + 160 KB of Q and K/V: one Q slot, O staged in it. 128 x 64 compiles spill-free
        # under 40 / 232 registers, 128 x 80 under 24 / 240 (2 bytes per tile before session 10).
        # A lowered variant (softcap, window) takes 128 x 64.
        # Dense: FA4's D 256 schedule (no GEMM turns, O rescaled before the P V issue: "fr"), measured
        # beside the turns in three H100 runs at causal 8k: 703.8 vs 679.8 TFLOPS (session 13 mid),
        # 690.8 vs 685.2 (session 14 early), 700.2 vs 696.5 (session 14 mid); GPU rule tests passed
        # (test_fa3_sm90_d256 free / s14). A lowered variant keeps the turns (Gemma-2 local: fr 559 vs
        # 574, session 13 mid). Causal adds uniform_q (the Q descriptors in uniform registers: 76 fewer
        # instructions per KV step per consumer warp under ncu): 706.2 vs fr 702.2 TFLOPS, frkzu 709.1 vs
        # frkz 705.0 (session 15 mid, one round-robin; same cycles per step under ncu's clocks), 62 GPU
        # rule tests passed (s15); full attention passed them too but is not timed with it.
        # Session 16: causal adds k_before_v and tile_sections (the tiles in L2-sized sections of heads, longest
        # first inside one, instead of head by head, whose last head's long tiles ran alone: SMs held a CTA 94.3% of
        # the time under ncu, FA4's 98.6%): mid call one round-robin frkul 750.4 TFLOPS vs fru 721.1 (+4.1%; frul
        # 745.0, frku 725.8; FA4 769.8: 0.975x), GPU rule tests s16 passed (102; 4 hit out-of-memory in the float64
        # golden, rerun in the final call).
        if variant:
            return Fa3Config(head_dim, 128, 64, 2, causal, bf16, persistent=True)
        return Fa3Config(head_dim, 128, 80, 2, causal, bf16, persistent=True, wg_turns=False,
                         rescale_before_pv=True, uniform_q=causal, tile_sections=int(causal),
                         k_before_v=causal)
    if head_dim == 64:
        if causal and seqlen <= 2048:
            # d64 causal 1k: v3 128x128 P 277 TFLOPS vs 192x128 P 248, G 177 / 226. Stages: 3 vs 2
            # measured 264 vs 247 in one sweep (v11) and 300 vs 307 in the next (v12; 4: 310): noise.
            # v15 (two Q slots, tiles overlapped): 0.96-1.01x cuDNN over three runs.
            return Fa3Config(64, 128, 128, 2, causal, bf16, persistent=True)
        # d64 8k: 192x128 (3 consumers) causal P 445 / full P 503 vs 128x128 408 / 441;
        # full 1k: 192x128 P 391 vs 128x128 P 387 (v11: 361 vs 335; 3 stages 361)
        # Session 17 (d6417): dense causal adds align_end from 4k (final call 1, experiments/results/session17_h100/
        # final/F1/d6417/d6417_peers.json, one rotated round-robin over the default, MHA / GQA 64/8: 4k 1.043 / 1.045,
        # 8k 1.011 / 1.019, 16k 1.014 / 1.015; bitwise equal to the default, its 61 GPU tests -k s17 passed).
        return Fa3Config(64, 192, 128, 2, causal, bf16, persistent=True,
                         tile_sections=_sections(causal, seqlen, variant),
                         align_end=causal and not variant and seqlen >= 4096)
    # d128: 128x128, 2 stages (160 KB + 32 KB O stage), persistent. Causal P vs G: 1k 444 vs 383,
    # 8k 570 vs 535, 16k 596 vs 582; full 1k 584 vs 528, 8k 623 vs 597 (v3).
    # v11 (softmax scale in the exp2 FFMA): 128x176 wins full at 8k (646 vs 614; GQA 64/8 656 vs
    # 618, 128/8 648 vs 610) and causal at 8k (587 vs 574; 615 vs 599; 611 vs 599); at 1k 128x128
    # stays (causal 457 vs 396, full 519 vs 523).
    # Lowered variants, `wide` ones (session 12 mid call, variant_tiles beside our dense causal, 8k /
    # 16k): 128x176 with session 10's codegen vs 128x128: prefixlm 0.992 / 0.962 vs 0.960 / 0.917,
    # causal_blockwise 0.985 / 0.964 vs 0.950 / 0.923, ag_causal 0.972 / 0.953 vs 0.936 / 0.912.
    # Session 14: dense causal takes 128 x 176 only from 16k: at 8k 128 x 128 (two Q slots, a separate
    # O stage, tiles overlapped) beat or tied 128 x 176 (one Q slot, tiles drained) in four H100 runs
    # (MHA / GQA 64/8: s12 mid 1.019 / 1.023, s13 mid 1.018 / 1.015, s14 early 1.002 / 1.022, s14 mid
    # 1.017 / 1.020); at 16k it did not (1.004 / 0.997, 0.997 / 0.999, 0.997 / 0.970, 0.996 / 0.996).
    # Dense full takes 176 from 8k (was 2k): s14 mid, 128 x 128 over 176 at 2k 1.052 / 1.056, 4k
    # 1.030 / 1.033, 8k 0.999 / 0.994, 16k 0.984 / 0.972 (noise control 0.994-1.006); and with
    # tail_split (full only): s13 mid / s14 early / s14 mid 8k 1.004 / 1.006 / 1.003 (MHA), 1.011 /
    # 1.023 / 1.011 (GQA), 16k 1.017-1.028; it lost at 2k-4k (0.973-0.997, 176) and at D 64.
    # Lowered variants are not the dense kernel: `wide` ones keep 176 from 8k, no tail_split.
    if not variant and seqlen >= (16384 if causal else 8192):
        return Fa3Config(head_dim, 128, 176, 2, causal, bf16, persistent=True, tail_split=not causal,
                         tile_sections=_sections(causal, seqlen, variant))
    if variant and wide and seqlen >= (8192 if wide is True else wide):
        return Fa3Config(head_dim, 128, 176, 2, causal, bf16, persistent=True)
    return Fa3Config(head_dim, 128, 128, 2, causal, bf16, persistent=True,
                     tile_sections=_sections(causal, seqlen, variant))


# Dense causal at D 128 / 64 takes tile_sections (D 256's causal default since session 16) where it was measured:
# session 16 final call (H100, 8k, one rotated round-robin beside FA4, ab_peer_patches): D 128 MHA 704.2 vs 690.5
# TFLOPS (+2.0%; FA4 697.5), GQA 64/8 671.5 vs 664.2 (+1.1%; the same-kernel control read +1.0%); D 64 MHA 522.8
# vs 505.8 (+3.4%), GQA 505.9 vs 500.6 (+1.1%). Session 17 early call (same protocol, experiments/results/
# session17_h100/early/sections_ab.json), over the default at 4k / 16k: D 128 MHA +2.0 / +2.0% (16k: the 128 x 176
# tile), GQA +1.0 / +0.2%; D 64 MHA +2.3 / +2.4%, GQA +0.8 / +0.8%. At 1k it loses (D 128 0.952 / 0.990, D 64 0.961 /
# 0.982: 1k's few tiles per head leave no tail to fix and the sections cost L2 locality across heads), so from 4k on.
SECTIONS_FROM = 4096


def _sections(causal: bool, seqlen: int, variant: bool) -> int:
    """The dense kernel's tile_sections; a lowered variant's order comes from the host (CUBRIDGE_LPT_SECTIONS)."""
    return int(causal and not variant and seqlen >= SECTIONS_FROM)


# ------------------------------------------------------------------ build
def build_cubin(config: Fa3Config, *, cache_dir: Path | None = None, source: str | None = None,
                compiler: str | None = None) -> bytes:
    """Compile kernel.cu (or `source`, a lowered variant of it) for `config` to an sm_90a cubin,
    through the shared compile cache (key: source, flags, the included headers, compiler and its
    version). `compiler`: "nvcc", "nvrtc", or None for build.default_compiler() (nvcc if on PATH)."""
    text = KERNEL_SOURCE.read_text() if source is None else source
    options = ["-std=c++17", *config.defines(), f"-I{KERNEL_DIR}"]
    return compile_cubin(text, arch="sm_90a", options=options, compiler=compiler or default_compiler(),
                         cache_dir=cache_dir, name="kernel.cu").cubin


_FUNCTIONS: dict[tuple, tuple[ctypes.c_void_p, ctypes.c_void_p]] = {}


@functools.lru_cache(maxsize=64)
def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


# Host-path caches: a launch of a short sequence takes a few hundred microseconds on the GPU, so
# the per-call Python work (tensor-map encoding, a zeroed counter) showed in 1k timings.
_TENSOR_MAPS: OrderedDict = OrderedDict()
TENSOR_MAP_CACHE = 512
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def map_strides(shape: tuple, stride: tuple, elem: int) -> tuple[int, int, int] | None:
    """(row, head, batch) strides in elements of a [B, H, N, D] view for the kernel's 4-D TMA maps
    (D, N, H, B), or None where a map cannot express them (map_refusal says why). A dim of extent 1
    never moves off coordinate 0, so its stride is replaced by the contiguous one.

    >>> map_strides((2, 4, 8, 64), (2048, 512, 64, 1), 2)           # [B, H, N, D] contiguous
    (64, 512, 2048)
    >>> map_strides((2, 4, 8, 64), (2048, 64, 256, 1), 2)           # [B, N, H, D] seen as [B, H, N, D]
    (256, 64, 2048)
    >>> map_strides((2, 4, 8, 64), (2048, 512, 65, 1), 2) is None   # 130-byte rows
    True
    """
    return None if map_refusal(shape, stride, elem) else _strides(shape, stride)


def _strides(shape: tuple, stride: tuple) -> tuple[int, int, int]:
    b, h, n, d = shape
    sb, sh, sn, _ = stride
    return (sn if n > 1 else d, sh if h > 1 else n * d, sb if b > 1 else h * n * d)


def map_refusal(shape: tuple, stride: tuple, elem: int) -> str | None:
    """Why the 4-D TMA maps cannot address a [B, H, N, D] view in place, or None where they can.
    TMA needs the innermost dim contiguous and every other stride a positive multiple of 16 bytes
    below 2^40 (cuTensorMapEncodeTiled).

    >>> map_refusal((1, 2, 0, 64), (0, 0, 64, 1), 2) is None        # no key: nothing to address
    True
    >>> map_refusal((1, 2, 8, 64), (1024, 64, 128, 1), 2) is None    # [B, N, H, D] memory
    True
    >>> map_refusal((1, 2, 8, 64), (1024, 1, 2, 16), 2)
    'the head dim D is not contiguous (strides (1024, 1, 2, 16))'
    """
    if len(shape) != 4 or len(stride) != 4:
        return f"shape {tuple(shape)} is not 4-d"
    if 0 in shape:   # nothing to address (torch gives an empty tensor zero strides): the launchers
        return None  # return before building a map (fa3_forward: Nk = 0 -> O = 0, LSE = -inf)
    if shape[3] > 1 and stride[3] != 1:
        return f"the head dim D is not contiguous (strides {tuple(stride)})"
    for name, s in zip(("N", "H", "B"), _strides(shape, stride)):
        if s <= 0 or (s * elem) % STRIDE_ALIGN or s * elem >= MAX_STRIDE_BYTES:
            return (f"the {name} stride {s} ({s * elem} bytes) is not a positive multiple of "
                    f"{STRIDE_ALIGN} bytes below 2^40")
    return None


def tensor_map(t: torch.Tensor, rows_per_box: int) -> ctypes.Array:
    """The TMA descriptor of a [B, H, N, D] view, cached (the one cache of both launch paths,
    fa3_forward and fa3_fast): it depends only on the address, shape, strides and dtype, so a
    reused buffer, or the same tensor again, gets the same bytes. A view the maps cannot address
    is a LaunchError naming why."""
    key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, rows_per_box, t.device.index)
    view = _TENSOR_MAPS.get(key)
    if view is not None:
        _TENSOR_MAPS.move_to_end(key)
        return view
    why = map_refusal(tuple(t.shape), t.stride(), t.element_size()) or (
        "address not 16-byte aligned" if t.data_ptr() % 16 else None)
    if why:
        raise LaunchError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} is not addressable by "
                          f"the kernel's 4-D TMA maps: {why}",
                          hint="pass a fresh copy (.clone(memory_format=torch.contiguous_format))")
    view = driver().tensor_map_4d(t, rows_per_box, _strides(tuple(t.shape), t.stride()), PANEL_COLS)
    _TENSOR_MAPS[key] = view
    if len(_TENSOR_MAPS) > TENSOR_MAP_CACHE:
        _TENSOR_MAPS.popitem(last=False)
    return view


def tile_counter(device: torch.device, stream: int) -> torch.Tensor:
    """The scheduler's counter pair for launches on `stream`: zeroed once; every launch leaves it
    zero again (the kernel's last producer resets it), and launches on one stream run in order.
    Separate streams get separate pairs, so concurrent launches stay independent."""
    key = (device.index, stream)
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(2, device=device, dtype=torch.int32)
    return counter


# TAIL_SPLIT's per-stream state after the scheduler's pair: ints 2-3 the workspace's address, then
# TAIL_MAX_CHUNKS * 3 (consumers at most) chunk counters, each left zero by the launch that used it.
TAIL_MAX_CHUNKS = 160                 # kTailMaxChunks in tiles.cuh
_TAIL_HEAD = 4
_TAIL_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_TAIL_WORKSPACES: dict[tuple[int, int], list[torch.Tensor]] = {}


def tail_chunks(num_tiles: int, grid: int, kv_tiles: int) -> int:
    """Chunks per tail tile that kernel.cu's tail_plan picks (1: no split).

    >>> tail_chunks(4096, 132, 47), tail_chunks(8192, 132, 47), tail_chunks(4224, 132, 47), tail_chunks(64, 7, 8)
    (33, 16, 1, 7)
    """
    r = num_tiles % grid
    if num_tiles <= grid or r == 0:
        return 1
    split = min(grid // r, kv_tiles, TAIL_MAX_CHUNKS // r)
    return split if split >= 2 else 1


def tail_counter(device: torch.device, stream: int, config: Fa3Config) -> torch.Tensor:
    """tile_counter's pair for a TAIL_SPLIT launch, with the workspace address and the chunk
    counters after it (kernel.cu: Problem.tail_ws / tail_count). The workspace (TAIL_MAX_CHUNKS
    chunks of BLOCK_M x (D + 2) floats) grows when a config needs more; the address is written in
    stream order and every workspace stays alive, so launches already queued keep theirs."""
    key = (device.index, stream)
    counter = _TAIL_COUNTERS.get(key)
    if counter is None:
        counter = _TAIL_COUNTERS[key] = torch.zeros(_TAIL_HEAD + 3 * TAIL_MAX_CHUNKS, device=device,
                                                    dtype=torch.int32)
    floats = TAIL_MAX_CHUNKS * config.block_m * (config.head_dim + 2)
    spaces = _TAIL_WORKSPACES.setdefault(key, [])
    if not spaces or spaces[-1].numel() < floats:
        spaces.append(torch.empty(floats, device=device, dtype=torch.float32))
        counter.view(torch.int64)[1].fill_(spaces[-1].data_ptr())
    return counter


def launch_counter(device: torch.device, stream: int, config: Fa3Config) -> torch.Tensor:
    """The tile_counter argument of a launch of `config`: the scheduler's pair, or with tail_split
    the pair and TAIL_SPLIT's state after it (every launch path takes it from here)."""
    return tail_counter(device, stream, config) if config.tail_split else tile_counter(device, stream)


def _function(config: Fa3Config, device: torch.device, source: str | None = None, compiler: str | None = None,
              cubin: bytes | None = None):
    """The loaded entries for `config`: of `cubin` when given (keyed by the bytes object, whose
    hash Python computes once), else of `source` (or kernel.cu) built through the compile cache."""
    if cubin is not None:
        key = (config, device.index, cubin)
    else:
        key = (config, device.index, _digest(source) if source else None, compiler)   # None: the default
    if key not in _FUNCTIONS:
        if cubin is None:
            cubin = build_cubin(config, source=source, compiler=compiler)
        check_cubin(cubin)
        with driver().primary_context(device.index):   # torch's context; no stream touched (graph capture)
            _FUNCTIONS[key] = driver().load_function(cubin, config.smem_bytes, ENTRY, COUNTS_ENTRY)
    return _FUNCTIONS[key]


# ------------------------------------------------------------------ checks and launch
def check_cubin(cubin: bytes, where: str | None = None) -> None:
    """LaunchError for a cubin of this kernel from before its 4-D TMA maps (session 8): it would
    take the 4-D descriptors the host now encodes for 3-D ones and read the wrong heads."""
    if MAPS_4D_MARK not in cubin:
        raise LaunchError("this fa3_sm90 cubin was built from a kernel.cu with 3-D TMA maps (D, N, B*H); the "
                          "runtime now encodes 4-D maps (D, N, H, B)", where=where,
                          hint="rebuild it from this checkout's kernel.cu (tune the run again, or delete its "
                               "cubins so that cubridge.load compiles them)")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Fa3Config) -> None:
    """LaunchError naming the problem and the fix for inputs this kernel cannot run at `config`."""
    usage = ("expected q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] views (D contiguous; [B, N, H, D] memory "
             "seen through .transpose(1, 2) is read in place), same dtype and device")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise LaunchError(f"{name} has shape {tuple(t.shape)}", hint=usage)
        if not t.is_cuda:
            raise LaunchError(f"{name} is on {t.device}, not a CUDA device", hint="move it with .cuda()")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise LaunchError(f"{name} has dtype {t.dtype}", hint="use torch.float16 or torch.bfloat16")
        why = map_refusal(tuple(t.shape), t.stride(), t.element_size())
        if why:
            raise LaunchError(f"{name}: the kernel's TMA maps cannot read it in place: {why}",
                              hint="call .contiguous() first")
        if t.data_ptr() % 16:
            raise LaunchError(f"{name} data pointer is not 16-byte aligned", hint="call .clone()")
    if k.shape != v.shape:
        raise LaunchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ", hint=usage)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise LaunchError(f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}", hint=usage)
    if q.device != k.device or q.device != v.device:
        raise LaunchError(f"devices differ: q {q.device}, k {k.device}, v {v.device}", hint=usage)
    b, hq, _, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise LaunchError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B or D", hint=usage)
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise LaunchError(f"Hq={hq} is not a multiple of Hkv={k.shape[1]}",
                          hint="GQA needs Hq = G * Hkv")
    if d not in SUPPORTED_HEAD_DIMS or d != config.head_dim:
        raise LaunchError(f"head dim {d} (config built for {config.head_dim})",
                          hint=f"D must be one of {SUPPORTED_HEAD_DIMS} and match the config")
    if capability(q.device.index) != (9, 0):
        raise LaunchError(f"{torch.cuda.get_device_name(q.device)} is not sm_90",
                          hint="this kernel needs a Hopper GPU (H100/H200)")


def fa3_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                softmax_scale: float | None = None, config: Fa3Config | None = None,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                max_ctas: int | None = None, variant=None,
                compiler: str | None = None, cubin: bytes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: returns (o [B, Hq, Nq, D], lse [B, Hq, Nq] float32, natural log).

    causal means kv_idx <= q_idx with q_idx the query's position row + Nk - Nq (queries aligned to the
    end of the keys, as in FlashAttention; with Nq > Nk the first Nq - Nk rows see no key).
    q, k, v and out are [B, H, N, D] views with D contiguous and the other strides 16-byte
    multiples (4-D TMA maps): [B, N, H, D] memory seen through .transpose(1, 2) is read and written
    in place. `out` / `lse` may be passed preallocated (right shape and dtype; lse contiguous). `max_ctas` caps
    the grid (each CTA then loops over several tiles); tests use it to exercise tile hand-over.
    `variant` (a cubridge.lower.Launchable) runs a lowered variant of the kernel: its CUDA source
    and its VariantArgs (captured tensors, scalars), which must stay alive until the kernel ran.
    `compiler` picks nvcc or NVRTC for the first build of a config (default: nvcc if on PATH).
    `cubin` runs an already compiled cubin of the variant (built with `config`'s flags) instead.
    """
    if config is None:
        config = default_config(q.shape[-1] if q.dim() == 4 else -1, causal,
                                q.dtype == torch.bfloat16, q.shape[2] if q.dim() == 4 else 0,
                                variant=variant is not None)
    if config.causal != causal or config.bf16 != (q.dtype == torch.bfloat16):
        raise LaunchError(f"config {config} does not match causal={causal}, dtype={q.dtype}")
    if config.o_half_used and config.smem_bytes > SMEM_LIMIT:
        raise LaunchError(f"Fa3Config.o_half: its 64-row O stage does not fit beside {config.block_m} x "
                          f"{config.block_n} tiles at D {config.head_dim} ({config.smem_bytes} > {SMEM_LIMIT} bytes)",
                          hint="o_half is for D 128 128 x 176; leave it off here")
    if config.tail_split and config.head_dim == 256:
        # (two more ints in Problem spill 92 bytes in D 256's 24-register producer, nvcc 13.0)
        raise LaunchError("Fa3Config.tail_split is for head dims 64 and 128", hint="leave tail_split off at D 256")
    if not 0 <= config.exp2_emu <= 7:
        raise LaunchError(f"Fa3Config.exp2_emu={config.exp2_emu}: the polynomial exp2 takes m of every 8 column groups, "
                          "m in 1..7", hint="0 (off) is the default")
    check_inputs(q, k, v, config)
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty_like(q)   # q's memory order: a [B, N, H, D] caller gets [B, N, H, D] memory back
    if lse is None:
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    if (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.data_ptr() % 16
            or map_refusal(tuple(out.shape), out.stride(), out.element_size())):
        raise LaunchError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}, 16-byte "
                          f"aligned, D contiguous and its other strides 16-byte multiples (got strides "
                          f"{out.stride()})", hint="leave out=None: it is allocated in q's memory order")
    if lse.shape != (b, hq, nq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise LaunchError(f"lse must be a contiguous float32 tensor of shape {(b, hq, nq)}")
    if b * hq * nq == 0:
        return out, lse
    if nk == 0:   # no key at all: every row attends nothing (a tensor map cannot have an empty dim)
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise LaunchError(f"softmax_scale={softmax_scale!r} is not a positive finite number",
                          hint="the kernel takes row maxima of unscaled scores, which needs scale > 0; "
                               "the default is 1/sqrt(D)")
    func, counts_func = _function(config, q.device, variant.source if variant is not None else None, compiler,
                                  cubin)
    tiles, sms = math.ceil(nq / config.block_m) * hq * b, sm_count(q.device.index)
    ctas = min(tiles, sms) if config.persistent else tiles
    grid = (min(ctas, max_ctas) if max_ctas else ctas, 1, 1)
    # concurrent CTAs: the grid, or (one tile per CTA) as many as fit, one per SM
    order = (tile_order(counts_func, config, variant, q.device, b, hq, hkv, nq, nk, min(grid[0], sms))
             if variant is not None else None)
    maps = [tensor_map(q, config.block_m), tensor_map(k, config.block_n),
            tensor_map(v, config.block_n), tensor_map(out, WG_ROWS)]
    stream = torch.cuda.current_stream(q.device).cuda_stream
    counter = launch_counter(q.device, stream, config)
    scalars = [ctypes.c_uint64(lse.data_ptr()), ctypes.c_uint64(counter.data_ptr()),
               ctypes.c_uint64(order.data_ptr() if order is not None else 0),
               ctypes.c_int32(nq), ctypes.c_int32(nk),
               ctypes.c_int32(hq), ctypes.c_int32(hkv), ctypes.c_int32(b), ctypes.c_float(scale),
               variant.args if variant is not None else ctypes.c_int32(0)]   # VariantArgs
    driver().launch(func, grid, (config.threads, 1, 1), config.smem_bytes, stream,
                    pack_params(maps + scalars))
    return out, lse


def lpt_order(counts: torch.Tensor, ctas: int, shift: int = 0) -> torch.Tensor:
    """Work-tile order for the dynamic scheduler from counts [BH, num_m] (KV tiles per tile) and
    the number of CTAs. An outlier tile (over twice the mean, and over an eighth of a CTA's fair
    share of the work) stretches the tail if it starts late (global_sliding_window's first query
    tile sees every key): those go first, longest first. The rest keep the default order, head by
    head (the tiles running at the same time then share K/V in L2), longest first inside a head;
    ordering them all longest-first cost prefixlm 11% at 8k (L2 traffic). Entry t of the result is
    bh * num_m + m_block.

    shift > 0 (CUBRIDGE_LPT_SECTIONS, runtime.lpt.section_shift): the rest go in sections of 2^shift
    consecutive heads instead (the dense kernel's TILE_SECTIONS), longest first inside a section, the
    section's heads minor (ties: the later query block first, then the lower head); shift 0 is the
    head-by-head order above, bit for bit.

    >>> lpt_order(torch.tensor([[1, 2, 3], [9, 1, 1]]), ctas=4).tolist()   # 9 > 2 * 17 / 6
    [3, 2, 1, 0, 5, 4]
    >>> lpt_order(torch.tensor([[1, 2, 3], [3, 2, 1]]), ctas=2).tolist()   # none is an outlier
    [2, 1, 0, 3, 4, 5]
    >>> lpt_order(torch.tensor([[1, 2, 3], [3, 2, 1]]), ctas=2, shift=1).tolist()   # one section of 2 heads
    [2, 3, 1, 4, 5, 0]
    >>> lpt_order(torch.tensor([[1, 2], [1, 2], [1, 2]]), ctas=2, shift=1).tolist()   # the last section short
    [1, 3, 0, 2, 5, 4]
    """
    bh, num_m = counts.shape
    if not 0 <= shift <= 24:
        raise LaunchError(f"lpt_order: shift {shift} is outside 0..24 (sections of 2^shift heads)",
                          hint="runtime.lpt.section_shift gives it, capped at the heads there are")
    c = counts.to(torch.int64).clamp(min=0, max=(1 << 16) - 1)
    total = c.sum()
    long = (c * c.numel() > 2 * total) & (8 * c * max(1, ctas) > total)
    heads = torch.arange(bh, device=c.device).view(-1, 1).expand(bh, num_m)
    ms = torch.arange(num_m, device=c.device).view(1, -1).expand(bh, num_m)
    rank = (1 << 16) - 1 - c                      # longer first
    # the rest: [section | rank 16 bits | later block first 20 bits | head in section `shift` bits]
    rest = ((heads >> shift) << (36 + shift)) | (rank << (20 + shift)) | ((num_m - 1 - ms) << shift)
    rest = rest | (heads & ((1 << shift) - 1)) if shift else rest
    key = torch.where(long, (rank << 40) | (heads << 20) | ms, (1 << 60) | rest)
    return torch.argsort(key.reshape(-1), stable=True).to(torch.int32)


def tile_order(counts_func, config: Fa3Config, variant, device, b, hq, hkv, nq, nk, ctas,
               scratch: dict | None = None) -> torch.Tensor:
    """The longest-first tile order of a lowered variant at one shape: its kv_range counted on the
    GPU by the kernel's own fa3_sm90_tile_counts, ordered by lpt_order (in L2 sections of heads where
    the variant's launch was packed with CUBRIDGE_LPT_SECTIONS=1: Launchable.lpt_sections); cached on the variant. A
    per-call variant (runtime inputs) orders on the GPU (runtime.lpt: the same order, ~10x fewer
    host calls), since it pays this on every call; its buffers come from `scratch` when given
    (driver.scratch_tensor)."""
    shift = section_shift(nk, config.head_dim, b * hq) if getattr(variant, "lpt_sections", False) else 0
    key = (config.block_m, config.block_n, b, hq, hkv, nq, nk, device.index, ctas, shift)
    cache = variant.tile_orders
    if key not in cache:
        num_m = math.ceil(nq / config.block_m)
        counts = scratch_tensor(scratch, "tile_counts", (b * hq * num_m,), torch.int32, device)
        params = [ctypes.c_uint64(counts.data_ptr()), ctypes.c_int32(nq), ctypes.c_int32(nk), ctypes.c_int32(hq),
                  ctypes.c_int32(hkv), ctypes.c_int32(b), variant.args]
        threads = 128
        stream = current_stream(device.index)
        driver().launch(counts_func, (math.ceil(counts.numel() / threads), 1, 1), (threads, 1, 1), 0,
                        stream, pack_params(params))
        if variant.per_call:
            from cubridge.runtime.lpt import gpu_lpt_order
            cache[key] = gpu_lpt_order(counts, num_m, ctas, stream, scratch, shift)
        else:
            cache[key] = lpt_order(counts.view(b * hq, num_m), ctas, shift)
    return cache[key]
