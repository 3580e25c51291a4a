"""What the tuned op accepts, checked on shapes, strides and dtypes only (so the checks run the same
eagerly and while torch.compile traces with fake tensors), each refusal naming the argument and
the fix.

A wrong layout must never be misread: a [B, N, H, D] tensor passed as [B, H, N, D] would run as
N heads of H tokens. The run was tuned for one (Hq, Hkv), so the head axis of each layout must
hold exactly those counts; where the other layout's head axis holds them instead the error says
to pass layout=, and where both readings fit (N equal to the head count) without an explicit
layout the call is refused as ambiguous.

Strides: the fa3 kernel reads through 4-D TMA maps over (D, N, H, B), so any view whose last dim
is contiguous and whose other strides are 16-byte multiples is read in place, [B, N, H, D] memory
included (transformers' transposed projections, layout='bnhd'); a view with a contiguous last dim
that the maps cannot express (an odd stride, a broadcast head) is copied once into [B, H, N, D],
saying why in the log (logger "cubridge", level INFO); a view whose last dim is not contiguous is
refused. The output comes back in q's memory order (out_like), so a [B, N, H, D] caller gets
contiguous [B, N, H, D] memory: transformers' transpose and reshape of it copy nothing.
"""
from __future__ import annotations

import logging

import torch

from cubridge.errors import LaunchError
from cubridge.runtime.kernels import reference_kernel

log = logging.getLogger("cubridge")

WHERE = "cubridge op"
LAYOUTS = ("bhnd", "bnhd")
DTYPE_NAMES = {torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}


def _usage(op, layout: str) -> str:
    hq, hkv = op.heads
    d = op.head_dim
    if layout == "bnhd":
        return f"q [B, N, {hq}, {d}], k and v [B, N, {hkv}, {d}] ({DTYPE_NAMES[op.dtype]}, on cuda)"
    return f"q [B, {hq}, N, {d}], k and v [B, {hkv}, N, {d}] ({DTYPE_NAMES[op.dtype]}, on cuda)"


def check_plan(op, q, k, v, layout: str | None):
    """Check the inputs; return the plan (layout, which of q, k, v need a copy) for apply_plan."""
    if layout is not None and layout not in LAYOUTS:
        raise LaunchError(f"layout={layout!r}", where=f"{WHERE}: layout",
                          hint="pass layout='bhnd' ([B, H, N, D], the default) or layout='bnhd' ([B, N, H, D])")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise LaunchError(f"{name} must be a 4-d torch.Tensor, got "
                              f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}",
                              where=f"{WHERE}: {name}", hint=_usage(op, layout or "bhnd"))
        if t.dtype != op.dtype:
            raise LaunchError(f"{name} is {t.dtype}; the kernel was built for {op.dispatch['dtype']}",
                              where=f"{WHERE}: {name}",
                              hint=f"convert with .to({DTYPE_NAMES[op.dtype]}) or tune with dtype: {t.dtype}")
        if t.shape[-1] != op.head_dim:
            raise LaunchError(f"{name} has head dim {t.shape[-1]}; the kernel was built for {op.head_dim}",
                              where=f"{WHERE}: {name}", hint=f"tune a config with head_dim: {t.shape[-1]}")
    layout = _resolve_layout(op, q, k, layout)
    if layout == "bnhd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if tuple(k.shape) != tuple(v.shape) or k.shape[0] != q.shape[0]:
        raise LaunchError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} as [B, H, N, D]: k and v must "
                          "have one shape and the batch of q", where=WHERE, hint=_usage(op, layout))
    if q.shape[2] != k.shape[2]:
        raise LaunchError(f"q has {q.shape[2]} queries and k {k.shape[2]} keys; this kernel was tuned for Nq == Nk",
                          where=WHERE, hint="pass as many queries as keys (Nq != Nk needs a run tuned with query_length)")
    for name, t in (("q", q), ("k", k), ("v", v)):   # last: every shape refusal is testable on CPU
        if t.device.type != op.device_type:
            raise LaunchError(f"{name} is on {t.device}; the tuned kernel runs on a GPU", where=f"{WHERE}: {name}",
                              hint=f"move the inputs with .cuda(); {_usage(op, layout)}")
    if k.device != q.device or v.device != q.device:
        raise LaunchError(f"q on {q.device}, k on {k.device}, v on {v.device}", where=WHERE,
                          hint="put q, k and v on one GPU")
    return layout, tuple(_needs_copy(op, name, t) for name, t in (("q", q), ("k", k), ("v", v)))


def apply_plan(plan, q, k, v):
    """q, k, v as the [B, H, N, D] views (or copies) a plan from check_plan says."""
    layout, copies = plan
    if layout == "bnhd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return tuple(t.contiguous() if c else t for t, c in zip((q, k, v), copies))


def _heads(t, layout: str) -> int:
    return t.shape[1] if layout == "bhnd" else t.shape[2]


def _resolve_layout(op, q, k, layout: str | None) -> str:
    hq, hkv = op.heads
    fits = [lay for lay in LAYOUTS if _heads(q, lay) == hq and _heads(k, lay) == hkv]
    if layout is not None:
        if layout in fits:
            return layout
        other = [lay for lay in fits if lay != layout]
        hint = (f"these look like {other[0]} tensors: pass layout={other[0]!r}" if other
                else f"this run was tuned for Hq={hq}, Hkv={hkv}: {_usage(op, layout)}; tune again for other head counts")
        raise LaunchError(f"layout={layout!r} reads q {tuple(q.shape)} as Hq={_heads(q, layout)} and k {tuple(k.shape)} "
                          f"as Hkv={_heads(k, layout)}", where=f"{WHERE}: layout", hint=hint)
    if fits == ["bhnd"]:
        return "bhnd"
    if fits == ["bnhd"]:
        raise LaunchError(f"q {tuple(q.shape)} and k {tuple(k.shape)} read as [B, H, N, D] have Hq={q.shape[1]}, "
                          f"Hkv={k.shape[1]}, but this run was tuned for Hq={hq}, Hkv={hkv}; they look like "
                          "[B, N, H, D]", where=f"{WHERE}: layout", hint="pass layout='bnhd' (or transpose(1, 2) them)")
    if fits:
        raise LaunchError(f"q {tuple(q.shape)} is ambiguous: N equals the head count, so both [B, H, N, D] and "
                          "[B, N, H, D] fit", where=f"{WHERE}: layout", hint="pass layout='bhnd' or layout='bnhd'")
    raise LaunchError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: this run was tuned for Hq={hq}, Hkv={hkv} and neither "
                      "layout reads those head counts", where=WHERE,
                      hint=f"{_usage(op, 'bhnd')}; tune again (shapes: heads_q, heads_kv) for other head counts")


def _needs_copy(op, name: str, t) -> bool:
    """False where the kernel can read t in place, True where one contiguous copy is needed (the
    reason logged once per call signature: check_plan's result is cached); refused where the last
    dim is not contiguous."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise LaunchError(f"{name} has strides {tuple(t.stride())}: its last (head) dim is not contiguous",
                          where=f"{WHERE}: {name}", hint=f"pass {name}.contiguous() (or a view with stride 1 in D)")
    why = copy_reason(op, t)
    if why:
        log.info("%s: %s %s strides %s copied to [B, H, N, D]: %s", WHERE, name, tuple(t.shape), tuple(t.stride()), why)
    return why is not None


def copy_reason(op, t) -> str | None:
    """Why the run's kernel cannot read the [B, H, N, D] view t in place, or None where it can."""
    return reference_kernel(op.buckets[0]["reference"]).copy_reason(t)


def readable(op, t):
    """t, or a contiguous copy of it where the run's kernel cannot read it in place (the custom
    ops: a compiler may hand them other strides than the traced call had)."""
    return t if copy_reason(op, t) is None else t.contiguous()


def bnhd_order(t) -> bool:
    """Whether a [B, H, N, D] view lies in [B, N, H, D] memory order (heads closer than rows)."""
    return t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) < t.stride(2)


def out_like(q):
    """An empty output for the [B, H, N, D] view q, in q's memory order: [B, N, H, D] memory seen
    as [B, H, N, D] where bnhd_order(q) (the kernel writes it through its 4-D TMA map), else
    contiguous [B, H, N, D]. The fake implementations use it too: a compiled graph sees the
    strides the kernel writes."""
    b, h, n, d = q.shape
    return q.new_empty((b, n, h, d)).transpose(1, 2) if bnhd_order(q) else q.new_empty((b, h, n, d))
