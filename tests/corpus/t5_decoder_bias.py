"""T5 decoder self-attention: unidirectional relative-position buckets (32, max distance 128) and
a learned bias per (bucket, head), causal. Source: transformers (T5Attention, is_decoder).

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
    table = bias_table(num_buckets, Hq, device, seed=6)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def t5_decoder_bias(score, b, h, q_idx, kv_idx):
        bucket = relative_position_bucket(kv_idx - q_idx, False, num_buckets, max_distance)
        return score + table[bucket][h]

    return Hooks(mask_mod=causal, score_mod=t5_decoder_bias)


def reference(q, k, v, num_buckets=32, max_distance=128):
    b, h, qi, ki = grids(q, k)
    bucket = relative_position_bucket(ki - qi, False, num_buckets, max_distance)
    bias = bias_table(num_buckets, q.shape[1], q.device, seed=6)[bucket, h]
    return attend(q, k, v, ki <= qi, scores(q, k) + bias.to(q.dtype))
