"""Llama 4 chunked attention (local layers): causal within fixed chunks of 8192 tokens, as
transformers' chunked_overlay writes it (kv // chunk == q // chunk). Source: transformers (Llama 4).

PARAMS: chunk."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402
from _overlays import causal_mask_function, chunked_overlay  # noqa: E402

PARAMS = {"chunk": 8192}


def hooks(Nq, Nk, Hq, Hkv, device, chunk=8192):
    return Hooks(mask_mod=and_masks(causal_mask_function, chunked_overlay(chunk)))


def reference(q, k, v, chunk=8192):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki <= qi) & (ki // chunk == qi // chunk))
