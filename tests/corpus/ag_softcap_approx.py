"""Tanh softcapping with attention-gym's approximate tanh (generate_tanh_softcap, approx=True): the
score_mod calls a custom op approx::tanh (exact tanh in eager mode; tanh.approx.f32 when compiled).
The tracer takes it as exact tanh and says so in its notes. Scale by a cap below the raw scores so
the cap bites. Source: attention-gym.

PARAMS: cap."""
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import attend, doc_ids, grids, scores  # noqa: E402

from cubridge.spec import Hooks  # noqa: E402

PARAMS = {"cap": 2.0}


def _register_tanh_approx():
    """attention-gym registers approx::tanh once; a second load of this spec reuses it."""
    try:
        return torch.ops.approx.tanh
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("approx::tanh", mutates_args=())
    def _tanh_approx(inp: torch.Tensor) -> torch.Tensor:
        return torch.tanh(inp)

    return torch.ops.approx.tanh


tanh_approx = _register_tanh_approx()


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hooks(Nq, Nk, Hq, Hkv, device, cap=2.0):
    def tanh_softcap_approx(score, b, h, q_idx, kv_idx):
        return cap * tanh_approx(score / cap)

    return Hooks(mask_mod=causal_mask, score_mod=tanh_softcap_approx)


def reference(q, k, v, cap=2.0):
    b, h, qi, ki = grids(q, k)
    return attend(q, k, v, ki <= qi, cap * torch.tanh(scores(q, k) / cap))
