"""ReLU attention, causal: p = relu(score) * scale instead of softmax, scale = 1/N; no row
normalisation (no running max, no row sum, no division).

PARAMS: scale; None means 1 / Nk (N = the number of keys a row ranges over).
"""
import math

import torch

from cubridge.spec import Hooks, Normalization

PARAMS = {"scale": None}


def relu_scale(Nk, scale):
    return 1.0 / Nk if scale is None else scale


def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def hooks(Nq, Nk, Hq, Hkv, device, scale=None):
    return Hooks(mask_mod=causal_mask,
                 normalization=Normalization("relu", scale=relu_scale(Nk, scale)))


def reference(q, k, v, scale=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    p = torch.relu(scores) * relu_scale(k.shape[2], scale)
    return p.masked_fill(~(kv_idx <= q_idx), 0.0) @ v
