"""Prefix-LM attention given only as a PyTorch reference (no mask_mod, no hooks): the rules proposer
cannot trace it; an LLM proposer can transfer it. Mask: (kv <= q) or (kv < Nk // 2)."""
import math

import torch

PARAMS = {}


def reference(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = (kv_idx <= q_idx) | (kv_idx < k.shape[2] // 2)
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
