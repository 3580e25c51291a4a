"""padded_causal (tests/corpus/padded_causal.py) with a padding table that keeps every key: the same
mask expression, block table and generated code, the pairs of plain causal attention. For the
table's cost (session 16, var16): beside ag_causal (the same R without a table) and with the knobs
table_diag_notrim / _noclass / _nox (experiments/patches/knobs/), which are exact on this table only.

PARAMS: none."""
import importlib.util
from pathlib import Path

import torch

from cubridge.spec import Hooks

_SPEC = importlib.util.spec_from_file_location(
    "_corpus_padded_causal", Path(__file__).resolve().parents[2] / "tests" / "corpus" / "padded_causal.py")
_PADDED = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_PADDED)           # (puts tests/corpus on the path for its own imports)

PARAMS = {}


def padding_table(N, device=None):
    return torch.ones(8, N, dtype=torch.bool, device=device)


def hooks(Nq, Nk, Hq, Hkv, device):
    pad = padding_table(Nk, device)
    return Hooks(mask_mod=_PADDED.and_masks(_PADDED.causal_mask_function, _PADDED.padding_mask_function(pad)))


def reference(q, k, v):
    b, h, qi, ki = _PADDED.grids(q, k)
    pad = padding_table(k.shape[2], q.device)
    return _PADDED.attend(q, k, v, (ki <= qi) & pad[b.clamp(max=7), ki])
