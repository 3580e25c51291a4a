"""StreamingLLM's attention sinks as a mask (Xiao et al., 2023): causal, the first `sinks` tokens
always visible, otherwise a recent window of `window` keys. Source: the StreamingLLM paper.

PARAMS: sinks, window."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"sinks": 4, "window": 1020}


def hooks(Nq, Nk, Hq, Hkv, device, sinks=4, window=1020):
    def sink_window(b, h, q_idx, kv_idx):
        causal = kv_idx <= q_idx
        return causal & ((kv_idx < sinks) | (q_idx - kv_idx < window))

    return Hooks(mask_mod=sink_window)


def reference(q, k, v, sinks=4, window=1020):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, (ki <= qi) & ((ki < sinks) | (qi - ki < window)))
