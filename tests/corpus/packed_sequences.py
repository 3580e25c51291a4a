"""Packed sequences as transformers masks them (packed_sequence_mask_function): an integer table
[batch, N] of sequence ids per token, a query attends to earlier keys of its own sequence.
8 rows (batch index clamped), each packed from different lengths. Source: transformers (masking_utils).

PARAMS: none."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402
from _overlays import causal_mask_function, packed_sequence_mask_function  # noqa: E402

PARAMS = {}
_LENGTHS = ((90, 40, 170), (300,), (25, 60, 35, 80), (130, 130), (64,), (200, 20), (45, 90, 45), (70, 70, 70))


def packed_table(N, device=None):
    scale = max(1.0, N / 300)      # the same layout in proportion at any length
    rows = [doc_ids(N, [max(1, int(n * scale)) for n in lens]) for lens in _LENGTHS]
    return torch.stack(rows).to(device)


def hooks(Nq, Nk, Hq, Hkv, device):
    ids = packed_table(max(Nq, Nk), device)
    return Hooks(mask_mod=and_masks(causal_mask_function, packed_sequence_mask_function(ids)))


def reference(q, k, v):
    b, h, qi, ki = grids(q, k)
    ids = packed_table(max(q.shape[2], k.shape[2]), q.device)
    bb = b.clamp(max=7)
    return attend(q, k, v, (ki <= qi) & (ids[bb, qi] == ids[bb, ki]))
