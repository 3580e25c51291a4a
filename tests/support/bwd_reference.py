"""The dense backward's test reference, shared by the CPU emulator and interpreter tests."""
from __future__ import annotations

import math

import torch


def reference(q, k, v, dout, causal, scale):
    """(out, lse, (dq, dk, dv)) by torch.autograd in q's dtype (top-left causal, GQA by repeat)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None], -math.inf)
    out = torch.softmax(s, dim=-1) @ v.repeat_interleave(group, 1)
    out.backward(dout)
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), (q.grad, k.grad, v.grad)
