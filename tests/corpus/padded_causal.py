"""Causal attention over a right-padded batch, as transformers combines its causal mask with
padding_mask_function: a boolean [batch, kv] table read directly (padding_mask[b, kv]). The table
has 8 rows (batch index clamped), each sequence valid up to its own length.
Source: transformers (masking_utils).

PARAMS: none."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402
from _overlays import causal_mask_function, padding_mask_function  # noqa: E402

PARAMS = {}


def padding_table(N, device=None):
    keep = torch.tensor([1.0, 0.8, 0.55, 0.9, 0.3, 1.0, 0.7, 0.65])
    valid = (keep * N).long().clamp(min=1)
    return (torch.arange(N)[None, :] < valid[:, None]).to(device)


def hooks(Nq, Nk, Hq, Hkv, device):
    pad = padding_table(Nk, device)
    return Hooks(mask_mod=and_masks(causal_mask_function, padding_mask_function(pad)))


def reference(q, k, v):
    b, h, qi, ki = grids(q, k)
    pad = padding_table(k.shape[2], q.device)
    return attend(q, k, v, (ki <= qi) & pad[b.clamp(max=7), ki])
