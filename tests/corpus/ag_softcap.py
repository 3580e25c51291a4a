"""Tanh softcapping as attention-gym writes it (generate_tanh_softcap, approx=False): score ->
cap * tanh(score / cap), causal. Popularised by Gemma 2 and Grok-1. Source: attention-gym.

PARAMS: cap."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"cap": 30.0}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hooks(Nq, Nk, Hq, Hkv, device, cap=30.0):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return Hooks(mask_mod=causal_mask, score_mod=tanh_softcap)


def reference(q, k, v, cap=30.0):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, ki <= qi, cap * torch.tanh(scores(q, k) / cap))
