"""LongT5 local attention: each token attends to keys within `radius` on either side, with T5's
bidirectional bucket bias (32 buckets, max distance 128). Source: transformers (LongT5LocalAttention).

PARAMS: radius."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from _t5 import bias_table, relative_position_bucket  # noqa: E402

PARAMS = {"radius": 127}


def hooks(Nq, Nk, Hq, Hkv, device, radius=127):
    table = bias_table(32, Hq, device, seed=8)

    def local(b, h, q_idx, kv_idx):
        return torch.abs(q_idx - kv_idx) <= radius

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[relative_position_bucket(kv_idx - q_idx, True, 32, 128), h]

    return Hooks(mask_mod=local, score_mod=bias)


def reference(q, k, v, radius=127):
    b, h, qi, ki = grids(q, k)
    bias = bias_table(32, q.shape[1], q.device, seed=8)[relative_position_bucket(ki - qi, True, 32, 128), h]
    return attend(q, k, v, (qi - ki).abs() <= radius, scores(q, k) + bias.to(q.dtype))
