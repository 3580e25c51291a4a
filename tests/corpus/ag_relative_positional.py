"""Relative positional bias as attention-gym writes it (relative_positional score_mod): score +
(q - kv), here scaled by a small rate so that 8k tokens stay in range, causal. Source: attention-gym.

PARAMS: rate."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"rate": 0.01}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hooks(Nq, Nk, Hq, Hkv, device, rate=0.01):
    def relative_positional(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) * rate

    return Hooks(mask_mod=causal_mask, score_mod=relative_positional)


def reference(q, k, v, rate=0.01):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, ki <= qi, scores(q, k) + ((qi - ki) * rate).to(q.dtype))
