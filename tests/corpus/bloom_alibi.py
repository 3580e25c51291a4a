"""BLOOM's ALiBi (transformers build_alibi_tensor): slopes from the closest power of two of the head
count (the extra heads take every other slope of the next power), bias slope_h * kv added to the
scaled score, causal. Source: transformers (BLOOM).

PARAMS: none."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

import math  # noqa: E402

PARAMS = {}


def bloom_slopes(H, device=None):
    closest = 2 ** math.floor(math.log2(H))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base, dtype=torch.float32), torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != H:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        n = min(closest, H - closest)
        extra = torch.pow(torch.tensor(extra_base, dtype=torch.float32),
                          torch.arange(1, 1 + 2 * n, 2, dtype=torch.int32))
        slopes = torch.cat([slopes, extra])
    return slopes.to(device)


def hooks(Nq, Nk, Hq, Hkv, device):
    slopes = bloom_slopes(Hq, device)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def bloom_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * kv_idx

    return Hooks(mask_mod=causal, score_mod=bloom_alibi)


def reference(q, k, v):
    b, h, qi, ki = grids(q, k)
    bias = bloom_slopes(q.shape[1], q.device)[h].to(torch.float64) * ki
    return attend(q, k, v, ki <= qi, scores(q, k) + bias.to(q.dtype))
