"""Sliding window with global tokens (Longformer style), softmax.

A query sees the last `window` keys up to itself (kv <= q and q - kv < window); the first
`global_tokens` keys are seen by every query; the first `global_tokens` queries see every key
(including later ones).
Mask: (kv <= q and q - kv < window) or kv < global_tokens or q < global_tokens.

PARAMS: window = 256, global_tokens = 64 (fixed, not derived from N).
"""
import math

import torch

from cubridge.spec import Hooks

PARAMS = {"window": 256, "global_tokens": 64}


def hooks(Nq, Nk, Hq, Hkv, device, window=256, global_tokens=64):
    def global_sliding_window_mask(b, h, q_idx, kv_idx):
        in_window = (kv_idx <= q_idx) & (q_idx - kv_idx < window)
        return in_window | (kv_idx < global_tokens) | (q_idx < global_tokens)

    return Hooks(mask_mod=global_sliding_window_mask)


def reference(q, k, v, window=256, global_tokens=64):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    in_window = (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    mask = in_window | (kv_idx < global_tokens) | (q_idx < global_tokens)
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
