"""Per-head, per-batch masks read from captured boolean tables, as attention-gym's examples index
captured tensors step by step (table[b][h]): a head is either causal or a causal sliding window,
chosen by a boolean table [B_max, H]. Source: attention-gym (captured-tensor indexing pattern).

PARAMS: window."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"window": 512}


def hooks(Nq, Nk, Hq, Hkv, device, window=512):
    g = torch.Generator().manual_seed(7)
    local = (torch.rand(8, Hq, generator=g) < 0.5).to(device)

    def head_mask(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        windowed = causal & (q_idx - kv_idx <= window)
        return torch.where(local[b][h], windowed, causal)

    return Hooks(mask_mod=head_mask)


def reference(q, k, v, window=512):
    b, h, qi, ki = grids(q, k)
    g = torch.Generator().manual_seed(7)
    local = (torch.rand(8, q.shape[1], generator=g) < 0.5).to(q.device)
    lb = local[b.clamp(max=7), h]
    return attend(q, k, v, (ki <= qi) & (~lb | (qi - ki <= window)))
