"""padded_causal (tests/corpus/padded_causal.py) with a padding table that keeps every key: the same
mask expression, block table and generated code, the pairs of plain causal attention. For the
table's cost (session 16, var16): beside ag_causal (the same R without a table) and with the knobs
table_diag_notrim / _noclass / _nox (experiments/patches/knobs/), which are exact on this table only.

PARAMS: none."""
import sys
from pathlib import Path

import torch

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "corpus"
if str(CORPUS) not in sys.path:
    sys.path.insert(0, str(CORPUS))
from _corpus import attend, grids  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

from torch.nn.attention.flex_attention import and_masks  # noqa: E402
from _overlays import causal_mask_function, padding_mask_function  # noqa: E402

PARAMS = {}


def padding_table(N, device=None):
    return torch.ones(8, N, dtype=torch.bool, device=device)


def hooks(Nq, Nk, Hq, Hkv, device):
    pad = padding_table(Nk, device)
    return Hooks(mask_mod=and_masks(causal_mask_function, padding_mask_function(pad)))


def reference(q, k, v):
    b, h, qi, ki = grids(q, k)
    pad = padding_table(k.shape[2], q.device)
    return attend(q, k, v, (ki <= qi) & pad[b.clamp(max=7), ki])
