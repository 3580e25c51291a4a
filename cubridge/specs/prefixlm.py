"""Prefix-LM softmax attention: every query sees the first P keys (the prefix, bidirectional) and,
beyond it, keys kv <= q (causal). Mask: (kv <= q) or (kv < P).

PARAMS: prefix = P; None means P = Nk // 2 (N/2, rounded down for odd N).
"""
import math

import torch

from cubridge.spec import Hooks

PARAMS = {"prefix": None}


def prefix_length(Nk, prefix):
    return Nk // 2 if prefix is None else prefix


def hooks(Nq, Nk, Hq, Hkv, device, prefix=None):
    P = prefix_length(Nk, prefix)

    def prefixlm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < P)

    return Hooks(mask_mod=prefixlm_mask)


def reference(q, k, v, prefix=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = (kv_idx <= q_idx) | (kv_idx < prefix_length(k.shape[2], prefix))
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
