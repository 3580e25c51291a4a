"""Python face of ref_kernels/fa2_sm80/kernel.cu: config, build, checked launch.

Example (GPU):
    >>> import torch
    >>> from cubridge.runtime.fa2_sm80 import Fa2Sm80, Config
    >>> q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
    >>> k = v = torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> out, lse = Fa2Sm80(Config(block_m=128, block_n=64))(q, k, v, causal=True)   # doctest: +SKIP
"""
from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cubridge.errors import LaunchError
from cubridge.paths import REF_KERNELS_DIR
from cubridge.runtime.build import CompileResult, compile_cubin
from cubridge.runtime.launch import (AttnShape, LoadedKernel, arg_f32, arg_i32, arg_ptr,
                                     check_attention_args, device_arch)

KERNEL_PATH = REF_KERNELS_DIR / "fa2_sm80" / "kernel.cu"
ENTRY = "fa2_sm80_fwd"
HEAD_DIMS = (64, 128)
DTYPE_MACRO = {torch.float16: 0, torch.bfloat16: 1}   # -DIS_BF16
ELEM_BYTES = 2
WARP_SIZE = 32
MMA_M = 16                  # rows of one mma.sync tile: a warp owns a multiple of these
KV_STEP = 16                # K tiles are read as n16 pairs, V tiles as k16 steps
SWIZZLE_ROWS = 8            # one pass of the CTA's 16-byte copies must keep the swizzle phase
CHUNK_ELEMS = 8             # 16-byte copy = 8 elements
# fp32 accumulator registers per thread (O + S) above which ptxas spills heavily: 192 (128x64, 4 warps,
# D=128) spills ~100 bytes; 256 (256x32, 4 warps) does not fit in 255 registers at all.
MAX_ACC_REGS = 192
# Per-block opt-in shared memory by compute capability (CUDA programming guide, "Compute
# Capabilities"); the device's own value is used when a device is at hand.
SMEM_OPTIN = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448}
SMEM_OPTIN_SM90 = SMEM_OPTIN[(9, 0)]
_CONFIG_RE = re.compile(r"(\d+)x(\d+)s(\d+)w(\d+)(f?)")


@dataclass(frozen=True)
class Config:
    """Compile-time tiling of the kernel; the tuner enumerates these.

    block_m: query rows per CTA; block_n: key rows per KV tile; stages: K/V ring depth;
    warps: warps per CTA (each owns block_m / warps query rows)."""
    block_m: int = 128
    block_n: int = 64
    stages: int = 2
    warps: int = 4
    # spill_free: S, P and the softmax of a KV tile in two column blocks (kernel.cu KV_SPLIT=2) and Q K^T's k-steps
    # rolled (QK_ROLLED=1): 0 spilled bytes at D 128 for the reference and every built-in variant (session 13,
    # experiments/fa2_spills.py), where the default tile spills 40-104 bytes. Off by default: on an H100 (sm_80 build)
    # it measured 0.83-0.87x the spilling default (session 13 mid, session13_h100/mid/M2/fa2_spills_ab.json); in the
    # tuner's space at D 128 (label suffix "f"), so a GPU where spills cost more (an A100) can pick it.
    spill_free: bool = False

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}s{self.stages}w{self.warps}" + "f" * self.spill_free

    @staticmethod
    def parse(text: str) -> "Config":
        """Inverse of str(): Config.parse("128x64s2w4") == Config(128, 64, 2, 4); a trailing "f" is spill_free."""
        m = _CONFIG_RE.fullmatch(text.strip())
        if not m:
            raise ValueError(f"config {text!r} is not of the form BLOCK_MxBLOCK_NsSTAGESwWARPS[f], e.g. '128x64s2w4'")
        return Config(*map(int, m.groups()[:4]), spill_free=m.group(5) == "f")

    @property
    def threads(self) -> int:
        return self.warps * WARP_SIZE

    def acc_regs(self, head_dim: int) -> int:
        """fp32 registers per thread holding O (rows x D) and S (rows x block_n) of one warp."""
        return (self.block_m // self.warps) * (head_dim + self.block_n // self.kv_split) // WARP_SIZE

    @property
    def kv_split(self) -> int:
        return 2 if self.spill_free else 1

    def smem_bytes(self, head_dim: int) -> int:
        """Q tile + STAGES slots of K and of V (what kernel.cu's SMEM_BYTES computes)."""
        return ELEM_BYTES * head_dim * (self.block_m + 2 * self.stages * self.block_n)

    def problems(self, head_dim: int, smem_limit: int = SMEM_OPTIN_SM90) -> list[str]:
        """Why this config cannot build for `head_dim` (empty list: valid). Mirrors the
        static_asserts of kernel.cu, so the tuner never spends a compile on an invalid point."""
        out = []
        if head_dim not in HEAD_DIMS:
            out.append(f"head_dim {head_dim} not in {HEAD_DIMS}")
            return out
        if min(self.block_m, self.block_n, self.stages, self.warps) <= 0:
            return [f"all sizes must be positive: {self!r}"]
        if self.stages < 2:
            out.append("stages must be >= 2 (the K/V ring prefetches while it computes)")
        if self.block_m % (self.warps * MMA_M):
            out.append(f"block_m {self.block_m} must be a multiple of 16 * warps = {16 * self.warps}")
        if self.block_n % (KV_STEP * self.kv_split):
            out.append(f"block_n {self.block_n} must be a multiple of {KV_STEP * self.kv_split}"
                       + " (spill_free splits it in two)" * self.spill_free)
        load_rows = self.threads // (head_dim // CHUNK_ELEMS)
        if load_rows == 0 or load_rows % SWIZZLE_ROWS:
            out.append(f"warps {self.warps} copy {load_rows} rows per pass at D={head_dim}; "
                       f"need a multiple of {SWIZZLE_ROWS} (use more warps)")
        elif self.block_m % load_rows or self.block_n % load_rows:
            out.append(f"block_m and block_n must be multiples of the {load_rows} rows one copy pass covers")
        acc = self.acc_regs(head_dim)
        if acc > MAX_ACC_REGS:
            out.append(f"O + S accumulators need {acc} registers per thread (> {MAX_ACC_REGS}): "
                       "use more warps or smaller tiles")
        smem = self.smem_bytes(head_dim)
        if smem > smem_limit:
            out.append(f"shared memory {smem} B over the per-block limit {smem_limit} B")
        return out

    def is_valid(self, head_dim: int, smem_limit: int = SMEM_OPTIN_SM90) -> bool:
        return not self.problems(head_dim, smem_limit)

    def defines(self, head_dim: int, dtype: torch.dtype, causal: bool) -> list[str]:
        return [f"-DBLOCK_M={self.block_m}", f"-DBLOCK_N={self.block_n}", f"-DSTAGES={self.stages}",
                f"-DWARPS={self.warps}", f"-DHEAD_DIM={head_dim}", f"-DIS_CAUSAL={int(causal)}",
                f"-DIS_BF16={DTYPE_MACRO[dtype]}"] + ["-DKV_SPLIT=2", "-DQK_ROLLED=1"] * self.spill_free

    @staticmethod
    def space(head_dim: int, smem_limit: int = SMEM_OPTIN_SM90, *, block_m=(64, 128, 256),
              block_n=(32, 64, 128), stages=(2, 3, 4), warps=(4, 8)) -> list["Config"]:
        """Every valid config in the product of the given choices."""
        cands = (Config(*c) for c in itertools.product(block_m, block_n, stages, warps))
        return [c for c in cands if c.is_valid(head_dim, smem_limit)]


def default_config(head_dim: int) -> Config:
    """Measured on an H100 (ref_kernels/fa2_sm80/NOTES.md), bf16, N = 4k / 8k, causal and full:
    - D=128: 128 x 64, 4 warps, 2 stages. 96 KB of shared memory, so two CTAs share an SM; each
      warp owns 32 query rows, so a K/V fragment read from shared memory feeds two MMAs. 8 warps
      of 16 rows lost ~15 %, a third stage (one CTA per SM) ~25 %.
    - D=64: 128 x 128, 4 warps, 2 stages: 3-8 % over 128 x 64 (twice the keys per barrier and per
      softmax round at the same 64 KB); 8-warp tilings lost 25-35 %."""
    if head_dim == 64:
        return Config(block_m=128, block_n=128, stages=2, warps=4)
    return Config(block_m=128, block_n=64, stages=2, warps=4)


def kernel_source(path: str | os.PathLike | None = None) -> str:
    p = Path(path) if path is not None else KERNEL_PATH
    if not p.is_file():
        raise LaunchError(f"kernel source not found: {p}", hint="run from a cubridge checkout (ref_kernels/)")
    return p.read_text()


def smem_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) or SMEM_OPTIN.get(
        (props.major, props.minor), SMEM_OPTIN[(8, 6)])


class Fa2Sm80:
    """Forward attention (softmax(Q K^T / sqrt(D)) V) on sm_80+ GPUs.

    `config=None` picks default_config(D) per call. `compiler` is "nvrtc" (run-time, through
    CuPy's NVRTC binding) or "nvcc"; compiled cubins are cached on disk in `cache_dir`. Launches
    go through the CUDA driver API (runtime/driver.py), as fa3's."""

    def __init__(self, config: Config | None = None, *, compiler: str = "nvrtc",
                 cache_dir: str | os.PathLike | None = None, source_path: str | os.PathLike | None = None):
        self.config = config
        self.compiler = compiler
        self.cache_dir = cache_dir
        self.source = kernel_source(source_path)
        self._kernels: dict[tuple, LoadedKernel] = {}
        self.last_build: CompileResult | None = None

    def __repr__(self) -> str:
        return f"Fa2Sm80(config={self.config}, compiler={self.compiler!r})"

    def config_for(self, head_dim: int) -> Config:
        return self.config if self.config is not None else default_config(head_dim)

    def options(self, head_dim: int, dtype: torch.dtype, causal: bool) -> list[str]:
        return ["-std=c++17", *self.config_for(head_dim).defines(head_dim, dtype, causal)]

    def build(self, head_dim: int, dtype: torch.dtype, causal: bool, arch: str,
              source: str | None = None) -> CompileResult:
        """Compile (or fetch from the cache) the cubin for one specialisation; no GPU needed.
        `source` is a lowered variant of kernel.cu (cubridge.lower); default: the reference."""
        problems = self.config_for(head_dim).problems(head_dim)
        if problems:
            raise LaunchError(f"config {self.config_for(head_dim)} is invalid for D={head_dim}: "
                              + "; ".join(problems), where="Fa2Sm80.config")
        self.last_build = compile_cubin(source or self.source, arch=arch, options=self.options(head_dim, dtype, causal),
                                        compiler=self.compiler, cache_dir=self.cache_dir, name="fa2_sm80.cu")
        return self.last_build

    def kernel(self, head_dim: int, dtype: torch.dtype, causal: bool, device: torch.device,
               source: str | None = None, cubin: bytes | None = None) -> LoadedKernel:
        """The loaded kernel: `cubin` when given (built elsewhere with options()), else `source`
        (or kernel.cu) built through the compile cache."""
        key = (head_dim, dtype, bool(causal), device.index, cubin if cubin is not None else hash(source) if source else None)
        if key not in self._kernels:
            if cubin is None:
                cubin = self.build(head_dim, dtype, causal, device_arch(device), source).cubin
            self._kernels[key] = LoadedKernel(cubin, ENTRY, device.index)
        return self._kernels[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                 sm_scale: float | None = None, variant=None, cubin: bytes | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [B, Hq, Nq, D] (q's dtype), lse [B, Hq, Nq] float32 (natural log; -inf where a
        row attends no key). Causal: key j is seen by query row i iff j <= i + Nk - Nq (queries aligned
        to the end of the keys).
        `variant` (a cubridge.lower.Launchable) runs a lowered variant: its source and VariantArgs;
        `cubin`, that source already compiled with options() (the tuner's build), skips the build."""
        shape = check_attention_args(q, k, v, out, lse, head_dims=HEAD_DIMS)
        device = q.device
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise LaunchError(f"{device} is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}; "
                              "fa2_sm80 needs sm_80 or newer (mma.sync m16n8k16 bf16, cp.async)")
        config = self.config_for(shape.head_dim)
        limit = smem_limit(device)
        problems = config.problems(shape.head_dim, limit)
        if problems:
            raise LaunchError(f"config {config} cannot run on {torch.cuda.get_device_name(device)}: "
                              + "; ".join(problems), where="Fa2Sm80.config")
        if out is None:
            out = torch.empty_like(q)
        if lse is None:
            lse = torch.empty(shape.batch, shape.heads_q, shape.len_q, device=device, dtype=torch.float32)
        if shape.len_q == 0 or shape.batch == 0 or shape.heads_q == 0:
            return out, lse
        scale = 1.0 / math.sqrt(shape.head_dim) if sm_scale is None else float(sm_scale)
        kern = self.kernel(shape.head_dim, shape.dtype, causal, device,
                           variant.source if variant is not None else None, cubin)
        grid = (math.ceil(shape.len_q / config.block_m), shape.heads_q, shape.batch)
        kern.launch(grid, (config.threads, 1, 1), config.smem_bytes(shape.head_dim),
                    launch_args(q, k, v, out, lse, shape, scale, variant),
                    torch.cuda.current_stream(device).cuda_stream)
        return out, lse


def launch_args(q, k, v, out, lse, shape: AttnShape, scale: float, variant=None) -> tuple:
    """The parameters of fa2_sm80_fwd in kernel.cu's order, as ctypes values for the driver
    launch; `variant` (a cubridge.lower.Launchable) gives the VariantArgs structure."""
    return (arg_ptr(q), arg_ptr(k), arg_ptr(v), arg_ptr(out), arg_ptr(lse), arg_i32(shape.batch),
            arg_i32(shape.heads_q), arg_i32(shape.heads_kv), arg_i32(shape.len_q), arg_i32(shape.len_k),
            arg_f32(scale), variant.args if variant is not None else arg_i32(0))   # VariantArgs
