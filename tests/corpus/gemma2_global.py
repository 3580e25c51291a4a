"""Gemma 2 global layers: causal with attention-logit softcapping 50 * tanh(score / 50).
Source: transformers (Gemma 2).

PARAMS: softcap."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from _overlays import causal_mask_function  # noqa: E402

PARAMS = {"softcap": 50.0}


def hooks(Nq, Nk, Hq, Hkv, device, softcap=50.0):
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return Hooks(mask_mod=causal_mask_function, score_mod=softcap_mod)


def reference(q, k, v, softcap=50.0):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, ki <= qi, softcap * torch.tanh(scores(q, k) / softcap))
