"""The custom ops `cubridge::attention` and `cubridge::attention_lse`, which torch.compile sees.

    attention(q, k, v, handle, scale, runtime) -> out              # q [B, Hq, N, D] (a view the kernel reads)
    attention_lse(q, k, v, handle, scale, runtime) -> (out, lse)   # lse [B, Hq, N] float32

`handle` names the TunedOp (cubridge.load's result) in this process; `runtime` are the spec's
runtime inputs in declared order. The fake implementations return empty tensors of the output
shapes, so FakeTensorMode / torch.compile(fullgraph=True) trace through without running anything.
"""
from __future__ import annotations

import torch

from cubridge.op.handles import op_for
from cubridge.runtime.fa3_fast import layout_strides


@torch.library.custom_op("cubridge::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, scale: float,
              runtime: list[torch.Tensor]) -> torch.Tensor:
    return op_for(handle).forward(*_readable(q, k, v), scale, runtime, False)[0]


@attention.register_fake
def _attention_fake(q, k, v, handle, scale, runtime):
    return q.new_empty(q.shape)


@torch.library.custom_op("cubridge::attention_lse", mutates_args=())
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, scale: float,
                  runtime: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return op_for(handle).forward(*_readable(q, k, v), scale, runtime, True)


@attention_lse.register_fake
def _attention_lse_fake(q, k, v, handle, scale, runtime):
    b, h, n, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32)


def _readable(*ts):
    """A compiler may hand the op other strides than the traced call had (inductor picks its own
    layouts): what the kernel's TMA maps cannot address is copied, as the eager path would."""
    return tuple(t if layout_strides(tuple(t.shape), tuple(t.stride()), t.element_size()) else t.contiguous()
                 for t in ts)
