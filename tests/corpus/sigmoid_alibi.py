"""Sigmoid attention with ALiBi (Ramapuram et al., "Theory, Analysis, and Best Practices for
Sigmoid Self-Attention", 2024): p = sigmoid(score + alibi + b) with b = -log(n), causal, no row
normalisation. Source: the sigmoid-attention paper.

PARAMS: none (b = -log Nk)."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

import math  # noqa: E402

from cubridge.spec import Normalization  # noqa: E402

PARAMS = {}


def hooks(Nq, Nk, Hq, Hkv, device):
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def alibi(score, b, h, q_idx, kv_idx):
        slope = torch.exp2(-8.0 * (h + 1) / Hq)
        return score - slope * (q_idx - kv_idx)

    return Hooks(mask_mod=causal, score_mod=alibi, normalization=Normalization("sigmoid", bias=-math.log(Nk)))


def reference(q, k, v):
    b, h, qi, ki = grids(q, k)
    slope = torch.exp2(-8.0 * (h + 1).to(torch.float64) / q.shape[1])
    s = scores(q, k) - (slope * (qi - ki)).to(q.dtype)
    return attend(q, k, v, ki <= qi, s, norm="sigmoid", sigmoid_bias=-math.log(k.shape[2]))
