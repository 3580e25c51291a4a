"""Causal attention with a learned relative-position bias supplied at call time (a test spec, T5
style): score + bias[h, min(q - kv, buckets - 1)]. Runtime inputs: bias [Hq, buckets] (float)."""
import math

import torch

from cubridge.inputs import RuntimeInput
from cubridge.spec import Hooks

PARAMS = {"buckets": 32}
RUNTIME_INPUTS = {"bias": RuntimeInput(("Hq", "buckets"), "float32")}


def hooks(Nq, Nk, Hq, Hkv, device, *, bias, buckets=32):
    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def score(s, b, h, q_idx, kv_idx):
        return s + bias[h, torch.clamp(q_idx - kv_idx, 0, buckets - 1)]

    return Hooks(mask_mod=mask, score_mod=score)


def reference(q, k, v, *, bias, buckets=32):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    pos = torch.arange(k.shape[2], device=q.device)
    dist = (pos[:, None] - pos[None, :]).clamp(0, buckets - 1)
    scores = scores + bias.to(scores.dtype)[:, dist]
    mask = pos[None, :] <= pos[:, None]
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
