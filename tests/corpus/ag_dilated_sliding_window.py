"""Dilated sliding window as attention-gym writes it (generate_dilated_sliding_window): keys within
`window` of the query (either side) whose distance is a multiple of `dilation`. Source: attention-gym.

PARAMS: window, dilation."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"window": 1024, "dilation": 4}


def hooks(Nq, Nk, Hq, Hkv, device, window=1024, dilation=4):
    def dilated_sliding_window(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        in_window = diff <= window
        is_dilated = (diff % dilation) == 0
        return in_window & is_dilated

    return Hooks(mask_mod=dilated_sliding_window)


def reference(q, k, v, window=1024, dilation=4):
    b, h, qi, ki = grids(q, k)
    d = (qi - ki).abs()
    return attend(q, k, v, (d <= window) & (d % dilation == 0))
