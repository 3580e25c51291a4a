"""Gemma 2 local layers: causal, sliding window 4096 (kv > q - window) and attention-logit
softcapping 50 * tanh(score / 50). (Gemma 2 scales scores by query_pre_attn_scalar^-1/2, which
equals 1/sqrt(D) for the 9B model; the kernel keeps 1/sqrt(D).) Source: transformers (Gemma 2).

PARAMS: window, softcap."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402
from _overlays import causal_mask_function, sliding_window_overlay  # noqa: E402

PARAMS = {"window": 4096, "softcap": 50.0}


def hooks(Nq, Nk, Hq, Hkv, device, window=4096, softcap=50.0):
    def softcap_mod(score, b, h, q_idx, kv_idx):
        score = score / softcap
        score = torch.tanh(score)
        return score * softcap

    return Hooks(mask_mod=and_masks(causal_mask_function, sliding_window_overlay(window)), score_mod=softcap_mod)


def reference(q, k, v, window=4096, softcap=50.0):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki <= qi) & (qi - ki < window), softcap * torch.tanh(scores(q, k) / softcap))
