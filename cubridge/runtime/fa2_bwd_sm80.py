"""Python face of ref_kernels/fa2_bwd_sm80 (the portable backward): config, build, checked launch.

Example (GPU):
    >>> from cubridge.runtime.fa2_sm80 import Fa2Sm80
    >>> from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
    >>> out, lse = Fa2Sm80()(q, k, v, causal=True)                              # doctest: +SKIP
    >>> dq, dk, dv = Fa2BwdSm80()(dout, q, k, v, out, lse, causal=True)        # doctest: +SKIP
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cubridge.errors import LaunchError
from cubridge.runtime.build import CompileResult, compile_cubin
from cubridge.runtime.fa2_sm80 import DTYPE_MACRO, SMEM_OPTIN_SM90, smem_limit
from cubridge.runtime.launch import (LoadedKernel, arg_f32, arg_i32, arg_i64, arg_ptr, check_attention_args,
                                     check_output, device_arch, overlaps)

KERNEL_DIR = Path(__file__).resolve().parents[2] / "ref_kernels" / "fa2_bwd_sm80"
KERNEL_PATH = KERNEL_DIR / "kernel.cu"
ENTRIES = ("fa2_bwd_preprocess", "fa2_bwd_dkdv", "fa2_bwd_dq_convert", "fa2_bwd_dq")
HEAD_DIMS = (64, 128)
ELEM_BYTES = 2
WARP_SIZE = 32
MMA = 16
CHUNK_ELEMS = 8
SWIZZLE_ROWS = 8
PRE_THREADS = 256          # preprocess / convert kernels (kernel.cu PRE_THREADS)
# fp32 accumulator registers per thread of fa2_bwd_dkdv (dK + dV + S^T + dP^T) above which ptxas
# spills heavily: 192 (64 x 128, 8 warps, D = 128) spills 68 bytes at 255 registers.
MAX_ACC_REGS = 192
_CONFIG_RE = re.compile(r"(\d+)x(\d+)w(\d+)-dq(\d+)x(\d+)w(\d+)")


@dataclass(frozen=True)
class Config:
    """block_m: query rows per step of the dK/dV kernel; block_n: keys per dK/dV CTA; warps: its
    warps (each owns block_n / warps keys); dq_*: the same for the deterministic dQ pass (query
    rows per CTA, keys per KV tile, warps each owning dq_block_m / dq_warps query rows)."""
    block_m: int = 64
    block_n: int = 128
    warps: int = 8
    dq_block_m: int = 64
    dq_block_n: int = 64
    dq_warps: int = 4

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}w{self.warps}-"
                f"dq{self.dq_block_m}x{self.dq_block_n}w{self.dq_warps}")

    @staticmethod
    def parse(text: str) -> "Config":
        """Inverse of str(): Config.parse("64x128w8-dq64x64w4") == Config()."""
        m = _CONFIG_RE.fullmatch(text.strip())
        if not m:
            raise ValueError(f"config {text!r} is not of the form MxNwW-dqMxNwW, e.g. '64x128w8-dq64x64w4'")
        return Config(*map(int, m.groups()))

    def smem_bytes(self, head_dim: int, deterministic: bool) -> int:
        """fa2_bwd_dkdv: K, V, two slots of Q and dO, the dS tile (not in deterministic mode),
        two slots of LSE and Dvec (kernel.cu SMEM_BYTES)."""
        ds = 0 if deterministic else self.block_n * self.block_m * ELEM_BYTES
        return ELEM_BYTES * head_dim * (2 * self.block_n + 4 * self.block_m) + ds + 4 * self.block_m * 4

    def dq_smem_bytes(self, head_dim: int) -> int:
        """fa2_bwd_dq: Q, dO, two slots of K and V, LSE and Dvec (kernel.cu DQ_SMEM_BYTES)."""
        return ELEM_BYTES * head_dim * (2 * self.dq_block_m + 4 * self.dq_block_n) + 2 * self.dq_block_m * 4

    def acc_regs(self, head_dim: int) -> int:
        keys = self.block_n // self.warps
        return (2 * keys * head_dim + 2 * keys * self.block_m) // WARP_SIZE

    def problems(self, head_dim: int, smem_limit: int = SMEM_OPTIN_SM90, deterministic: bool = False) -> list[str]:
        """Why this config cannot build (empty: valid); mirrors kernel.cu's static_asserts."""
        if head_dim not in HEAD_DIMS:
            return [f"head_dim {head_dim} not in {HEAD_DIMS}"]
        if min(self.block_m, self.block_n, self.warps, self.dq_block_m, self.dq_block_n, self.dq_warps) <= 0:
            return [f"all sizes must be positive: {self!r}"]
        out = []
        if self.block_n % (self.warps * MMA):
            out.append(f"block_n {self.block_n} must be a multiple of 16 * warps = {16 * self.warps}")
        if self.block_m % 64:
            out.append(f"block_m {self.block_m} must be a multiple of 64 (the dS tile's swizzled rows)")
        wm = min(self.warps, self.block_m // MMA)
        if wm and (self.warps % wm or (head_dim // 8) % (2 * (self.warps // wm))):
            out.append(f"{self.warps} warps cannot split the {self.block_m} x {head_dim} dQ tile evenly")
        if self.dq_block_m % (self.dq_warps * MMA):
            out.append(f"dq_block_m {self.dq_block_m} must be a multiple of 16 * dq_warps = {16 * self.dq_warps}")
        if self.dq_block_n % 32:
            out.append(f"dq_block_n {self.dq_block_n} must be a multiple of 32")
        row_chunks = head_dim // CHUNK_ELEMS
        for name, warps, tiles in (("warps", self.warps, (self.block_m, self.block_n)),
                                   ("dq_warps", self.dq_warps, (self.dq_block_m, self.dq_block_n))):
            load_rows = warps * WARP_SIZE // row_chunks
            if load_rows == 0 or load_rows % SWIZZLE_ROWS:
                out.append(f"{name} {warps} copy {load_rows} rows per pass at D={head_dim}; need a multiple of 8")
            elif any(t % load_rows for t in tiles):
                out.append(f"tiles {tiles} must be multiples of the {load_rows} rows one copy pass of {name} covers")
        if self.acc_regs(head_dim) > MAX_ACC_REGS:
            out.append(f"dK + dV + S + dP need {self.acc_regs(head_dim)} registers per thread (> {MAX_ACC_REGS})")
        for what, smem in (("dK/dV kernel", self.smem_bytes(head_dim, deterministic)),
                           ("dQ kernel", self.dq_smem_bytes(head_dim))):
            if smem > smem_limit:
                out.append(f"{what} shared memory {smem} B over the per-block limit {smem_limit} B")
        return out

    def defines(self, head_dim: int, dtype: torch.dtype, causal: bool, deterministic: bool) -> list[str]:
        return [f"-DBLOCK_M={self.block_m}", f"-DBLOCK_N={self.block_n}", f"-DWARPS={self.warps}",
                f"-DDQ_BLOCK_M={self.dq_block_m}", f"-DDQ_BLOCK_N={self.dq_block_n}",
                f"-DDQ_WARPS={self.dq_warps}", f"-DHEAD_DIM={head_dim}", f"-DIS_CAUSAL={int(causal)}",
                f"-DIS_BF16={DTYPE_MACRO[dtype]}", f"-DDETERMINISTIC={int(deterministic)}"]


def default_config(head_dim: int) -> Config:
    """Not tuned yet (no device run): FlashAttention-2's sm_80 backward tiling for D = 128 (64
    queries x 128 keys, 8 warps), which fits both head dims; the dQ pass mirrors the forward."""
    return Config()


class Fa2BwdSm80:
    """Backward of softmax(Q K^T * scale) V on sm_80+ GPUs: (dq, dk, dv) from dout, the inputs, the
    forward's out and its natural-log LSE. `deterministic=True` replaces the dQ atomics by a
    separate dQ pass (bitwise repeatable)."""

    def __init__(self, config: Config | None = None, *, compiler: str = "nvrtc",
                 cache_dir: str | os.PathLike | None = None):
        self.config = config
        self.compiler = compiler
        self.cache_dir = cache_dir
        if not KERNEL_PATH.is_file():
            raise LaunchError(f"kernel source not found: {KERNEL_PATH}", hint="run from a cubridge checkout")
        self.source = KERNEL_PATH.read_text()
        self._kernels: dict[tuple, dict[str, LoadedKernel]] = {}
        self.last_build: CompileResult | None = None

    def config_for(self, head_dim: int) -> Config:
        return self.config if self.config is not None else default_config(head_dim)

    def options(self, head_dim: int, dtype: torch.dtype, causal: bool, deterministic: bool) -> list[str]:
        return ["-std=c++17", f"-I{KERNEL_DIR}",
                *self.config_for(head_dim).defines(head_dim, dtype, causal, deterministic)]

    def build(self, head_dim: int, dtype: torch.dtype, causal: bool, deterministic: bool, arch: str,
              extra_options: tuple[str, ...] = (), source: str | None = None) -> CompileResult:
        """Compile (or fetch from the cache) one specialisation; no GPU needed."""
        config = self.config_for(head_dim)
        problems = config.problems(head_dim, deterministic=deterministic)
        if problems:
            raise LaunchError(f"config {config} is invalid for D={head_dim}: " + "; ".join(problems),
                              where="Fa2BwdSm80.config")
        self.last_build = compile_cubin(source or self.source, arch=arch,
                                        options=[*self.options(head_dim, dtype, causal, deterministic), *extra_options],
                                        compiler=self.compiler, cache_dir=self.cache_dir, name="fa2_bwd_sm80.cu")
        return self.last_build

    def kernels(self, head_dim, dtype, causal, deterministic, device, source: str | None = None
                ) -> dict[str, LoadedKernel]:
        key = (head_dim, dtype, bool(causal), bool(deterministic), device.index, source)
        if key not in self._kernels:
            cubin = self.build(head_dim, dtype, causal, deterministic, device_arch(device), source=source).cubin
            self._kernels[key] = {e: LoadedKernel(cubin, e, device.index) for e in ENTRIES}
        return self._kernels[key]

    def __call__(self, dout, q, k, v, out, lse, causal: bool = False, sm_scale: float | None = None,
                 deterministic: bool = False, dq=None, dk=None, dv=None, variant=None):
        """dq [B, Hq, Nq, D], dk, dv [B, Hkv, Nk, D] in q's dtype. `out` and `lse` are the forward's
        (lse float32 [B, Hq, Nq], natural log, -inf for a row that attends nothing; not read for a
        sigmoid / relu variant). `variant`: a cubridge.lower.Launchable of a source lowered by
        cubridge.lower.fa2_bwd_sm80 (its mask replaces `causal`)."""
        shape, scale = check_backward_args(dout, q, k, v, out, lse, dq, dk, dv, sm_scale)
        if variant is not None and causal:
            raise LaunchError("causal=True with a variant: the variant's own mask is lowered into the kernel",
                              where="Fa2BwdSm80", hint="pass causal=False with variant=...")
        va = variant.args if variant is not None else arg_i32(0)   # VariantArgs
        device = q.device
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise LaunchError(f"{device} is older than sm_80; fa2_bwd_sm80 needs mma.sync bf16 and cp.async")
        config = self.config_for(shape.head_dim)
        problems = config.problems(shape.head_dim, smem_limit(device), deterministic)
        if problems:
            raise LaunchError(f"config {config} cannot run on {torch.cuda.get_device_name(device)}: "
                              + "; ".join(problems), where="Fa2BwdSm80.config")
        dq, dk, dv, done = gradient_buffers(shape, q, k, v, dq, dk, dv)
        if done:
            return dq, dk, dv
        b, hq, hkv, nq, nk, d = (shape.batch, shape.heads_q, shape.heads_kv, shape.len_q, shape.len_k,
                                 shape.head_dim)
        kern = self.kernels(d, shape.dtype, causal, deterministic, device,
                            variant.source if variant is not None else None)
        stream = torch.cuda.current_stream(device).cuda_stream
        rows = b * hq * nq
        dvec = torch.empty(b, hq, nq, device=device, dtype=torch.float32)
        accum = None if deterministic else torch.empty(b, hq, nq, d, device=device, dtype=torch.float32)
        row_chunks = d // CHUNK_ELEMS
        kern["fa2_bwd_preprocess"].launch(
            (math.ceil(rows * row_chunks / PRE_THREADS), 1, 1), (PRE_THREADS, 1, 1), 0,
            (arg_ptr(out), arg_ptr(dout), arg_ptr(dvec), arg_ptr(accum), arg_i64(rows)),   # accum None: null
            stream)
        common = (arg_i32(b), arg_i32(hq), arg_i32(hkv), arg_i32(nq), arg_i32(nk), arg_f32(scale))
        kern["fa2_bwd_dkdv"].launch(
            (math.ceil(nk / config.block_n), hkv, b), (config.warps * WARP_SIZE, 1, 1),
            config.smem_bytes(d, deterministic),
            (arg_ptr(q), arg_ptr(k), arg_ptr(v), arg_ptr(dout), arg_ptr(lse), arg_ptr(dvec),
             arg_ptr(accum), arg_ptr(dk), arg_ptr(dv), *common,
             va), stream)
        if deterministic:
            kern["fa2_bwd_dq"].launch(
                (math.ceil(nq / config.dq_block_m), hq, b), (config.dq_warps * WARP_SIZE, 1, 1),
                config.dq_smem_bytes(d),
                (arg_ptr(q), arg_ptr(k), arg_ptr(v), arg_ptr(dout), arg_ptr(lse), arg_ptr(dvec), arg_ptr(dq),
                 *common, va), stream)
        else:
            chunks = rows * d // CHUNK_ELEMS
            kern["fa2_bwd_dq_convert"].launch((math.ceil(chunks / PRE_THREADS), 1, 1), (PRE_THREADS, 1, 1), 0,
                                              (arg_ptr(accum), arg_ptr(dq), arg_i64(chunks), arg_f32(scale)),
                                              stream)
        return dq, dk, dv


def check_backward_args(dout, q, k, v, out, lse, dq=None, dk=None, dv=None, sm_scale=None, *,
                        require_cuda: bool = True, strided: bool = False):
    """Validate a backward call before launch; returns (AttnShape, scale). Raises LaunchError
    naming the argument and what it should be. strided: the tensors may be any [B, H, N, D] views
    (fa3_bwd_sm90's BNHD path checks their layouts itself); otherwise contiguous."""
    shape = check_attention_args(q, k, v, head_dims=HEAD_DIMS, require_cuda=require_cuda, strided=strided)
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise LaunchError(f"{name}: expected a torch.Tensor, got {type(t).__name__}", where="backward inputs")
        if tuple(t.shape) != tuple(q.shape) or t.dtype != q.dtype:
            raise LaunchError(f"{name}: expected shape {tuple(q.shape)} {q.dtype} (as q), got "
                              f"{tuple(t.shape)} {t.dtype}", where="backward inputs")
        if not strided and not t.is_contiguous():
            raise LaunchError(f"{name}: expected a contiguous tensor, got strides {t.stride()}",
                              where="backward inputs", hint=f"pass {name}.contiguous()")
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)):
        if t.data_ptr() % 16:
            raise LaunchError(f"{name}: expected a 16-byte aligned data pointer (16-byte copies), got "
                              f"{t.data_ptr():#x}", where="backward inputs", hint=f"pass {name}.clone()")
    want = (shape.batch, shape.heads_q, shape.len_q)
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != want or lse.dtype != torch.float32:
        got = f"{tuple(lse.shape)} {lse.dtype}" if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise LaunchError(f"lse: expected float32 of shape {want} [B, Hq, Nq] (the forward's natural-log "
                          f"logsumexp), got {got}", where="backward inputs",
                          hint="pass the lse the forward returned (Fa2Sm80 / fa3_forward)")
    if not lse.is_contiguous():
        raise LaunchError("lse: expected a contiguous tensor", where="backward inputs", hint="pass lse.contiguous()")
    devices = {t.device for t in (dout, q, k, v, out, lse)}
    if len(devices) != 1:
        raise LaunchError(f"devices: expected all tensors on one device, got {sorted(map(str, devices))}",
                          where="backward inputs")
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is not None:
            check_output(name, t, tuple(like.shape), like.dtype, q, k, v, strided=strided)
            for other_name, other in (("dout", dout), ("out", out), ("lse", lse)):
                if overlaps(t, other):
                    raise LaunchError(f"{name} memory: expected separate from {other_name}, got overlapping buffers",
                                      where="backward inputs")
    scale = 1.0 / math.sqrt(shape.head_dim) if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale):
        raise LaunchError(f"sm_scale: expected a finite float, got {sm_scale!r}", where="backward inputs")
    return shape, scale


def gradient_buffers(shape, q, k, v, dq=None, dk=None, dv=None):
    """(dq, dk, dv, done) for a checked backward call (both backward kernels): the caller's buffers
    or fresh ones; done when the shape leaves nothing to launch, the gradients then already set
    (no query: dk = dv = 0; no key: out was 0, so dq = 0)."""
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if shape.len_q == 0 or shape.heads_q == 0 or shape.batch == 0:
        return dq, dk.zero_(), dv.zero_(), True
    if shape.len_k == 0:
        return dq.zero_(), dk, dv, True
    return dq, dk, dv, False
