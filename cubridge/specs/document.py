"""Document masking (several documents packed in one sequence), causal, softmax: a query sees the
keys of its own document at or before it. The document of every position is a runtime input,
`doc_ids [B, Nk]` (sorted ids, one per key position), so the mask follows each batch; a query at
absolute position q_idx belongs to document doc_ids[b, q_idx].

PARAMS: none. Runtime inputs: doc_ids (int32 or int64, [B, Nk]).
"""
import math

import torch

from cubridge.inputs import RuntimeInput
from cubridge.spec import Hooks

PARAMS = {}
RUNTIME_INPUTS = {"doc_ids": RuntimeInput(("B", "Nk"), "int32", kind="segments")}


def hooks(Nq, Nk, Hq, Hkv, device, *, doc_ids):
    def document_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return Hooks(mask_mod=document_mask)


def reference(q, k, v, *, doc_ids):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    pos = torch.arange(k.shape[2], device=q.device)     # Nq == Nk here (see specs/__init__.py)
    same = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
    mask = (pos[None, :] <= pos[:, None]) & same
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
