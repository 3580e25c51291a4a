"""Composite variant: prefix-LM mask, tanh softcap, sigmoid normalisation.

Mask (kv <= q) or (kv < P); score_mod s = softcap * tanh(s / softcap); p = sigmoid(s + bias).

PARAMS: prefix = P, None means Nk // 2; softcap = 50.0; bias, None means -log(Nk).
"""
import math

import torch

from cubridge.spec import Hooks, Normalization

PARAMS = {"prefix": None, "softcap": 50.0, "bias": None}


def hooks(Nq, Nk, Hq, Hkv, device, prefix=None, softcap=50.0, bias=None):
    P = Nk // 2 if prefix is None else prefix
    bias = -math.log(Nk) if bias is None else bias

    def prefixlm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < P)

    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return Hooks(mask_mod=prefixlm_mask, score_mod=tanh_softcap,
                 normalization=Normalization("sigmoid", bias=bias))


def reference(q, k, v, prefix=None, softcap=50.0, bias=None):
    Nk = k.shape[2]
    P = Nk // 2 if prefix is None else prefix
    bias = -math.log(Nk) if bias is None else bias
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = softcap * torch.tanh(scores / softcap)
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(Nk, device=q.device)[None, :]
    mask = (kv_idx <= q_idx) | (kv_idx < P)
    return torch.sigmoid(scores + bias).masked_fill(~mask, 0.0) @ v
