"""Causal sliding window as attention-gym builds it (generate_sliding_window): FlexAttention's
and_masks of the causal mask and a window mask q - kv <= window. Source: attention-gym.

PARAMS: window (keys before the query that stay visible)."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402

PARAMS = {"window": 1024}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hooks(Nq, Nk, Hq, Hkv, device, window=1024):
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    return Hooks(mask_mod=and_masks(causal_mask, sliding_window))


def reference(q, k, v, window=1024):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki <= qi) & (qi - ki <= window))
