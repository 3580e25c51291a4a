"""Block-causal softmax attention: tokens are grouped in blocks of `block`; a query sees every key
of its own block (also later ones) and of all earlier blocks. Mask: q // block >= kv // block.

PARAMS: block = 256 (fixed, not derived from N).
"""
import math

import torch

from cubridge.spec import Hooks

PARAMS = {"block": 256}


def hooks(Nq, Nk, Hq, Hkv, device, block=256):
    def causal_blockwise_mask(b, h, q_idx, kv_idx):
        return q_idx // block >= kv_idx // block

    return Hooks(mask_mod=causal_blockwise_mask)


def reference(q, k, v, block=256):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = q_idx // block >= kv_idx // block
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
