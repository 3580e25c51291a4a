"""Qwen2 sliding-window layers (use_sliding_window, layers past max_window_layers): causal and
kv > q - window, window 4096. Source: transformers (Qwen2).

PARAMS: window."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402
from _overlays import causal_mask_function, sliding_window_overlay  # noqa: E402

PARAMS = {"window": 4096}


def hooks(Nq, Nk, Hq, Hkv, device, window=4096):
    return Hooks(mask_mod=and_masks(causal_mask_function, sliding_window_overlay(window)))


def reference(q, k, v, window=4096):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki <= qi) & (qi - ki < window))
