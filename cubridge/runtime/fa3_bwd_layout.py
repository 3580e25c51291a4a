"""The caller's layout in the Hopper backward (kernel.cu BNHD, session 14; on by default since session 15).

A transformers model hands attention [B, N, H, D] memory seen as [B, H, N, D] (q_proj(x).view(B, N,
H, D).transpose(1, 2)), and its gradient of the attention output arrives the same way. Session 13's
Llama training step spent ~1.9 ms per step in copies to contiguous [B, H, N, D] around our backward
(cubridge/op/NOTES.md). With BNHD the kernel reads Q, K, V, dO through 4-D TMA maps built from the
tensors' own strides (cubridge.runtime.fa3_sm90.tensor_map, as the forward), its preprocess reads O
and dO, and it writes dQ, dK, dV, as [B, N, H, D] memory; the gradients are allocated like the inputs
(torch.empty_like), so a model's views need no copy either way.

fa3_backward(layout="auto") takes it when dout and out are [B, N, H, D] memory; CUBRIDGE_BWD_BNHD=0 turns
that off (contiguous copies, as before session 15); fa3_backward(layout="bnhd") asks for it explicitly.
On by default since session 15's mid call (H100, prefixlm 8k Llama training step, one round-robin: 89.99 ms in
place vs 90.89 ms copying, Flex-FLASH 88.88; the backward alone 7-12% faster than with the copies in session 14's
mid call; tests/gpu/test_bwd_layout.py 15 passed and tests/gpu/test_bwd_op.py 11 passed with it on).
"""
from __future__ import annotations


import torch

from cubridge.errors import LaunchError, env_switch

ENV = "CUBRIDGE_BWD_BNHD"
LAYOUTS = ("auto", "bhnd", "bnhd")


def enabled() -> bool:
    """CUBRIDGE_BWD_BNHD: "1" or unset lets "auto" take the BNHD path, "0" keeps [B, H, N, D] (copies)."""
    return env_switch(ENV, "1", f"unset {ENV} (the caller's layout, the default) or set it to 0 (contiguous [B, H, N, D] "
                                "copies)")


def is_bnhd(t: torch.Tensor) -> bool:
    """Whether a [B, H, N, D] view is exactly [B, N, H, D] memory (the kernel's BNHD addressing).

    >>> is_bnhd(torch.empty(2, 8, 4, 64).transpose(1, 2)), is_bnhd(torch.empty(2, 4, 8, 64))
    (True, False)
    """
    return t.dim() == 4 and t.transpose(1, 2).is_contiguous()


def addressable(t: torch.Tensor) -> bool:
    """Whether the 4-D TMA maps can read `t` in place (strides only: a fake tensor has no address)."""
    from cubridge.runtime.fa3_sm90 import map_refusal
    return t.dim() == 4 and map_refusal(tuple(t.shape), t.stride(), t.element_size()) is None


def fits(dout, q, k, v, out) -> bool:
    """Whether the BNHD path reads these in place: dout and out [B, N, H, D] memory, q, k, v any view
    the maps address."""
    return is_bnhd(dout) and is_bnhd(out) and all(addressable(t) for t in (q, k, v))


def choose(layout: str | None, modes, dout, q, k, v, out) -> bool:
    """True for the BNHD path. layout None / "auto": CUBRIDGE_BWD_BNHD on (the default), an option with LEAN and
    EPILOGUE (the preprocess and the stores it changes), and fits(); "bnhd": required (a clear error
    where the option or tensors cannot), "bhnd": never."""
    layout = "auto" if layout is None else layout
    if layout not in LAYOUTS:
        raise LaunchError(f"layout={layout!r}", where="fa3_backward", hint=f"use one of {list(LAYOUTS)}")
    capable = bool(modes.lean and modes.epilogue)
    if layout == "bhnd" or (layout == "auto" and not enabled()):
        return False
    if layout == "auto":
        return capable and fits(dout, q, k, v, out)
    if not capable:
        raise LaunchError("layout='bnhd' with an option without LEAN and EPILOGUE", where="fa3_backward",
                          hint="use an option ending in _lean_issue_pf32_epi (the default) or layout='bhnd'")
    for name, t in (("dout", dout), ("out", out)):
        if not is_bnhd(t):
            raise LaunchError(f"{name}: layout='bnhd' needs [B, N, H, D] memory, got strides {t.stride()}",
                              where="fa3_backward", hint=f"pass {name}.transpose(1, 2).contiguous().transpose(1, 2)")
    return True


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy in the same layout where its address is not 16-byte aligned (TMA, 16-byte copies)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def target(t: torch.Tensor) -> torch.Tensor:
    """Where the kernel writes a gradient destined for `t`: t itself if it is [B, N, H, D] memory,
    else a fresh [B, N, H, D] buffer that finish() copies into t (a caller's buffer in another layout)."""
    if is_bnhd(t) and t.data_ptr() % 16 == 0:
        return t
    b, h, n, d = t.shape
    return torch.empty(b, n, h, d, device=t.device, dtype=t.dtype).transpose(1, 2)


def finish(pairs) -> None:
    """Copy each (written, wanted) pair where target() gave a separate buffer."""
    for written, wanted in pairs:
        if written.data_ptr() != wanted.data_ptr():
            wanted.copy_(written)
