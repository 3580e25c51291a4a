"""Causal mask as attention-gym writes it (attn_gym/masks/causal.py): a query sees every key at
or before its position. Source: attention-gym."""
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
    return Hooks(mask_mod=causal_mask)


def reference(q, k, v):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, qi >= ki)
