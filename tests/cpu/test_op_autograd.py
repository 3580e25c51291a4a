"""Autograd through the tuned op on CPU (cubridge/op/autograd.py): loss.backward() reaches the
backward op with the forward's saved tensors, gradients arrive in the caller's layout, the LSE is
not differentiable, torch.compile traces forward and backward (the backward graph holds
cubridge::attention_backward), FakeTensorMode runs both, and what the backward cannot do is refused
at the forward. The launches are stubbed (forward: out = q; backward: a recognisable function of
its inputs); the kernels' gradients are checked in test_bwd_variants.py and tests/gpu/test_bwd_op.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cubridge.errors import LaunchError
from cubridge.op.autograd import check_trainable
from support.tuned_run import cpu_op, replayed_run

BF = torch.bfloat16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return replayed_run(tmp_path_factory.mktemp("op_autograd"), "prefixlm",
                        "{heads_q: 8, heads_kv: 2, head_dim: 128, lengths: [1024]}", trials=2).output


def stubbed(run_dir, calls):
    """Forward: out = q, lse = scale. Backward: dq = dout * 2 + lse, dk = k * 3, dv = v + out.sum()."""
    def backward_impl(dout, q, k, v, out, lse, scale, rt):
        calls.append((tuple(dout.shape), tuple(q.shape), scale))
        return (dout * 2 + lse[..., None]).to(q.dtype).contiguous(), (k * 3).contiguous(), (v + out.sum()).contiguous()
    return cpu_op(run_dir, lambda q, k, v, out, lse, scale: (out.copy_(q), lse.fill_(scale)), backward_impl)


def leaves(b=2, n=64, hq=8, hkv=2, d=128):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(b, h, n, d, generator=g).to(BF).requires_grad_() for h in (hq, hkv, hkv)]


def test_loss_backward_reaches_the_backward_with_saved_tensors(run_dir):
    calls = []
    attn = stubbed(run_dir, calls)
    q, k, v = leaves()
    out = attn(q, k, v, scale=0.5)
    assert out.requires_grad and torch.equal(out, q.detach())
    dout = torch.randn_like(out)
    out.backward(dout)
    assert calls == [((2, 8, 64, 128), (2, 8, 64, 128), 0.5)]
    assert torch.equal(q.grad, (dout * 2 + 0.5).to(BF)) and torch.equal(k.grad, k.detach() * 3)
    assert torch.equal(v.grad, v.detach() + q.detach().sum())


def test_gradients_come_back_in_the_callers_layout(run_dir):
    attn = stubbed(run_dir, [])
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves())   # [B, N, H, D]
    out = attn(q, k, v, layout="bnhd")
    out.backward(torch.ones_like(out))
    assert q.grad.shape == q.shape and torch.equal(q.grad, torch.full_like(q, 2.0 + 1 / 128 ** 0.5))
    assert k.grad.shape == k.shape and torch.equal(k.grad, k.detach() * 3)


def test_lse_is_not_differentiable(run_dir):
    attn = stubbed(run_dir, [])
    out, lse = attn(*leaves(), return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_torch_compile_traces_forward_and_backward(run_dir):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    calls, graphs = [], {}
    attn = stubbed(run_dir, calls)

    def recorder(kind):
        def compiler(gm, inputs):
            graphs[kind] = str(gm.graph)
            return make_boxed_func(gm.forward)
        return compiler
    backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))
    q, k, v = leaves()
    loss = torch.compile(lambda q, k, v: attn(q, k, v).float().square().sum(), fullgraph=True, backend=backend)(q, k, v)
    loss.backward()
    assert "cubridge.attention_lse" in graphs["fw"] and "cubridge.attention_backward" in graphs["bw"]
    assert len(calls) == 1 and q.grad is not None and q.grad.shape == q.shape
    torch.testing.assert_close(q.grad, (4 * q.detach().float() + 1 / 128 ** 0.5).to(BF), rtol=0.02, atol=0.02)


def test_fake_tensor_mode_runs_forward_and_backward(run_dir):
    from torch._subclasses.fake_tensor import FakeTensorMode
    attn = stubbed(run_dir, [])
    q, k, v = (t.detach() for t in leaves())
    attn(q, k, v)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t).requires_grad_() for t in (q, k, v))
        attn(fq, fk, fv).sum().backward()
        assert fq.grad.shape == q.shape and fk.grad.shape == k.shape and fv.grad.dtype == BF
    x = [q, k, v]
    out = q.clone()
    torch.library.opcheck(torch.ops.cubridge.attention_backward.default,
                          (out, *x, out, torch.zeros(2, 8, 64), attn.handle, 0.125, [], False),
                          test_utils=("test_schema", "test_faketensor"))


def test_what_the_backward_cannot_do_is_refused_at_the_forward():
    op = SimpleNamespace(dispatch={"spec_name": "doc"}, head_dim=128, dtype=BF)
    with pytest.raises(LaunchError, match="runtime inputs; the backward does not bind them(.|\n)*torch.no_grad"):
        check_trainable(op, [torch.zeros(3)])
    op = SimpleNamespace(dispatch={"spec_name": "x"}, head_dim=96, dtype=BF)
    with pytest.raises(LaunchError, match=r"D in \(64, 128\).*this run is D=96"):
        check_trainable(op, [])
