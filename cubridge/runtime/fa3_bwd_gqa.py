"""GQA_SPLIT of the Hopper backward (ref_kernels/fa3_bwd_sm90/kernel.cu, session 14; off by default).

The kernel's grid is (KV tiles, kv heads, batch) and each CTA loops over all G = Hq / Hkv query
heads of its group: at GQA 16 / 4, 8k, B 2 that is 512 CTAs, each 4x as long as at MHA, and
causal's uneven tiles then leave SMs idle at the end of the grid (132 SMs). Split s cuts each
group into s slices of G / s heads: s x as many CTAs, each 1 / s as long. The launcher passes
Hkv * s "virtual kv heads" with group G / s, so every query-head index in the kernel (bh_q, the
variant hooks' h_kv * group + g) is already the real one; only the K / V loads divide by s.

The s CTAs of one KV tile each hold a partial dK / dV. They are reduced through s fp32 partial
buffers [B * Hkv, s, Nk, D] (plain stores from the registers) and one small kernel,
fa3_bwd_dkdv_sum, that adds them in slice order and writes the 16-bit dK (x scale) and dV.
Chosen over FA4's fp32 atomics into one accumulator plus a convert kernel because (1) the sum has
a fixed order, so dK / dV stay bitwise repeatable as they are without the split (the GPU tests
check it; only dQ uses atomics), (2) no accumulator to zero before the launch, (3) plain stores
contend with nothing. The price is memory: 2 x s x B x Hkv x Nk x D x 4 bytes while the backward
runs (s = 4, 8k, B 2, Hkv 4, D 128: 268 MB; atomics would need a quarter of that) and the sum
kernel's read of it (at 3 TB/s about 0.1 ms of a ~3.6 ms backward).

Select with fa3_backward(gqa_split=...) or CUBRIDGE_BWD_GQA_SPLIT: 1 (off), 2, 4, 8, 16 or "group"
(one query head per CTA); unset: default_split (2 for the dense causal kernel since the session 14 mid
call, 1 for full attention and the variants). The effective split is the largest power of two dividing both
the request and G (GQA 16 / 4 with 8: 4), so MHA always runs unsplit.
"""
from __future__ import annotations

import ctypes
import math
import os

import torch

from cubridge.errors import LaunchError
from cubridge.runtime.driver import driver, pack_params

SPLIT_ENV = "CUBRIDGE_BWD_GQA_SPLIT"
SUM_ENTRY = b"fa3_bwd_dkdv_sum"
SPLITS = (1, 2, 4, 8, 16)
SUM_THREADS = 256


def _parse(value, where: str) -> int:
    """A split request as a number; "group" is 16, the kernel's largest split (clipped to G)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "group":
            return SPLITS[-1]
        if not text.isdigit():
            raise LaunchError(f"{value!r} is not a number or 'group'", where=where,
                              hint=f"use one of {list(SPLITS)} or 'group'")
        value = int(text)
    if value not in SPLITS:
        raise LaunchError(f"{value!r} is not a supported split", where=where,
                          hint=f"use one of {list(SPLITS)} or 'group' (1 = off)")
    return value


# The default where nothing asks (session 14 mid call, H100, 8k, B 2, D 128, same run as the unsplit kernel):
# dense causal GQA 16 / 4 split 2 1.069x, 32 / 8 1.023x (split 4 1.090x / 1.019x; the rule tests passed).
# Full attention loses (16 / 4 0.978x, 32 / 8 0.963x: more CTAs, each paying the fixed cost, nothing to
# balance) and the variants were measured on prefixlm only (1.042x / 1.000x): both stay at 1.
DENSE_CAUSAL_SPLIT = 2


def default_split(causal: bool, variant: bool) -> int:
    """The split used when neither gqa_split= nor CUBRIDGE_BWD_GQA_SPLIT asks: DENSE_CAUSAL_SPLIT for
    the dense causal kernel, 1 for full attention and the lowered variants."""
    return DENSE_CAUSAL_SPLIT if causal and not variant else 1


def requested(gqa_split=None, default: int = 1) -> int:
    """The requested split: the argument, else CUBRIDGE_BWD_GQA_SPLIT, else `default`."""
    if gqa_split is not None:
        return _parse(gqa_split, "gqa_split")
    value = os.environ.get(SPLIT_ENV)
    return default if value in (None, "") else _parse(value, SPLIT_ENV)


def effective(request: int, group: int) -> int:
    """The split a launch uses: the largest power of two dividing the request and the group size.

    >>> effective(4, 4), effective(16, 4), effective(4, 6), effective(2, 1), effective(8, 16)
    (4, 4, 2, 1, 8)
    """
    return math.gcd(request, group & -group) if group > 0 else 1


def partials(batch: int, heads_kv: int, split: int, len_k: int, head_dim: int, device) -> tuple:
    """(dK partials, dV partials): fp32 [B * Hkv * s, Nk, D], every element written by the kernel
    (CTAs with no query tile store zeros), so no zeroing."""
    shape = (batch * heads_kv * split, len_k, head_dim)
    return (torch.empty(shape, device=device, dtype=torch.float32),
            torch.empty(shape, device=device, dtype=torch.float32))


def _strides(name: str, t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) element strides of a [B, H, N, D] gradient the sum kernel writes with
    8-byte stores: D contiguous, the others multiples of 4 elements."""
    sb, sh, sn, sd = t.stride()
    if t.shape[3] > 1 and sd != 1 or any(s % 4 for s in (sb, sh, sn)) or t.data_ptr() % 8:
        raise LaunchError(f"{name}: strides {t.stride()} cannot take 8-byte stores", where="fa3_backward gqa_split",
                          hint=f"pass a contiguous {name} (or gqa_split=1)")
    return sb, sh, sn


def launch_sum(func, dk_part, dv_part, dk, dv, heads_kv: int, scale: float, stream: int) -> None:
    """fa3_bwd_dkdv_sum: dV = sum of the partials, dK = scale x theirs, into dk / dv in place."""
    b, _, nk, d = dk.shape
    rows = b * heads_kv * nk
    args = [ctypes.c_uint64(t.data_ptr()) for t in (dk_part, dv_part, dk, dv)]
    args += [ctypes.c_int32(heads_kv), ctypes.c_int32(nk), ctypes.c_int64(rows)]
    args += [ctypes.c_int64(s) for s in (*_strides("dk", dk), *_strides("dv", dv))]
    args.append(ctypes.c_float(scale))
    grid = (math.ceil(rows * (d // 4) / SUM_THREADS), 2, 1)
    driver().launch(func, grid, (SUM_THREADS, 1, 1), 0, stream, pack_params(args))
