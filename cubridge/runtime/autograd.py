"""Differentiable dense attention on cubridge kernels: `attention(q, k, v, causal=..., scale=...)`.

Forward: fa3_sm90 on an sm_90 GPU (H100 / H200), else the portable fa2_sm80; both return the
natural-log LSE, which the forward saves. Backward: fa2_bwd_sm80 (sm_80+), with dQ by fp32 atomics,
or a separate dQ pass when `deterministic=True` (bitwise repeatable). On sm_90 the Hopper backward
fa3_bwd_sm90 replaces it (atomic dQ mode only; about 2x faster on an H100, session 9) unless
CUBRIDGE_HOPPER_BWD=0 (`hopper_backward_used`).

`forward_with_lse` and `backward` are the two halves, for a torch.library op's
`register_autograd` (setup_context saves q, k, v, out, lse).

Example (GPU):
    >>> q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # doctest: +SKIP
    >>> k, v = (torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ...         for _ in range(2))                                                                 # doctest: +SKIP
    >>> attention(q, k, v, causal=True).sum().backward()                                           # doctest: +SKIP
"""
from __future__ import annotations

import functools
import math

import torch
from torch.autograd.function import once_differentiable

from cubridge.errors import LaunchError

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _fa2_forward():
    from cubridge.runtime.fa2_sm80 import Fa2Sm80
    return Fa2Sm80()


@functools.lru_cache(maxsize=None)
def _fa2_backward():
    from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
    return Fa2BwdSm80()


def check_supported(q, k, v, scale) -> None:
    """What this function cannot do, said before any kernel runs (LaunchError, with the fix)."""
    where = "cubridge.runtime.autograd.attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise LaunchError(f"{name}: expected a torch.Tensor, got {type(t).__name__}", where=where)
        if t.dtype not in DTYPES:
            raise LaunchError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16", where=where,
                              hint="cast with .half() or .bfloat16()")
        if t.dim() != 4:
            raise LaunchError(f"{name} has shape {tuple(t.shape)}; expected [B, H, N, D]", where=where)
    if q.shape[-1] not in HEAD_DIMS:
        raise LaunchError(f"head dim {q.shape[-1]} is not supported; supported: {HEAD_DIMS}", where=where,
                          hint="pad the head dim to 64 or 128, or use torch's scaled_dot_product_attention")
    if scale is not None and not math.isfinite(float(scale)):
        raise LaunchError(f"scale={scale!r} is not a finite number", where=where)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise LaunchError(f"{name} is on {t.device}; the kernels run on CUDA GPUs (sm_80 or newer)",
                              where=where, hint="move the tensors with .cuda()")
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        raise LaunchError(f"{torch.cuda.get_device_name(q.device)} is older than sm_80", where=where,
                          hint="the kernels need mma.sync bf16 and cp.async (A100, H100 or newer)")


def forward_with_lse(q, k, v, causal: bool = False, scale: float | None = None):
    """(out [B, Hq, Nq, D], lse [B, Hq, Nq] float32, natural log). fa3_sm90 on sm_90 (it needs
    scale > 0: its row maxima are of unscaled scores), else fa2_sm80."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    if torch.cuda.get_device_capability(q.device) == (9, 0) and (scale is None or scale > 0):
        from cubridge.runtime.fa3_sm90 import fa3_forward
        return fa3_forward(q, k, v, causal=causal, softmax_scale=scale)
    return _fa2_forward()(q, k, v, causal=causal, sm_scale=scale)


def hopper_backward_used(q, deterministic: bool) -> bool:
    """Whether `backward` runs fa3_bwd_sm90: not switched off (fa3_bwd_sm90.enabled()), an sm_90 device,
    a built head dim, and not deterministic mode (its dQ is accumulated with atomics)."""
    from cubridge.runtime import fa3_bwd_sm90
    return (fa3_bwd_sm90.enabled() and not deterministic and q.is_cuda and q.shape[-1] in fa3_bwd_sm90.HEAD_DIMS
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def backward(dout, q, k, v, out, lse, causal: bool = False, scale: float | None = None,
             deterministic: bool = False):
    """(dq, dk, dv) from the forward's saved tensors."""
    if hopper_backward_used(q, deterministic):
        from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
        return fa3_backward(dout.contiguous(), q, k, v, out, lse, causal=causal, softmax_scale=scale)
    return _fa2_backward()(dout.contiguous(), q, k, v, out, lse, causal=causal, sm_scale=scale,
                           deterministic=deterministic)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, deterministic):
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = forward_with_lse(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
        return out

    @staticmethod
    @once_differentiable   # a second derivative raises torch's clear error, never a wrong result
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.deterministic)
        return dq, dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, deterministic: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale (+ causal mask)) v, differentiable in q, k, v.

    Causal: query row i sees keys j <= i + Nk - Nq (queries aligned to the end of the keys, as
    FlashAttention; forward and both backward kernels agree); with Nq > Nk the first Nq - Nk rows
    see no key: their output and gradients are 0.

    q [B, Hq, Nq, D], k / v [B, Hkv, Nk, D] (Hq a multiple of Hkv: MHA, GQA, MQA), float16 or
    bfloat16, D = 64 or 128, on an sm_80+ GPU; scale defaults to 1 / sqrt(D)."""
    check_supported(q, k, v, scale)
    return _Attention.apply(q, k, v, bool(causal), None if scale is None else float(scale), bool(deterministic))
