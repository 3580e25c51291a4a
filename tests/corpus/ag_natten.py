"""2-D neighbourhood attention (NATTEN) as attention-gym writes it (generate_natten): tokens of a
H x W canvas in row-major order; a query attends to the kernel_h x kernel_w neighbourhood around
it, the window clamped to stay inside the canvas. Source: attention-gym.

PARAMS: canvas (H, W), kernel (kh, kw)."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"canvas": (64, 128), "kernel": (13, 13)}


def hooks(Nq, Nk, Hq, Hkv, device, canvas=(64, 128), kernel=(13, 13)):
    H, W = canvas
    kh, kw = kernel

    def get_x_y(idx):
        return idx // W, idx % W

    def natten_mask_mod(b, h, q_idx, kv_idx):
        q_x, q_y = get_x_y(q_idx)
        kv_x, kv_y = get_x_y(kv_idx)
        kernel_x = q_x.clamp(kh // 2, (H - 1) - kh // 2)
        kernel_y = q_y.clamp(kw // 2, (W - 1) - kw // 2)
        hori_mask = (kernel_x - kv_x).abs() <= kh // 2
        vert_mask = (kernel_y - kv_y).abs() <= kw // 2
        return hori_mask & vert_mask

    return Hooks(mask_mod=natten_mask_mod)


def reference(q, k, v, canvas=(64, 128), kernel=(13, 13)):
    H, W = canvas
    kh, kw = kernel
    b, h, qi, ki = grids(q, k)
    cx = torch.clamp(qi // W, kh // 2, H - 1 - kh // 2)
    cy = torch.clamp(qi % W, kw // 2, W - 1 - kw // 2)
    return attend(q, k, v, ((cx - ki // W).abs() <= kh // 2) & ((cy - ki % W).abs() <= kw // 2))
