"""ALiBi as attention-gym writes it (generate_alibi_bias): per-head slope 2^(-8 (h + 1) / H)
computed inside the score_mod from h, bias = slope * (kv - q), causal. Source: attention-gym.

PARAMS: none (H is the number of query heads)."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hooks(Nq, Nk, Hq, Hkv, device):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / Hq))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return Hooks(mask_mod=causal_mask, score_mod=alibi_mod)


def reference(q, k, v):
    b, h, qi, ki = grids(q, k)
    slope = torch.exp2(-(h + 1).to(torch.float64) * 8.0 / q.shape[1])
    s = scores(q, k) + ((ki - qi) * slope).to(q.dtype)
    return attend(q, k, v, ki <= qi, s)
