"""Shared reference helpers of the corpus specs: dense attention from explicit mask / bias
matrices, in the caller's dtype (float64 for the golden, the kernel dtype for the reference)."""
import math

import torch


def grids(q, k):
    """b [B,1,1,1], h [1,Hq,1,1], q_idx [1,1,Nq,1], kv_idx [1,1,1,Nk] (int64) for q, k."""
    B, H, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    dev = q.device
    return (torch.arange(B, device=dev).view(B, 1, 1, 1), torch.arange(H, device=dev).view(1, H, 1, 1),
            torch.arange(Nq, device=dev).view(1, 1, Nq, 1), torch.arange(Nk, device=dev).view(1, 1, 1, Nk))


def scores(q, k):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    return (q @ k.transpose(-2, -1)).div_(math.sqrt(q.shape[-1]))   # in place: one [B, H, Nq, Nk] tensor


def attend(q, k, v, mask=None, s=None, norm="softmax", sigmoid_bias=0.0):
    """softmax / sigmoid attention of scores `s` (default q k^T / sqrt(D)) under boolean `mask`
    (broadcast to [B, H, Nq, Nk]; None: all pairs). Masked pairs weigh 0; a fully masked softmax
    row gives 0. `s` is the caller's fresh tensor and is overwritten: the float64 golden at 4.5k+
    tokens held four [B, H, Nq, Nk] copies and ran out of GPU memory under 12 test workers (session
    10 H100, test_fa3_sm90_d256's gemma2_local); in place it holds two."""
    group = q.shape[1] // k.shape[1]
    v = v.repeat_interleave(group, dim=1)
    s = scores(q, k) if s is None else s
    drop = ~(torch.ones((), dtype=torch.bool, device=q.device) if mask is None else mask)
    if norm == "softmax":
        p = torch.softmax(s.masked_fill_(drop, float("-inf")), dim=-1)
    else:
        p = torch.sigmoid(s.add_(sigmoid_bias))
    del s
    return p.masked_fill_(drop, 0.0).to(v.dtype) @ v


def doc_ids(N, lengths, device=None):
    """Document id of each of N tokens for documents of the given lengths, repeated to cover N."""
    ids, doc, pos = [], 0, 0
    while pos < N:
        n = lengths[doc % len(lengths)]
        ids += [doc] * n
        pos += n
        doc += 1
    return torch.tensor(ids[:N], device=device)
