"""T5 encoder self-attention: a learned bias per (relative-position bucket, head) added to the
score, bidirectional buckets (32, max distance 128), no mask. Source: transformers (T5Attention).

PARAMS: num_buckets, max_distance."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from _t5 import bias_table, relative_position_bucket  # noqa: E402

PARAMS = {"num_buckets": 32, "max_distance": 128}


def hooks(Nq, Nk, Hq, Hkv, device, num_buckets=32, max_distance=128):
    table = bias_table(num_buckets, Hq, device)

    def t5_bias(score, b, h, q_idx, kv_idx):
        bucket = relative_position_bucket(kv_idx - q_idx, True, num_buckets, max_distance)
        return score + table[bucket, h]

    return Hooks(score_mod=t5_bias)


def reference(q, k, v, num_buckets=32, max_distance=128):
    b, h, qi, ki = grids(q, k)
    bucket = relative_position_bucket(ki - qi, True, num_buckets, max_distance)
    bias = bias_table(num_buckets, q.shape[1], q.device)[bucket, h]
    return attend(q, k, v, None, scores(q, k) + bias.to(q.dtype))
