"""The custom ops `cubridge::attention` and `cubridge::attention_lse`, which torch.compile sees.

    attention(q, k, v, handle, scale, runtime) -> out              # q [B, Hq, N, D] (a view the kernel reads)
    attention_lse(q, k, v, handle, scale, runtime) -> (out, lse)   # lse [B, Hq, N] float32
    attention_backward(dout, q, k, v, out, lse, handle, scale, runtime, in_place) -> (dq, dk, dv)
                                                                    # attention_lse's autograd backward;
                                                                    # in_place: gradients like q, k, v

`handle` names the TunedOp (cubridge.load's result) in this process; `runtime` are the spec's
runtime inputs in declared order. The fake implementations return empty tensors of the output
shapes, so FakeTensorMode / torch.compile(fullgraph=True) trace through without running anything.
"""
from __future__ import annotations

import torch

from cubridge.op.checks import bnhd_order, out_like, readable
from cubridge.op.handles import op_for


@torch.library.custom_op("cubridge::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, scale: float,
              runtime: list[torch.Tensor]) -> torch.Tensor:
    op = op_for(handle)
    if not runtime:
        return op.op_forward(q, k, v, scale)
    return _in_order_of(op.forward(*_readable(op, q, k, v), scale, runtime, False)[0], q)


@attention.register_fake
def _attention_fake(q, k, v, handle, scale, runtime):
    return out_like(q)


@torch.library.custom_op("cubridge::attention_lse", mutates_args=())
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, scale: float,
                  runtime: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    op = op_for(handle)
    out, lse = op.forward(*_readable(op, q, k, v), scale, runtime, True)
    return _in_order_of(out, q), lse


@attention_lse.register_fake
def _attention_lse_fake(q, k, v, handle, scale, runtime):
    b, h, n, _ = q.shape
    return out_like(q), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("cubridge::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, handle: int, scale: float,
                       runtime: list[torch.Tensor], in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from cubridge.op.autograd import run_backward
    return run_backward(op_for(handle), dout, q, k, v, out, lse, scale, runtime, in_place)


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, handle, scale, runtime, in_place):
    from cubridge.op.autograd import backward_fake
    return backward_fake(dout, q, k, v, in_place)


def _register_autograd():
    """loss.backward() through the op (cubridge/op/autograd.py): setup_context saves q, k, v, out, lse."""
    from cubridge.op import autograd
    attention_lse.register_autograd(autograd.backward, setup_context=autograd.setup_context)


_register_autograd()


def _readable(op, *ts):
    """A compiler may hand the op other strides than the traced call had (inductor picks its own
    layouts): what the kernel cannot address in place is copied, as the eager path would."""
    return tuple(readable(op, t) for t in ts)


def _in_order_of(out, q):
    """out in the memory order the fake implementation promised for q (out_like): they differ only
    where q was copied before the launch."""
    return out if bnhd_order(out) == bnhd_order(q) else out_like(q).copy_(out)
