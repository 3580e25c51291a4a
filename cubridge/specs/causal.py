"""Causal softmax attention: query q sees keys kv <= q (positions; with Nq < Nk the queries sit at
the end of the keys, cubridge/specs/__init__.py)."""
import math

import torch

PARAMS = {}


def mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def reference(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = kv_idx <= q_idx
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v  # a row with no key would be NaN: make it 0
