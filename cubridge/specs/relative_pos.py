"""ALiBi relative-position bias, causal, softmax: score - slope_h * (q - kv), with slopes
slope_h = 2^(-8 (h + 1) / H) for query head h, H = Hq.

The hooks capture the slopes as a float64 tensor on the device (exact for any H) and cast the
bias to the score's dtype, so a bf16 run stays bf16. PARAMS: none.
"""
import math

import torch

from cubridge.spec import Hooks

PARAMS = {}


def alibi_slopes(H, dtype, device):
    return torch.exp2(-8 * torch.arange(1, H + 1, dtype=dtype, device=device) / H)


def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def hooks(Nq, Nk, Hq, Hkv, device):
    slopes = alibi_slopes(Hq, torch.float64, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - (slopes[h] * (q_idx - kv_idx)).to(score.dtype)

    return Hooks(mask_mod=causal_mask, score_mod=alibi)


def reference(q, k, v):
    H = q.shape[1]
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    distance = (q_idx - kv_idx).to(q.dtype)
    scores = scores - alibi_slopes(H, q.dtype, q.device)[:, None, None] * distance
    mask = kv_idx <= q_idx
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
