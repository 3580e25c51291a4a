"""Prefix-LM with a per-sequence prefix length supplied at call time (a test spec): query q of
sequence b sees keys kv <= q and the first prefix_len[b] keys. Runtime inputs: prefix_len [B]."""
import math

import torch

from cubridge.spec import Hooks

RUNTIME_INPUTS = {"prefix_len": ("B",)}


def hooks(Nq, Nk, Hq, Hkv, device, *, prefix_len):
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])

    return Hooks(mask_mod=mask)


def reference(q, k, v, *, prefix_len):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    pos = torch.arange(k.shape[2], device=q.device)
    mask = (pos[None, None, :] <= pos[None, :, None]) | (pos[None, None, :] < prefix_len[:, None, None])
    mask = mask[:, None]
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
