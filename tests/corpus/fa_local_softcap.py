"""FlashAttention's local attention with softcap (flash_attn_func(window_size=(left, right),
softcap=c)): keys from q - left to q + right, and c * tanh(score / c). Source: FlashAttention.

PARAMS: left, right, softcap."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"left": 1024, "right": 256, "softcap": 30.0}


def hooks(Nq, Nk, Hq, Hkv, device, left=1024, right=256, softcap=30.0):
    def local(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    def cap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return Hooks(mask_mod=local, score_mod=cap)


def reference(q, k, v, left=1024, right=256, softcap=30.0):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki >= qi - left) & (ki <= qi + right), softcap * torch.tanh(scores(q, k) / softcap))
