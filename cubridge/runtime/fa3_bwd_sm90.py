"""Build and launch the Hopper backward ref_kernels/fa3_bwd_sm90/kernel.cu from PyTorch.

Three launches on the current stream: a preprocess (Dvec = rowsum(dO * O), zeroes the fp32 dQ
accumulator), fa3_bwd_sm90 (dK, dV, dQ added into the accumulator), a convert (dQ = accumulator *
scale). The preprocess is the portable backward's fa2_bwd_preprocess (ref_kernels/fa2_bwd_sm80),
with LSE_SMEM after a few torch ops that make padded LSE / Dvec copies, or with LEAN kernel.cu's
own fa3_bwd_preprocess, which writes those copies itself; the convert is fa3_bwd_dq_convert_tiled
(DQ_MODE 1) or fa2_bwd_dq_convert. The main kernel reads Q, K, V, dO through TMA, so it is launched
through the driver API with four CUtensorMap descriptors, as cubridge.runtime.fa3_sm90 launches the
forward.

Options (compile-time, `option=` of fa3_backward): OPTIONS, derived from each name's suffixes (SUFFIX_MODES);
params.cuh says what each macro does, NOTES.md ("Options table") what each option measured. DEFAULT_OPTION (full
attention), CAUSAL_OPTION (causal: the same body in TILE_ORDER 2's order) and VARIANT_OPTION (lowered variants) are
what fa3_backward runs when no option is named (default_option / variant_option).

Two switches orthogonal to the options (session 14, off by default; NOTES.md "Session 14"): GQA_SPLIT
(cubridge.runtime.fa3_bwd_gqa: a GQA group's query heads over s CTAs, fp32 dK / dV partials summed in
order) and BNHD (cubridge.runtime.fa3_bwd_layout: the caller's [B, N, H, D] memory read and written in
place through 4-D TMA maps); fa3_backward's gqa_split= / layout= or CUBRIDGE_BWD_GQA_SPLIT / CUBRIDGE_BWD_BNHD.

Status: every option passed tests/gpu/test_bwd_sm90.py on an H100 (446 cases, session 9), so
cubridge.runtime.autograd routes sm_90 backwards here by default (atomic dQ mode);
CUBRIDGE_HOPPER_BWD=0 sends them to the portable backward instead.

Example (on an sm_90 GPU):
    >>> out, lse = fa3_forward(q, k, v, causal=True)                                  # doctest: +SKIP
    >>> dq, dk, dv = fa3_backward(dout, q, k, v, out, lse, causal=True)              # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
from typing import NamedTuple

import torch

from cubridge.errors import LaunchError, env_switch
from cubridge.paths import REF_KERNELS_DIR
from cubridge.runtime import fa3_bwd_gqa as gqa
from cubridge.runtime import fa3_bwd_layout as lay
from cubridge.runtime.build import compile_cubin, default_compiler
from cubridge.runtime.driver import capability, current_stream, driver, pack_params
from cubridge.runtime.fa3_sm90 import tensor_map as map_4d

KERNEL_DIR = REF_KERNELS_DIR / "fa3_bwd_sm90"
KERNEL_SOURCE = KERNEL_DIR / "kernel.cu"
FWD_DIR = REF_KERNELS_DIR / "fa3_sm90"   # the PTX helpers it includes (-I: part of the cache key)
ENTRY = b"fa3_bwd_sm90"
CONVERT_ENTRY = b"fa3_bwd_dq_convert_tiled"
# kernel.cu DQ_CONVERT 2 (session 15, vbwd15): the same dQ, staged through shared memory as FA4's postprocess
# (one CTA per 64 x 64 part, 16-byte row stores; contiguous dq, BNHD keeps the tiled). STAGED_CONVERT_ENV=1 / 0 for
# every backward; unset, STAGED_VARIANT_DEFAULT for variant backwards and the tiled convert for the dense ones. On for
# variants since session 16 (H100, x over the tiled convert, same run, bf16 D 128, 16k tokens: session 15 mid
# 1.003-1.028x on 11 rows, session 16 mid prefixlm 1k 1.020, 4k 1.006, share_question 4k 1.010; its rule cases and
# the bitwise test against the tiled convert passed in session 15's final call).
STAGED_CONVERT_ENTRY = b"fa3_bwd_dq_convert_staged"
STAGED_CONVERT_ENV = "CUBRIDGE_BWD_STAGED_CONVERT"
M80_CONVERT_ENTRY = b"fa3_bwd_dq_convert_m80"   # TILE_M80's accumulator (dQ^T parts): tile_m80.cuh
STAGED_VARIANT_DEFAULT = "1"
PREP_ENTRY = b"fa3_bwd_preprocess"
# kernel.cu DQ_FUSE (session 16, vbwd16; off): the dQ convert fused into the main kernel (dq_store.cuh). A count launch
# (dq_fuse.cuh) before the preprocess; the CTA whose step completes a query tile converts it and zeroes its
# accumulator lines, so the accumulator and the counters are kept per shape and stream (_fuse_buffers) and stay zero
# between calls; no zeroing in the preprocess, no convert launch. On with FUSED_CONVERT_ENV=1 for the DQ_WRITER + LEAN
# options (not PERSIST) on contiguous dq (BNHD keeps the convert launch).
COUNT_ENTRY = b"fa3_bwd_dq_count"
FUSED_CONVERT_ENV = "CUBRIDGE_BWD_FUSED_CONVERT"
COUNT_THREADS = 32
ENABLE_ENV = "CUBRIDGE_HOPPER_BWD"


class Modes(NamedTuple):
    """An option's compile-time macros (params.cuh says what each does). SCHED 1 / 2 require
    DQ_MODE 1, LSE_SMEM 1 requires SCHED 1 / 2, TILE_ORDER is 0 or 2, LEAN 1 and ISSUE 1 require LSE_SMEM 1
    (static_asserts there). LEAN also changes the launches around the kernel (fa3_backward)."""
    dq_mode: int
    sched: int
    lse_smem: int
    tile_order: int
    arrive_all: int = 0
    lean: int = 0
    issue: int = 0
    epilogue: int = 0
    carry: int = 0
    dv_late: int = 0
    dq_writer: int = 0
    rows_early: int = 0
    m_rotate: int = 0
    persist: int = 0
    tile_m80: int = 0   # session 16 (params.cuh TILE_M80): 80-row query tiles, full attention at D = 128 only
    desc64: int = 0     # session 16 (params.cuh DESC64): wgmma descriptors by one 64-bit add (fewer uniform moves)


# Fields added since session 16 are left out of the nvcc flags while 0 (the kernel's default): the older options'
# compile keys stay as they were.
NEW_FIELDS = ("tile_m80", "desc64")


# Each option's macros follow from its name: the first token sets DQ_MODE ("base" 0, "bulk" 1), each later "_token"
# adds its fields below (in order; "pf32" right after "issue" makes ISSUE 2). What each option measured, session by
# session, is in NOTES.md ("Options table"); params.cuh says what each macro does.
SUFFIX_MODES = {"overlap": {"sched": 1}, "dqfirst": {"sched": 2}, "lse": {"lse_smem": 1}, "arriveall": {"arrive_all": 1},
                "lean": {"arrive_all": 1, "lean": 1}, "issue": {"issue": 1}, "pf32": {"issue": 2},
                "epi": {"epilogue": 1}, "carry": {"carry": 1}, "dvlate": {"dv_late": 1}, "dqw": {"dq_writer": 1},
                "early": {"rows_early": 2}, "rot": {"m_rotate": 1}, "rot2": {"m_rotate": 2}, "desc": {"m_rotate": 3},
                "l2lpt": {"tile_order": 2}, "l2lpt3": {"tile_order": 3}, "grid1": {"tile_order": 4}, "zsec": {"tile_order": 5},
                "persist": {"persist": 1}, "m80": {"tile_m80": 1},
                "u64": {"desc64": 1}}
_PF32 = "bulk_overlap_lse_lean_issue_pf32_epi"
_EARLY = _PF32 + "_dqw_early"
OPTION_NAMES = (
    "base", "bulk", "bulk_overlap", "bulk_overlap_lse", "bulk_overlap_lse_arriveall", "bulk_overlap_lse_lean",
    "bulk_overlap_lse_lean_issue", "bulk_dqfirst_lse_lean_issue", "bulk_overlap_lse_lean_issue_epi", _PF32,
    _PF32 + "_carry", _PF32 + "_carry_dvlate", _PF32 + "_dqw", _EARLY, _EARLY + "_carry", _EARLY + "_rot",
    _EARLY.replace("overlap", "dqfirst"), _EARLY.replace("overlap", "dqfirst") + "_l2lpt", _EARLY + "_rot2",
    _EARLY + "_l2lpt", "bulk_overlap_lse_l2lpt", "bulk_dqfirst_lse", "bulk_overlap_lse_lean_l2lpt", _PF32 + "_l2lpt",
    "bulk_dqfirst_lse_l2lpt", _PF32 + "_l2lpt_persist", "bulk_overlap_lse_lean_issue_epi_dqw_early",
    "bulk_overlap_lse_lean_issue_epi_dqw_early_m80",
    _EARLY + "_u64", _EARLY + "_l2lpt_u64", "bulk_overlap_lse_lean_issue_epi_dqw_early_m80_u64",
    # session 17 (bwd17; params.cuh M_ROTATE 3): the causal sweep descending (the last query tile first), on
    # CAUSAL_OPTION's order and on TILE_ORDER 0's (FA4's)
    _EARLY + "_l2lpt_desc", _EARLY + "_desc",
    # session 17 (bwd17; params.cuh TILE_ORDER 3): CAUSAL_OPTION's order over TILE_ORDER 0's 3-D grid (a probe of the
    # TILE_ORDER 2 build's 5% loss at full attention, same order), and the mirror: TILE_ORDER 0's tiles from a 1-D grid
    _EARLY + "_l2lpt3", _EARLY + "_grid1",
    # session 17 (bwdc17; params.cuh TILE_ORDER 5): CAUSAL_OPTION's order from a 3-D grid without a division (the
    # coordinates S2R reads, as TILE_ORDER 0's)
    _EARLY + "_zsec")


def option_modes(name: str) -> "Modes":
    """The Modes an option name spells (SUFFIX_MODES).

    >>> option_modes("bulk_overlap_lse_lean_issue_pf32_epi")._asdict() == dict(
    ...     Modes(1, 1, 1, 0)._asdict(), arrive_all=1, lean=1, issue=2, epilogue=1)
    True
    """
    first, *rest = name.split("_")
    if first not in ("base", "bulk") or (first == "base" and rest):
        raise ValueError(f"option {name!r} does not start with 'base' or 'bulk_'")
    fields = {"dq_mode": int(first == "bulk")}
    for token in rest:
        if token not in SUFFIX_MODES:
            raise ValueError(f"option {name!r}: unknown suffix {token!r} (one of {sorted(SUFFIX_MODES)})")
        fields.update(SUFFIX_MODES[token])
    return Modes(**{"sched": 0, "lse_smem": 0, "tile_order": 0, **fields})


OPTIONS = {name: option_modes(name) for name in OPTION_NAMES}
M80_OPTIONS = tuple(name for name, m in OPTIONS.items() if m.tile_m80)
# PERSIST (session 14, ref_kernels/fa3_bwd_sm90/persist.cuh): min(tiles, SMs) CTAs take the tiles of TILE_ORDER 2's
# order from a queue, the next tile's scan and loads under the current one's last step and epilogue. Its
# scheduler scans query runs (a lowered variant's q_range), so it builds for variants only. Off: session 14 mid
# call (H100; rule tests and racecheck passed) 0.943-1.026x the default over six specs at 8k / 1k.
VARIANT_ONLY_OPTIONS = ("bulk_overlap_lse_lean_issue_pf32_epi_l2lpt_persist",)
# each one's body without the queue: what a spec lowered to the dense reference itself (no runs to queue) runs
QUEUELESS = {"bulk_overlap_lse_lean_issue_pf32_epi_l2lpt_persist": "bulk_overlap_lse_lean_issue_pf32_epi_l2lpt"}
DEFAULT_OPTION = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early"   # fastest of OPTIONS on an H100, tested (docstring)
# Causal attention runs that body in TILE_ORDER 2's order since session 15 (NOTES.md "Options table").
CAUSAL_OPTION = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt"


# Full attention's option (session 16: a hook for adopting a full-attention-only option such as TILE_M80's; a causal
# or D 64 call of that runs default_option(causal) through resolve_option). DEFAULT_OPTION until an H100 A/B says so.
FULL_OPTION = DEFAULT_OPTION
# CUBRIDGE_BWD_FULL_OPTION names another of OPTIONS for full attention (full_option: the A/B and the GPU tests of a
# proposed flip through every caller, autograd and the op included); unset: FULL_OPTION.
FULL_OPTION_ENV = "CUBRIDGE_BWD_FULL_OPTION"


def full_option() -> str:
    """Full attention's default option: FULL_OPTION_ENV if set (a dense option of OPTIONS), else FULL_OPTION."""
    value = os.environ.get(FULL_OPTION_ENV, "")
    if value and (value not in OPTIONS or value in VARIANT_ONLY_OPTIONS):
        raise LaunchError(f"{FULL_OPTION_ENV}={value!r} is not a dense option", where="environment",
                          hint=f"unset {FULL_OPTION_ENV} ({FULL_OPTION}) or set one of {sorted(OPTIONS)}")
    return value or FULL_OPTION


# CUBRIDGE_BWD_CAUSAL_OPTION (session 17) names another dense option for causal attention (causal_option: the A/B and
# the GPU tests of a proposed CAUSAL_OPTION flip through every caller); unset: CAUSAL_OPTION.
CAUSAL_OPTION_ENV = "CUBRIDGE_BWD_CAUSAL_OPTION"


def causal_option() -> str:
    """Causal attention's default option: CAUSAL_OPTION_ENV if set (a dense option of OPTIONS that builds causal: not
    TILE_M80's), else CAUSAL_OPTION."""
    value = os.environ.get(CAUSAL_OPTION_ENV, "")
    if value and (value not in OPTIONS or value in VARIANT_ONLY_OPTIONS or OPTIONS[value].tile_m80):
        raise LaunchError(f"{CAUSAL_OPTION_ENV}={value!r} is not a dense causal option", where="environment",
                          hint=f"unset {CAUSAL_OPTION_ENV} ({CAUSAL_OPTION}) or set one of "
                               f"{sorted(set(OPTIONS) - set(VARIANT_ONLY_OPTIONS) - set(M80_OPTIONS))}")
    return value or CAUSAL_OPTION


def default_option(causal: bool) -> str:
    """The option fa3_backward runs when none is named: causal_option() for causal attention, else full_option()."""
    return causal_option() if causal else full_option()


def resolve_option(option: str, head_dim: int, causal: bool) -> str:
    """The option a call builds and runs: a TILE_M80 option (M80_OPTIONS) where its 80-row tile applies (full
    attention, D = 128), default_option(causal) elsewhere; any other option as it is.

    >>> resolve_option("bulk_overlap_lse_lean_issue_epi_dqw_early_m80", 64, False) == DEFAULT_OPTION
    True
    """
    if _modes(option).tile_m80 and (causal or head_dim != 128):
        return CAUSAL_OPTION if causal else DEFAULT_OPTION   # (not default_option: FULL_OPTION may be this option)
    return option


def block_m(option: str) -> int:
    """Query rows per step of `option`'s kernel: 80 with TILE_M80, else BLOCK_M."""
    return 80 if _modes(option).tile_m80 else BLOCK_M
# A lowered variant (cubridge.lower.fa3_bwd_sm90) builds on one of these options only (params.cuh static_assert: its
# hooks sit in the SCHED 1 / LSE_SMEM 1 passes); VARIANT_OPTION by default. History: NOTES.md "Options table".
VARIANT_OPTIONS = ("bulk_overlap_lse", "bulk_overlap_lse_arriveall", "bulk_overlap_lse_lean",
                   "bulk_overlap_lse_lean_issue_pf32_epi", "bulk_overlap_lse_lean_issue_pf32_epi_carry",
                   "bulk_overlap_lse_lean_l2lpt", "bulk_overlap_lse_lean_issue_pf32_epi_l2lpt",
                   *VARIANT_ONLY_OPTIONS, "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt",
                   "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_u64")   # sig17: _u64 (DESC64) for the variants
# Session 17 (sig17): the _u64 twin (DESC64: 64-bit descriptor arithmetic, ~42 fewer instructions a step), measured
# with the lowering's ROWLESS / DS_FACTOR / SCAN_BITS defaults (cubridge/lower/fa3_bwd_sm90.py).
VARIANT_OPTION = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_u64"
# CUBRIDGE_BWD_VARIANT_OPTION names another of VARIANT_OPTIONS as the variant backwards' default (variant_option:
# A/B runs, the GPU rule tests of an opt-in option over every variant and shape); unset: VARIANT_OPTION.
VARIANT_OPTION_ENV = "CUBRIDGE_BWD_VARIANT_OPTION"
# CUBRIDGE_BWD_PERSIST_CTAS=N caps a PERSIST option's grid at N CTAs (default: the SM count), so that small
# test shapes run several tiles per CTA through the queue.
PERSIST_CTAS_ENV = "CUBRIDGE_BWD_PERSIST_CTAS"


def variant_option() -> str:
    """The variant backwards' default option: VARIANT_OPTION_ENV if set (one of VARIANT_OPTIONS), else VARIANT_OPTION."""
    value = os.environ.get(VARIANT_OPTION_ENV, "")
    if value and value not in VARIANT_OPTIONS:
        raise LaunchError(f"{VARIANT_OPTION_ENV}={value!r} is not a variant option", where="environment",
                          hint=f"unset {VARIANT_OPTION_ENV} ({VARIANT_OPTION}) or set one of {list(VARIANT_OPTIONS)}")
    return value or VARIANT_OPTION


def persist_ctas(device_index: int) -> int:
    """A PERSIST option's most CTAs: PERSIST_CTAS_ENV (a positive integer) or the device's SM count."""
    from cubridge.runtime.driver import sm_count
    value = os.environ.get(PERSIST_CTAS_ENV, "")
    if not value:
        return sm_count(device_index)
    if not value.isdigit() or int(value) < 1:
        raise LaunchError(f"{PERSIST_CTAS_ENV}={value!r} is not a positive integer", where="environment",
                          hint=f"unset {PERSIST_CTAS_ENV} (one CTA per SM) or set a CTA count such as 3")
    return int(value)

# Mirrored from params.cuh (checked there by static_assert against HOST_SMEM_BYTES).
BLOCK_N = 128            # keys per CTA
BLOCK_M = 64             # queries per step
STAGES = 2
DS_SLOTS = 2
THREADS = 384            # producer + two consumer warpgroups
ELEM_BYTES = 2
SMEM_ALIGN = 1024
HEAD_DIMS = (64, 128)
PRE_THREADS = 256        # fa2_bwd_preprocess / fa2_bwd_dq_convert block (fa2_bwd_sm80 kernel.cu)
CHUNK_ELEMS = 8
DQ_PART_BYTES = 64 * 64 * 4  # one consumer's 64 x 64 f32 dQ part (DQ_MODE 1)
DQ_SLOTS = 2
CONSUMERS = 2
CONVERT_THREADS = 256
STAGED_CONVERT_THREADS = 128   # DQ_CONVERT 2: one consumer warpgroup's worth per part
DQ_PART_FLOATS = DQ_PART_BYTES // 4
ROW_TERM_BYTES = BLOCK_M * 4   # one stage's LSE or Dvec (LSE_SMEM 1)
LOG2E = 1.4426950408889634


def _modes(option: str) -> Modes:
    if option not in OPTIONS:
        raise LaunchError(f"unknown option {option!r}", where="fa3_bwd_sm90",
                          hint=f"option must be one of {sorted(OPTIONS)}")
    return OPTIONS[option]


def smem_bytes(head_dim: int, option: str = DEFAULT_OPTION) -> int:
    """K, V, STAGES x (Q, dO), DS_SLOTS x dS^T, DQ_MODE 1's dQ slots, the barriers, alignment
    slack (params.cuh; TILE_M80: 80-row tiles, one dQ slot of 80 x 64 floats per consumer)."""
    bm = block_m(option)
    kv = BLOCK_N * head_dim * ELEM_BYTES
    q = bm * head_dim * ELEM_BYTES
    ds = BLOCK_N * bm * ELEM_BYTES
    modes = _modes(option)
    dq_mode, lse_smem = modes.dq_mode, modes.lse_smem
    dq = (1 * CONSUMERS * bm * 64 * 4 if modes.tile_m80 else DQ_SLOTS * CONSUMERS * DQ_PART_BYTES) if dq_mode == 1 else 0
    rows = 2 * STAGES * bm * 4 if lse_smem == 1 else 0
    barriers = 1 + 2 * STAGES + (3 if modes.persist else 0)   # PERSIST: kv_empty, sched_full, sched_empty
    return 2 * kv + 2 * STAGES * q + DS_SLOTS * ds + dq + rows + barriers * 8 + SMEM_ALIGN


def options(head_dim: int, causal: bool, bf16: bool, option: str = DEFAULT_OPTION, gqa_split: int = 1,
            bnhd: bool = False, staged_convert: bool = False, fuse: int = 0) -> list[str]:
    """nvcc / NVRTC options of one specialisation; gqa_split > 1 adds -DGQA_SPLIT (fa3_bwd_gqa) and bnhd
    -DBNHD=1 (fa3_bwd_layout); without them the macros (and the compile cache key) are as before both."""
    macros = [f"-D{name.upper()}={value}" for name, value in _modes(option)._asdict().items()
              if value or name not in NEW_FIELDS]
    split = ([f"-DGQA_SPLIT={gqa_split}"] if gqa_split > 1 else []) + (["-DBNHD=1"] if bnhd else [])
    split += ["-DDQ_CONVERT=2"] if staged_convert else []   # STAGED_CONVERT_ENV: the cache key changes only when on
    split += [f"-DDQ_FUSE={int(fuse)}"] if fuse else []      # FUSED_CONVERT_ENV (1 or 2), the same
    return ["-std=c++17", f"-DHEAD_DIM={head_dim}", f"-DIS_CAUSAL={int(causal)}", f"-DDTYPE_BF16={int(bf16)}",
            *macros, *split,
            f"-DHOST_SMEM_BYTES={smem_bytes(head_dim, option)}", f"-I{KERNEL_DIR}", f"-I{FWD_DIR}"]


def build_cubin(head_dim: int, causal: bool, bf16: bool, *, option: str = DEFAULT_OPTION,
                compiler: str | None = None, extra_options: tuple[str, ...] = (), cache_dir=None,
                source: str | None = None, gqa_split: int = 1, bnhd: bool = False, staged_convert: bool = False,
                fuse: int = 0):
    """The sm_90a cubin of one specialisation (a CompileResult: .cubin, .log) via the compile cache;
    `source`: a lowered variant's kernel.cu text (cubridge.lower.fa3_bwd_sm90) instead of the dense one;
    gqa_split: fa3_bwd_gqa's split (needs an EPILOGUE 1 option); bnhd: fa3_bwd_layout's BNHD build."""
    if head_dim not in HEAD_DIMS:
        raise LaunchError(f"head dim {head_dim} is not built", where="fa3_bwd_sm90",
                          hint=f"D must be one of {HEAD_DIMS}")
    option = resolve_option(option, head_dim, causal)
    if source is None and option in VARIANT_ONLY_OPTIONS:
        raise LaunchError(f"option {option!r} builds for a lowered variant only", where="fa3_bwd_sm90",
                          hint=f"pass a variant's source, or one of {sorted(set(OPTIONS) - set(VARIANT_ONLY_OPTIONS))}")
    if gqa_split > 1 and not _modes(option).epilogue:
        raise LaunchError(f"gqa_split={gqa_split} with option {option!r}", where="fa3_bwd_sm90",
                          hint="the split writes its partials in EPILOGUE 1's place: use an option ending in _epi "
                               "(the default) or gqa_split=1")
    if fuse and (not fuse_capable(_modes(option)) or bnhd):
        raise LaunchError(f"fuse=True with option {option!r}, bnhd={bnhd}", where="fa3_bwd_sm90",
                          hint="the fused dQ convert needs a DQ_WRITER + LEAN option (..._dqw...), not PERSIST or _m80, and "
                               "contiguous [B, H, N, D] dq (bnhd=False)")
    if source is not None and option not in VARIANT_OPTIONS:
        raise LaunchError(f"option {option!r} has no variant hooks", where="fa3_bwd_sm90",
                          hint=f"a lowered variant builds with option one of {list(VARIANT_OPTIONS)}")
    return compile_cubin(source if source is not None else KERNEL_SOURCE.read_text(), arch="sm_90a",
                         options=[*options(head_dim, causal, bf16, option, gqa_split, bnhd, staged_convert, fuse),
                                  *extra_options],
                         compiler=compiler or default_compiler(), cache_dir=cache_dir, name="kernel.cu")


def fused_convert_enabled() -> int:
    """FUSED_CONVERT_ENV: "1", the dQ convert fused into the main kernel (kernel.cu DQ_FUSE 1: completions counted per
    step) where the option can take it (fuse_capable); "2", DQ_FUSE 2 (counted once per CTA, after its loop; session
    16, not yet run on a GPU); "0" or unset, the separate convert launch. Returns the DQ_FUSE value."""
    value = os.environ.get(FUSED_CONVERT_ENV, "0")
    if value not in ("0", "1", "2"):
        raise LaunchError(f"{FUSED_CONVERT_ENV}={value!r} is not 0, 1 or 2", where="environment",
                          hint=f"unset {FUSED_CONVERT_ENV} (a convert launch), 1 (fused, per-step counts) or 2 "
                               "(fused, per-CTA counts)")
    return int(value)


def fuse_capable(modes: "Modes") -> bool:
    """Whether DQ_FUSE builds with these modes: the writer warp counts the completed adds (DQ_WRITER), LEAN's
    preprocess skips the zeroing, one CTA per KV tile (no PERSIST), the 64-row dQ tiles (not TILE_M80's
    transposed accumulator, which has its own convert)."""
    return bool(modes.dq_writer and modes.lean and not modes.persist and not modes.tile_m80)


# (device index, stream, accumulator floats, counters) -> (accumulator, counters), both all zero between calls
_FUSE_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
FUSE_CACHED_SHAPES = 4


def _fuse_buffers(device, stream: int, accum_floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DQ_FUSE's tiled accumulator and per-tile counters: zeroed once, then left zero by every call (the CTA that
    converts a tile zeroes its lines; the last step of a tile takes its counter back to 0). Kept per shape and stream
    (a call on another stream must not share them); inside CUDA graph capture a fresh zeroed pair belongs to the
    graph (its memset replays with it) and is not kept."""
    capturing = torch.cuda.is_current_stream_capturing()
    key = (device.index, stream, accum_floats, tiles)
    if not capturing and key in _FUSE_BUFFERS:
        return _FUSE_BUFFERS[key]
    bufs = (torch.zeros(accum_floats, device=device, dtype=torch.float32),
            torch.zeros(tiles, device=device, dtype=torch.int32))
    if not capturing:
        if len(_FUSE_BUFFERS) >= FUSE_CACHED_SHAPES:
            _FUSE_BUFFERS.pop(next(iter(_FUSE_BUFFERS)))   # the oldest
        _FUSE_BUFFERS[key] = bufs
    return bufs


def staged_convert_enabled(default: str = "0") -> bool:
    """STAGED_CONVERT_ENV: "1", DQ_MODE 1's dQ convert staged through shared memory (kernel.cu DQ_CONVERT 2); "0", the
    tiled convert; unset, `default` (fa3_backward: STAGED_VARIANT_DEFAULT for a variant, "0" for the dense kernel)."""
    return env_switch(STAGED_CONVERT_ENV, default, f"unset {STAGED_CONVERT_ENV} (the default), 0 (tiled dQ convert) "
                                                   "or 1 (staged)")


def enabled() -> bool:
    """Whether autograd may route sm_90 backwards here: yes unless CUBRIDGE_HOPPER_BWD=0 (the
    portable fa2_bwd_sm80 then, e.g. to compare the two)."""
    return env_switch(ENABLE_ENV, "1", f"unset {ENABLE_ENV} (the Hopper backward on sm_90) or set it to 0 (the portable one)")


_FUNCTIONS: dict[tuple, tuple[ctypes.c_void_p, ...]] = {}


def _functions(head_dim: int, causal: bool, bf16: bool, option: str, device: torch.device,
               compiler: str | None, source: str | None = None, gqa_split: int = 1, bnhd: bool = False,
               staged_convert: bool = False, fuse: int = 0):
    """(the backward kernel, the tiled dQ convert kernel[, LEAN's preprocess][, DQ_FUSE's count][, GQA_SPLIT's
    dK / dV sum, last]) of one specialisation (of `source`, a lowered variant, when given)."""
    key = (head_dim, causal, bf16, option, device.index, compiler, source, gqa_split, bnhd, staged_convert, fuse)
    if key not in _FUNCTIONS:
        cubin = build_cubin(head_dim, causal, bf16, option=option, compiler=compiler, source=source,
                            gqa_split=gqa_split, bnhd=bnhd, staged_convert=staged_convert, fuse=fuse).cubin
        convert = M80_CONVERT_ENTRY if _modes(option).tile_m80 else STAGED_CONVERT_ENTRY if staged_convert else CONVERT_ENTRY
        entries = (convert, PREP_ENTRY) if _modes(option).lean else (convert,)
        entries += (COUNT_ENTRY,) if fuse else ()
        entries += (gqa.SUM_ENTRY,) if gqa_split > 1 else ()
        with driver().primary_context(device.index):   # torch's context; no stream touched (graph capture)
            _FUNCTIONS[key] = driver().load_function(cubin, smem_bytes(head_dim, option), ENTRY, *entries)
    return _FUNCTIONS[key]


@functools.lru_cache(maxsize=None)
def _helpers():
    """The portable backward, whose preprocess / convert kernels run around this one."""
    from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
    return Fa2BwdSm80()


def _padded_lse(lse, bh: int, nq: int, num_m: int):
    """LSE_SMEM 1's LSE: a [B * Hq, num_m * 64] copy the producer bulk-loads one 256-byte tile at a
    time (16-byte aligned, never past the end), in log2 units with +inf where P must be 0 (padding
    rows, rows that saw no key: natural-log -inf). Needs only the forward's LSE, so it is queued
    before the preprocess kernel: less host work between that and the main launch."""
    lse2 = torch.full((bh, num_m * BLOCK_M), math.inf, device=lse.device, dtype=torch.float32)
    rows = lse.reshape(bh, nq)
    lse2[:, :nq] = torch.where(rows == -math.inf, math.inf, rows * LOG2E)
    return lse2


def _padded_dvec(dvec, bh: int, nq: int, num_m: int):
    """Dvec zero-padded to [B * Hq, num_m * 64], queued after the preprocess kernel that writes it.
    With Nq a multiple of 64, Dvec [B, Hq, Nq] already has this layout and fa3_backward passes it as
    it is (no zeroing or copy between the preprocess and the main launch)."""
    dvec_pad = torch.zeros((bh, num_m * BLOCK_M), device=dvec.device, dtype=torch.float32)
    dvec_pad[:, :nq] = dvec.reshape(bh, nq)
    return dvec_pad


def _padded_row_terms(lse, dvec, bh: int, nq: int, num_m: int):
    """LSE_SMEM 1's inputs: (_padded_lse, _padded_dvec)."""
    return _padded_lse(lse, bh, nq, num_m), _padded_dvec(dvec, bh, nq, num_m)


def _lean_prep(prep, out, dout, lse, bh: int, nq: int, num_m: int, d: int, stream: int, heads: int | None = None,
               bm: int = BLOCK_M, fuse=None):
    """LEAN 1: ((padded log2 LSE, padded Dvec), the zeroed tiled dQ accumulator) from one
    fa3_bwd_preprocess launch (kernel.cu), in place of fa2_bwd_preprocess and the torch ops of
    _padded_row_terms (5-7 small kernels, each a few us of host time while the GPU waits). heads: BNHD's
    Hq (out and dout [B, N, Hq, D] memory), None for contiguous [B, H, N, D]. bm: the rows per query tile
    (TILE_M80: 80). fuse: DQ_FUSE's (accumulator, counters, dq): the accumulator is already zero, the
    preprocess writes dq's unvisited tiles as zeros instead."""
    padded = bh * num_m * bm
    lse2 = torch.empty((bh, num_m * bm), device=out.device, dtype=torch.float32)
    dvec = torch.empty_like(lse2)
    accum = torch.empty(padded * d, device=out.device, dtype=torch.float32) if fuse is None else fuse[0]
    args = [ctypes.c_uint64(t.data_ptr()) for t in (out, dout, lse, lse2, dvec, accum)]
    args += [ctypes.c_int32(nq), ctypes.c_int32(num_m * bm), ctypes.c_int64(padded)]
    args += [ctypes.c_int32(heads)] if heads is not None else []
    args += [ctypes.c_uint64(t.data_ptr()) for t in fuse[1:]] if fuse is not None else []
    driver().launch(prep, (math.ceil(padded * (d // CHUNK_ELEMS) / PRE_THREADS), 1, 1), (PRE_THREADS, 1, 1), 0,
                    stream, pack_params(args))
    return (lse2, dvec), accum


def _classic_prep(out, dout, lse, shape, dq_mode: int, lse_smem: int, device, stream: int):
    """((LSE, Dvec) as the kernel reads them, the zeroed dQ accumulator): fa2_bwd_preprocess (Dvec,
    zeroes the accumulator's first Nq rows), with LSE_SMEM the padded copies (_padded_row_terms)."""
    from cubridge.runtime.launch import arg_i64, arg_ptr
    b, hq, nq, d = shape.batch, shape.heads_q, shape.len_q, shape.head_dim
    rows, num_m = b * hq * nq, math.ceil(nq / BLOCK_M)
    lse2 = _padded_lse(lse, b * hq, nq, num_m) if lse_smem == 1 else None
    dvec = torch.empty(b, hq, nq, device=device, dtype=torch.float32)
    # DQ_MODE 1: tiled [B * Hq, num_m, D / 64, 64 * 64] (fragment order, rows past Nq padding)
    accum_elems = b * hq * num_m * BLOCK_M * d if dq_mode == 1 else rows * d
    accum = torch.empty(accum_elems, device=device, dtype=torch.float32)
    _helpers().kernels(d, out.dtype, False, False, device)["fa2_bwd_preprocess"].launch(
        (math.ceil(rows * (d // CHUNK_ELEMS) / PRE_THREADS), 1, 1), (PRE_THREADS, 1, 1), 0,
        (arg_ptr(out), arg_ptr(dout), arg_ptr(dvec), arg_ptr(accum), arg_i64(rows)), stream)
    if accum_elems > rows * d:
        accum[rows * d:].zero_()
    if lse_smem == 1:
        return (lse2, dvec if nq % BLOCK_M == 0 else _padded_dvec(dvec, b * hq, nq, num_m)), accum
    return (lse, dvec), accum


def pair_bytes(group: int, len_q: int, head_dim: int) -> int:
    """tile_sections' L2 footprint of one (batch, kv head) pair: its group's Q, dO, fp32 dQ accumulator, LSE, Dvec."""
    return group * len_q * (2 * head_dim * ELEM_BYTES + head_dim * 4 + 2 * 4)


def tile_sections(pairs: int, group: int, len_q: int, head_dim: int, causal: bool, l2_bytes: int) -> int:
    """TILE_ORDER 2's section width: how many (batch, kv head) pairs run tile-major together. Each
    pair streams its group's Q, dO (16-bit), LSE, Dvec and reduces into its fp32 dQ accumulator:
    the largest power of two of pairs whose bytes fit in l2_bytes (FA4's SingleTileLPTBwdScheduler
    sizes its sections the same way), at least 1. Full attention gets 1 (= TILE_ORDER 0's order):
    its tiles are all equally long, so longest-first has nothing to gain and more heads in flight
    would only share L2 more.

    >>> tile_sections(64, 1, 8192, 128, True, 50 << 20), tile_sections(64, 1, 8192, 128, False, 50 << 20)
    (4, 1)
    """
    if not causal:
        return 1
    fit = max(1, l2_bytes // max(1, pair_bytes(group, len_q, head_dim)))
    return max(1, min(pairs, 1 << (fit.bit_length() - 1)))


def zsec_section(section: int, pairs: int) -> int:
    """TILE_ORDER 5's section: `section` halved until it divides the (batch, kv head) pairs (its grid's x).

    >>> zsec_section(4, 64), zsec_section(4, 6), zsec_section(8, 3)
    (4, 2, 1)
    """
    while section > 1 and pairs % section:
        section //= 2
    return max(1, section)


def _grid(option: str, tiles: int, heads_kv: int, batch: int, section: int = 1) -> tuple[int, int, int]:
    """TILE_ORDER 2 and 4 (0's tiles): one dimension; TILE_ORDER 0 and 3 (2's order, linearised): (tiles, Hkv, B);
    TILE_ORDER 5: (section, tiles, pairs / section), section dividing the pairs (zsec_section)."""
    if _modes(option).tile_order == 5:
        if (heads_kv * batch) % section:
            raise LaunchError(f"TILE_ORDER 5: section {section} does not divide {heads_kv * batch} pairs",
                              where="fa3_backward", hint="size it with zsec_section")
        return (section, tiles, heads_kv * batch // section)
    if _modes(option).tile_order in (2, 4):
        return (tiles * heads_kv * batch, 1, 1)
    return (tiles, heads_kv, batch)


def fa3_backward(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
                 dq=None, dk=None, dv=None, compiler: str | None = None, option: str | None = None,
                 variant=None, l2_bytes: int | None = None, gqa_split: int | str | None = None,
                 layout: str | None = None):
    """(dq [B, Hq, Nq, D], dk, dv [B, Hkv, Nk, D]) in q's dtype, from the forward's out and its
    natural-log lse [B, Hq, Nq] float32. causal: kv_idx <= q_idx = row + Nk - Nq (queries end-aligned,
    as the forward; with Nq > Nk the first Nq - Nk rows see no key and get dq = 0).
    option: one of OPTIONS (the kernel's compile-time performance options; None: default_option(causal)). variant: a
    cubridge.lower.Launchable of a source lowered by cubridge.lower.fa3_bwd_sm90 (its own mask:
    causal=False; option one of VARIANT_OPTIONS); its VariantArgs must stay alive until the kernel ran.
    l2_bytes: the L2 budget TILE_ORDER 2 sizes its head sections by (default the device's L2;
    tests pass small ones to exercise several sections). gqa_split: fa3_bwd_gqa's split of each GQA
    group over CTAs (None: CUBRIDGE_BWD_GQA_SPLIT, else fa3_bwd_gqa.default_split: 2 dense causal, 1
    otherwise; an option without EPILOGUE 1 runs unsplit unless the split is explicit, which it refuses). layout: "auto"
    (None), "bhnd" or "bnhd" (fa3_bwd_layout: the caller's [B, N, H, D] memory read and written in place;
    "auto" takes it (unless CUBRIDGE_BWD_BNHD=0) where dout and out are [B, N, H, D] memory)."""
    from cubridge.runtime.fa2_bwd_sm80 import check_backward_args, gradient_buffers
    option = default_option(bool(causal)) if option is None else option
    if variant is None and isinstance(q, torch.Tensor) and q.dim() == 4:   # a TILE_M80 option: full attention, D 128
        option = resolve_option(option, q.shape[-1], bool(causal))
    modes = _modes(option)
    bnhd = all(isinstance(t, torch.Tensor) for t in (dout, q, k, v, out)) and lay.choose(layout, modes, dout, q, k, v,
                                                                                          out)
    if variant is not None and (causal or option not in VARIANT_OPTIONS):
        raise LaunchError(f"a variant with causal={causal}, option={option!r}", where="fa3_backward",
                          hint="a lowered variant carries its own mask: pass causal=False and option one of "
                               f"{list(VARIANT_OPTIONS)}")
    shape, scale = check_backward_args(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, strided=bnhd)
    device = q.device
    if capability(device.index) != (9, 0):
        raise LaunchError(f"{torch.cuda.get_device_name(device)} is not sm_90", where="fa3_backward",
                          hint="this kernel needs a Hopper GPU (H100/H200); use Fa2BwdSm80 elsewhere")
    dq, dk, dv, done = gradient_buffers(shape, q, k, v, dq, dk, dv)   # fresh ones like q, k, v (empty_like)
    if done:
        return dq, dk, dv
    wanted = (dq, dk, dv)
    if bnhd:   # where the kernel writes: the caller's buffers if [B, N, H, D] memory, else temporaries
        dout, q, k, v, out = (lay.aligned(t) for t in (dout, q, k, v, out))
        dq, dk, dv = (lay.target(t) for t in wanted)
    b, hq, hkv, nq, nk, d = (shape.batch, shape.heads_q, shape.heads_kv, shape.len_q, shape.len_k,
                             shape.head_dim)
    bf16 = q.dtype == torch.bfloat16
    split = gqa.effective(gqa.requested(gqa_split, gqa.default_split(bool(causal), variant is not None)), hq // hkv)
    if split > 1 and not modes.epilogue and gqa_split is None:
        split = 1   # the environment's / default split applies to the options that can take it
    # contiguous dq of < 2^31 elements (the converters' 32-bit offsets); BNHD keeps the convert launch
    fuse = fused_convert_enabled() if fuse_capable(modes) and not bnhd and dq.numel() < 2 ** 31 else 0
    staged = modes.dq_mode == 1 and not bnhd and not modes.tile_m80 and not fuse and staged_convert_enabled(
        STAGED_VARIANT_DEFAULT if variant is not None else "0")
    funcs = _functions(d, bool(causal), bf16, option, device, compiler,
                       variant.source if variant is not None else None, split, bnhd, staged, fuse)
    func, convert = funcs[:2]
    stream = current_stream(device.index)
    bm = block_m(option)
    num_m = math.ceil(nq / bm)
    tiles = math.ceil(nk / BLOCK_N)
    va = variant.args if variant is not None else ctypes.c_int32(0)   # VariantArgs
    fused = None
    if fuse:   # the count launch first (dq_fuse.cuh): the preprocess reads the counts
        fused = (*_fuse_buffers(device, stream, b * hq * num_m * BLOCK_M * d, b * hq * num_m), dq)
        # GQA_SPLIT's virtual kv heads (Hkv * s of G / s query heads each), as the main kernel sees them
        args = [va, ctypes.c_uint64(fused[1].data_ptr())] + [ctypes.c_int32(x) for x in
                                                              (nq, nk, hq, hkv * split, hq // hkv // split)]
        driver().launch(funcs[3], (tiles * hkv * split * b, 1, 1), (COUNT_THREADS, 1, 1), 0, stream, pack_params(args))
    if modes.lean:
        row_terms, accum = _lean_prep(funcs[2], out, dout, lse, b * hq, nq, num_m, d, stream, hq if bnhd else None,
                                      bm, fused)
    else:
        row_terms, accum = _classic_prep(out, dout, lse, shape, modes.dq_mode, modes.lse_smem, device, stream)
    tm = map_4d if bnhd else driver().tensor_map   # BNHD: (D, N, H, B) maps of the tensors' own strides
    maps = [tm(q, bm), tm(k, BLOCK_N), tm(v, BLOCK_N), tm(dout, bm)]
    # GQA_SPLIT: the kernel sees Hkv * s virtual kv heads of G / s query heads and writes fp32 partials
    parts = gqa.partials(b, hkv, split, nk, d, device) if split > 1 else (dk, dv)
    scalars = [ctypes.c_uint64(t.data_ptr()) for t in (*row_terms, accum, *parts)]
    section = 1
    if modes.tile_order in (2, 3, 5):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if l2_bytes is None else l2_bytes
        # a variant's tiles are uneven like causal's (VARIANT_OPTIONS): sections sized the same way
        section = tile_sections(b * hkv * split, hq // hkv // split, nq, d, bool(causal) or variant is not None, l2)
        if modes.tile_order == 5:
            section = zsec_section(section, b * hkv * split)
    scalars += [ctypes.c_int32(x) for x in (nq, nk, hq, hkv * split, hq // hkv // split)] + [ctypes.c_float(scale)]
    scalars += [ctypes.c_int32(section)]   # l2_section
    scalars.append(va)
    grid = _grid(option, tiles, hkv * split, b, section)
    if modes.persist:   # persist.cuh: one CTA per SM at most, the rest of the tiles from a zeroed queue counter
        queue = torch.zeros(1, dtype=torch.int32, device=device)
        scalars += [ctypes.c_uint64(queue.data_ptr()), ctypes.c_int32(grid[0])]
        grid = (min(grid[0], persist_ctas(device.index)), 1, 1)
    if fused is not None:   # DQ_FUSE: the counters and the 16-bit dQ the CTAs convert into
        scalars += [ctypes.c_uint64(t.data_ptr()) for t in fused[1:]]
    driver().launch(func, grid, (THREADS, 1, 1), smem_bytes(d, option), stream, pack_params(maps + scalars))
    if split > 1:
        gqa.launch_sum(funcs[-1], *parts, dk, dv, hkv, scale, stream)
    if fused is not None:
        pass   # dQ is written by the main kernel
    elif modes.tile_m80:
        _convert_m80(convert, accum, dq, shape, scale, stream, hq if bnhd else None)
    elif staged:
        _convert_staged(convert, accum, dq, shape, scale, stream)
    else:
        _convert(convert if modes.dq_mode == 1 else None, accum, dq, shape, scale, stream, hq if bnhd else None)
    if bnhd:
        lay.finish(zip((dq, dk, dv), wanted))
    return wanted


def _convert_m80(func, accum, dq, shape, scale: float, stream: int, heads: int | None = None) -> None:
    """dQ = accumulator * scale in 16 bit by fa3_bwd_dq_convert_m80 (tile_m80.cuh): one CTA of 128 threads per
    80 x 64 part of TILE_M80's accumulator (dQ^T fragments); heads: BNHD's Hq (dq [B, N, Hq, D] memory)."""
    part = 80 * 64
    args = [ctypes.c_uint64(accum.data_ptr()), ctypes.c_uint64(dq.data_ptr()), ctypes.c_int32(shape.len_q),
            ctypes.c_int32(math.ceil(shape.len_q / 80)), ctypes.c_float(scale)]
    args += [ctypes.c_int32(heads)] if heads is not None else []
    driver().launch(func, (accum.numel() // part, 1, 1), (STAGED_CONVERT_THREADS, 1, 1), 0, stream, pack_params(args))


def _convert_staged(staged, accum, dq, shape, scale: float, stream: int) -> None:
    """dQ = accumulator * scale in 16 bit by fa3_bwd_dq_convert_staged (kernel.cu DQ_CONVERT 2): one CTA of 128
    threads per 64 x 64 part of the tiled accumulator."""
    args = [ctypes.c_uint64(accum.data_ptr()), ctypes.c_uint64(dq.data_ptr()), ctypes.c_int32(shape.len_q),
            ctypes.c_int32(math.ceil(shape.len_q / BLOCK_M)), ctypes.c_float(scale)]
    driver().launch(staged, (accum.numel() // DQ_PART_FLOATS, 1, 1), (STAGED_CONVERT_THREADS, 1, 1), 0, stream,
                    pack_params(args))


def _convert(tiled, accum, dq, shape, scale: float, stream: int, heads: int | None = None) -> None:
    """dQ = accumulator * scale in 16 bit: fa3_bwd_dq_convert_tiled (`tiled`, DQ_MODE 1's tiled
    accumulator; heads: BNHD's Hq, dq [B, N, Hq, D] memory) or fa2_bwd_dq_convert (the row-major one of
    DQ_MODE 0)."""
    from cubridge.runtime.launch import arg_f32, arg_i64, arg_ptr
    if tiled is not None:
        chunks = accum.numel() // 4
        args = [ctypes.c_uint64(accum.data_ptr()), ctypes.c_uint64(dq.data_ptr()), ctypes.c_int32(shape.len_q),
                ctypes.c_int32(math.ceil(shape.len_q / BLOCK_M)), ctypes.c_int64(chunks), ctypes.c_float(scale)]
        args += [ctypes.c_int32(heads)] if heads is not None else []
        driver().launch(tiled, (math.ceil(chunks / CONVERT_THREADS), 1, 1), (CONVERT_THREADS, 1, 1), 0,
                        stream, pack_params(args))
        return
    chunks = accum.numel() // CHUNK_ELEMS
    kernel = _helpers().kernels(shape.head_dim, dq.dtype, False, False, accum.device)["fa2_bwd_dq_convert"]
    kernel.launch((math.ceil(chunks / PRE_THREADS), 1, 1), (PRE_THREADS, 1, 1), 0,
                  (arg_ptr(accum), arg_ptr(dq), arg_i64(chunks), arg_f32(scale)), stream)
