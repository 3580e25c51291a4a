"""Longformer's attention pattern (Beltagy et al., 2020): a bidirectional sliding window of w
keys either side, plus global tokens that attend everywhere and are seen by every query.
Source: the Longformer paper.

PARAMS: window (each side), global_tokens."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"window": 256, "global_tokens": 16}


def hooks(Nq, Nk, Hq, Hkv, device, window=256, global_tokens=16):
    def longformer(b, h, q_idx, kv_idx):
        local = torch.abs(q_idx - kv_idx) <= window
        is_global = (q_idx < global_tokens) | (kv_idx < global_tokens)
        return local | is_global

    return Hooks(mask_mod=longformer)


def reference(q, k, v, window=256, global_tokens=16):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, ((qi - ki).abs() <= window) | (qi < global_tokens) | (ki < global_tokens))
