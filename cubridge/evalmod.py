"""Evaluating a mask_mod eagerly on index grids, as FlexAttention defines it.

FlexAttention calls a mod on scalar indices (vmapped over b, h, q, kv), so `table[b][q_idx]` and
other per-element idioms are valid mods. Cubridge's eager helpers (block tables, pair counts)
call the mod once on broadcastable grids instead, which is much faster but gives a wrong shape or
an IndexError for those idioms; then the mod is evaluated under torch.vmap as FlexAttention does.
On a CUDA device an out-of-range index is not an IndexError but a device-side assert that poisons
the process's CUDA context (session 10 H100: ag_head_mask's `table[b][h]` on [B,1,1,1] / [1,H,1,1]
grids stopped the corpus benchmark); there the grid call runs under _IndexBoundsChecked, which
raises the IndexError on the host first.

Example:
    >>> import torch
    >>> t = torch.tensor([[True, False], [False, True]])
    >>> mask_values(lambda b, h, q, kv: t[q % 2][kv % 2], *grids(1, 1, torch.arange(3), 2)).int().tolist()
    [[[[1, 0], [0, 1], [1, 0]]]]
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def grids(B: int, H: int, q_rows: torch.Tensor, Nk: int, device=None):
    """b [B,1,1,1], h [1,H,1,1], q [1,1,rows,1], kv [1,1,1,Nk]."""
    device = device or q_rows.device
    return (torch.arange(B, device=device).view(B, 1, 1, 1), torch.arange(H, device=device).view(1, H, 1, 1),
            q_rows.to(device).view(1, 1, -1, 1), torch.arange(Nk, device=device).view(1, 1, 1, Nk))


class _IndexBoundsChecked(TorchDispatchMode):
    """Tensor indexing (x[idx], index_select) with its indices checked against the sizes on the
    host first: an out-of-range index raises IndexError, as on the CPU, instead of the CUDA kernel's
    device-side assert. One host sync per indexing op: only the one-off grid call runs under it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.index.Tensor:
            src, indices = args[0], args[1]
            for dim, idx in enumerate(indices):
                if idx is not None and idx.dtype not in (torch.bool, torch.uint8):
                    _check_range(idx, src.shape[dim])
        elif func is torch.ops.aten.index_select.default:
            _check_range(args[2], args[0].shape[args[1]] if args[0].dim() else 1)
        return func(*args, **kwargs)


def _check_range(idx: torch.Tensor, size: int) -> None:
    if idx.numel() and bool(((idx >= size) | (idx < -size)).any()):
        raise IndexError(f"index out of range for a dimension of size {size}")


def _direct(fn, *args):
    """fn(*args) on the grids, index-checked on the host where they live on a GPU."""
    if any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args):
        with _IndexBoundsChecked():
            return fn(*args)
    return fn(*args)


def mask_values(mask_mod, b, h, q, kv) -> torch.Tensor:
    """The mask as a boolean tensor broadcastable to [B, H, Q, K] (grids as from `grids`)."""
    full = (b.shape[0], h.shape[1], q.shape[2], kv.shape[3])
    try:
        m = torch.as_tensor(_direct(mask_mod, b, h, q, kv), device=q.device)
        if m.dim() <= 4 and _broadcasts(m.shape, full):
            return m.bool()
    except (IndexError, RuntimeError):
        pass
    return vmapped(mask_mod, b.reshape(-1), h.reshape(-1), q.reshape(-1), kv.reshape(-1)).bool()


def score_values(score_mod, scores, b, h, q, kv) -> torch.Tensor:
    """score_mod on `scores` [B, H, Q, K] and their index grids (as `grids` gives them), called
    once on the grids, or per element under torch.vmap as FlexAttention calls it (table[i][h])."""
    try:
        out = torch.as_tensor(_direct(score_mod, scores, b, h, q, kv))
        if tuple(out.shape) == tuple(scores.shape):
            return out
    except (IndexError, RuntimeError):
        pass
    B, H, Q, K = scores.shape
    b, h, q, kv = (x.reshape(-1).expand(n) for x, n in ((b, B), (h, H), (q, Q), (kv, K)))
    fn = score_mod
    for dims in ((0, None, None, None, 0), (0, None, None, 0, None), (0, None, 0, None, None),
                 (0, 0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    return torch.as_tensor(fn(scores, b, h, q, kv))


def vmapped(mod, b, h, q, kv) -> torch.Tensor:
    """mod over 1-D index vectors, elementwise as FlexAttention calls it: [B, H, Q, K]."""
    fn = mod
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    out = fn(b, h, q, kv)
    return torch.as_tensor(out).expand(len(b), len(h), len(q), len(kv))


def _broadcasts(shape, full) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(shape), full)) == tuple(full)
    except RuntimeError:
        return False
