"""Document masking around a sliding window (attention-gym's generate_doc_mask_mod with
generate_sliding_window as the inner mask): within each packed document, causal, and at most
`window` keys back. Source: attention-gym.

PARAMS: lengths (document lengths, repeated), window."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402

PARAMS = {"lengths": (700, 1500, 300, 2000, 100, 1200), "window": 256}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hooks(Nq, Nk, Hq, Hkv, device, lengths=PARAMS["lengths"], window=256):
    document_id = doc_ids(max(Nq, Nk), lengths, device)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                         torch.bincount(document_id).cumsum(0)[:-1]])

    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    inner = and_masks(causal_mask, sliding_window)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        return same_doc & inner(b, h, q_logical, kv_logical)

    return Hooks(mask_mod=doc_mask_mod)


def reference(q, k, v, lengths=PARAMS["lengths"], window=256):
    b, h, qi, ki = grids(q, k)
    ids = doc_ids(max(q.shape[2], k.shape[2]), lengths, q.device)
    return attend(q, k, v, (ids[qi] == ids[ki]) & (ki <= qi) & (qi - ki <= window))
