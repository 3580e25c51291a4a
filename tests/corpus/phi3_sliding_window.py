"""Phi-3 (mini) sliding-window attention: transformers' causal mask and sliding-window overlay with
the model's sliding_window = 2047 (an odd window: no tile boundary lines up with it).
Source: transformers (Phi-3).

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

PARAMS = {"window": 2047}


def hooks(Nq, Nk, Hq, Hkv, device, window=2047):
    return Hooks(mask_mod=and_masks(causal_mask_function, sliding_window_overlay(window)))


def reference(q, k, v, window=2047):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki <= qi) & (qi - ki < window))
