"""Prefix LM as attention-gym builds it (generate_prefix_lm_mask): or_masks of a prefix mask
(kv < prefix_length) and the causal mask. Source: attention-gym.

PARAMS: prefix (tokens of the bidirectional prefix)."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import or_masks  # noqa: E402

PARAMS = {"prefix": 1024}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hooks(Nq, Nk, Hq, Hkv, device, prefix=1024):
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix

    return Hooks(mask_mod=or_masks(prefix_mask, causal_mask))


def reference(q, k, v, prefix=1024):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki <= qi) | (ki < prefix))
