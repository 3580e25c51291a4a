"""A block-sparse layout stored as bits: for query block i, bit j of word j // 31 says whether key
block j is attended (31 bits a word, so every word is a non-negative int32), plus the diagonal;
causal. Read with shifts and masks: (words[i, j // 31] >> (j % 31)) & 1. Models how BigBird-style
random block layouts are stored compactly. Source: written for this corpus (bit-shift path).

PARAMS: block, density."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"block": 128, "density": 0.3}


def layout_words(N, block, density, device=None):
    nb = -(-N // block)
    g = torch.Generator().manual_seed(11)
    dense = torch.rand(nb, nb, generator=g) < density
    words = torch.zeros(nb, -(-nb // 31), dtype=torch.int32)
    for j in range(nb):
        words[:, j // 31] |= dense[:, j].to(torch.int32) << (j % 31)
    return words.to(device)


def hooks(Nq, Nk, Hq, Hkv, device, block=128, density=0.3):
    words = layout_words(max(Nq, Nk), block, density, device)

    def packed_blocks(b, h, q_idx, kv_idx):
        i, j = q_idx // block, kv_idx // block
        bit = (words[i, j // 31] >> (j % 31)) & 1
        return (kv_idx <= q_idx) & ((bit == 1) | (i == j))

    return Hooks(mask_mod=packed_blocks)


def reference(q, k, v, block=128, density=0.3):
    b, h, qi, ki = grids(q, k)
    words = layout_words(max(q.shape[2], k.shape[2]), block, density, q.device).long()
    i, j = qi // block, ki // block
    bit = (words[i, j // 31] >> (j % 31)) & 1
    return attend(q, k, v, (ki <= qi) & ((bit == 1) | (i == j)))
