"""The dense backward's test reference, shared by the CPU emulator / interpreter tests and the GPU
tests of both backward kernels."""
from __future__ import annotations

import math

import torch


def causal_keep(nq: int, nk: int, device=None) -> torch.Tensor:
    """[Nq, Nk] bool: query row i sees key j iff j <= i + Nk - Nq (queries aligned to the end of the
    keys, as the forward kernels and FlashAttention place them)."""
    rows = torch.arange(nq, device=device)[:, None] + (nk - nq)
    return torch.arange(nk, device=device)[None, :] <= rows


def reference(q, k, v, dout, causal, scale):
    """(out, lse, (dq, dk, dv)) by torch.autograd in q's dtype (end-aligned causal, GQA by repeat).
    A row that sees no key (causal, Nq > Nk) has out = 0, lse = -inf and contributes nothing: its
    probabilities are computed on unmasked scores and multiplied by 0, so no NaN of an all -inf
    softmax reaches a gradient."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    nq, nk = s.shape[-2:]
    keep = causal_keep(nq, nk, s.device) if causal else torch.ones(nq, nk, dtype=torch.bool, device=s.device)
    seen = keep.any(-1, keepdim=True)                          # rows with at least one key
    s = s.masked_fill(~keep & seen, -math.inf)                 # empty rows keep finite scores ...
    p = torch.softmax(s, dim=-1) * seen                        # ... and are zeroed here
    out = p @ v.repeat_interleave(group, 1)
    out.backward(dout)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~seen[..., 0], -math.inf)
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)
