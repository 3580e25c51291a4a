"""The custom ops `cubridge::attention` and `cubridge::attention_lse`, which torch.compile sees.

    attention(q, k, v, handle, scale, runtime) -> out              # q [B, Hq, N, D] (a view the kernel reads)
    attention_lse(q, k, v, handle, scale, runtime) -> (out, lse)   # lse [B, Hq, N] float32

`handle` names the TunedOp (cubridge.load's result) in this process; `runtime` are the spec's
runtime inputs in declared order. The fake implementations return empty tensors of the output
shapes, so FakeTensorMode / torch.compile(fullgraph=True) trace through without running anything.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("cubridge::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, scale: float,
              runtime: list[torch.Tensor]) -> torch.Tensor:
    from cubridge.op.tuned import op_for
    return op_for(handle).forward(q, k, v, scale, runtime, False)[0]


@attention.register_fake
def _attention_fake(q, k, v, handle, scale, runtime):
    return q.new_empty(q.shape)


@torch.library.custom_op("cubridge::attention_lse", mutates_args=())
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, scale: float,
                  runtime: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from cubridge.op.tuned import op_for
    return op_for(handle).forward(q, k, v, scale, runtime, True)


@attention_lse.register_fake
def _attention_lse_fake(q, k, v, handle, scale, runtime):
    b, h, n, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32)
