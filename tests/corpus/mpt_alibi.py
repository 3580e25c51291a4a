"""MPT's ALiBi (transformers / llm-foundry build_alibi_bias): slopes 1 / 2^(m * bias_max / H')
for H' the next power of two (interleaved when H is not one), bias slope_h * (kv - (Nk - 1)),
the distance to the last key, causal. Source: transformers (MPT).

PARAMS: alibi_bias_max."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

import math  # noqa: E402

PARAMS = {"alibi_bias_max": 8}


def mpt_slopes(H, alibi_bias_max=8, device=None):
    n = 2 ** math.ceil(math.log2(H))
    m = torch.arange(1, n + 1, dtype=torch.float32) * (alibi_bias_max / n)
    slopes = 1.0 / torch.pow(2, m)
    if n != H:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:H]
    return slopes.to(device)


def hooks(Nq, Nk, Hq, Hkv, device, alibi_bias_max=8):
    slopes = mpt_slopes(Hq, alibi_bias_max, device)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def mpt_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - (Nk - 1))

    return Hooks(mask_mod=causal, score_mod=mpt_alibi)


def reference(q, k, v, alibi_bias_max=8):
    b, h, qi, ki = grids(q, k)
    bias = mpt_slopes(q.shape[1], alibi_bias_max, q.device)[h].to(torch.float64) * (ki - (k.shape[2] - 1))
    return attend(q, k, v, ki <= qi, scores(q, k) + bias.to(q.dtype))
