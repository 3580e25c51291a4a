"""Document masking as attention-gym writes it (generate_doc_mask_mod): packed documents, each
token carries its document id; a query attends within its own document, and the inner mask (causal)
is applied to positions counted from the start of the document (offsets[document_id[idx]]).
Source: attention-gym (and the FlexAttention blog's jagged-sequence example).

PARAMS: lengths, the document lengths, repeated to fill the sequence."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"lengths": (700, 1500, 300, 2000, 100, 1200)}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _tables(N, lengths, device):
    document_id = doc_ids(N, lengths, device)
    counts = torch.bincount(document_id)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=device), counts.cumsum(0)[:-1]])
    return document_id, offsets


def hooks(Nq, Nk, Hq, Hkv, device, lengths=PARAMS["lengths"]):
    document_id, offsets = _tables(max(Nq, Nk), lengths, device)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        return same_doc & causal_mask(b, h, q_logical, kv_logical)

    return Hooks(mask_mod=doc_mask_mod)


def reference(q, k, v, lengths=PARAMS["lengths"]):
    b, h, qi, ki = grids(q, k)
    ids = doc_ids(max(q.shape[2], k.shape[2]), lengths, q.device)
    return attend(q, k, v, (ids[qi] == ids[ki]) & (ki <= qi))
