"""ModernBERT local attention layers: bidirectional, keys within local_attention / 2 of the query
(|q - kv| <= 64 for a 128-token window). Source: transformers (ModernBERT).

PARAMS: local_attention."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"local_attention": 128}


def hooks(Nq, Nk, Hq, Hkv, device, local_attention=128):
    half = local_attention // 2

    def local_mask(b, h, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs()
        return distance <= half

    return Hooks(mask_mod=local_mask)


def reference(q, k, v, local_attention=128):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (qi - ki).abs() <= local_attention // 2)
