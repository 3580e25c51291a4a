"""GPU checks of ref_kernels/fa2_bwd_sm80 (the portable backward) under the verification rule.

golden = torch.autograd of the attention reference in float64, ref = the same autograd in the
kernel dtype; dQ, dK, dV each pass iff max|x - golden| <= 2 max|ref - golden| + 1e-5
(cubridge.rule.compare). The forward's out and natural-log LSE come from cubridge.runtime.fa2_sm80
(and from fa3_sm90 on sm_90 in one test). Also: outputs poisoned with NaN are fully written,
inputs unchanged, deterministic mode bitwise repeatable. Inputs are random normal, never zeros.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cubridge.rule import check_backward, compare

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import bwd_reference  # noqa: E402

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
# (Nq, Nk): ragged lengths (77, 300, 1000) both ways, tile multiples, one longer square.
LENGTHS = [(1, 1), (77, 77), (300, 300), (1000, 1000), (77, 300), (300, 77), (1000, 300), (300, 1000),
           (128, 128), (2048, 2048)]
HEADS = [(2, 2), (8, 2), (4, 1)]   # MHA, GQA 8/2, MQA


@pytest.fixture(scope="session")
def kernels():
    from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
    from cubridge.runtime.fa2_sm80 import Fa2Sm80
    from cubridge.runtime.launch import device_arch
    fwd, bwd = Fa2Sm80(), Fa2BwdSm80()
    arch = device_arch(torch.device("cuda"))
    jobs = [(d, t, c) for d in (64, 128) for t in (F16, BF16) for c in (False, True)]
    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:   # NVRTC releases the GIL
        list(pool.map(lambda j: fwd.build(*j, arch), jobs))
        list(pool.map(lambda j: bwd.build(*j[0], j[1], arch), [(j, det) for j in jobs for det in (False, True)]))
    print(f"\nfa2_bwd_sm80: {3 * len(jobs)} specialisations built/cached in {time.time() - t0:.1f} s")
    return fwd, bwd


def reference(q, k, v, dout, causal: bool, scale: float):
    """(dq, dk, dv) by torch.autograd of attention in q's dtype (causal end-aligned: row i sees
    keys j <= i + Nk - Nq, as the forward kernels; a row that sees no key gets zero gradients)."""
    return bwd_reference.reference(q, k, v, dout, causal, scale)[2]


def inputs(b, hq, hkv, nq, nk, d, dtype, seed, amplitude=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, hq, nq, d))
    return [(amplitude * torch.randn(s, device="cuda", generator=gen)).to(dtype) for s in shapes]


def run_case(kernels, b, hq, hkv, nq, nk, d, dtype, causal, *, deterministic, seed=0, scale=None,
             amplitude=1.0, forward="fa2"):
    fwd, bwd = kernels
    q, k, v, dout = inputs(b, hq, hkv, nq, nk, d, dtype, seed, amplitude)
    if forward == "fa3":
        from cubridge.runtime.fa3_sm90 import fa3_forward
        out, lse = fa3_forward(q, k, v, causal=causal, softmax_scale=scale)
    else:
        out, lse = fwd(q, k, v, causal=causal, sm_scale=scale)
    scale_ = 1.0 / math.sqrt(d) if scale is None else scale
    golden = reference(q.double(), k.double(), v.double(), dout.double(), causal, scale_)
    ref = reference(q, k, v, dout, causal, scale_)
    named = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    check = check_backward(lambda dq, dk, dv: bwd(dout, q, k, v, out, lse, causal=causal, sm_scale=scale,
                                                  deterministic=deterministic, dq=dq, dk=dk, dv=dv),
                           named, (q, k, v), golden, ref)
    assert check.passed, check
    grads = check.grads
    again = bwd(dout, q, k, v, out, lse, causal=causal, sm_scale=scale, deterministic=deterministic)
    torch.cuda.synchronize()
    if deterministic:
        for g, g2, name in zip(grads, again, ("dq", "dk", "dv")):
            assert torch.equal(g, g2), f"{name}: deterministic mode is not bitwise repeatable"
    else:   # dK, dV never use atomics
        assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), "dk / dv not repeatable"


def _dt(t):
    return str(t).removeprefix("torch.")


def _cases():
    for d in (64, 128):
        for dtype in (F16, BF16):
            for causal in (False, True):
                for i, (nq, nk) in enumerate(LENGTHS):
                    hq, hkv = HEADS[(i + d // 64 + int(causal)) % len(HEADS)]
                    det = (i + int(dtype == BF16)) % 2 == 1
                    b = 1 if max(nq, nk) >= 2048 else 2
                    yield pytest.param(b, hq, hkv, nq, nk, d, dtype, causal, det,
                                       id=f"d{d}-{_dt(dtype)}-{'causal' if causal else 'full'}-q{nq}-k{nk}-"
                                          f"h{hq}x{hkv}-{'det' if det else 'atomic'}")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,dtype,causal,det", list(_cases()))
def test_rule(kernels, b, hq, hkv, nq, nk, d, dtype, causal, det):
    run_case(kernels, b, hq, hkv, nq, nk, d, dtype, causal, deterministic=det)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}x{h[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_head_layout_and_mode(kernels, causal, heads, det):
    """MHA / GQA / MQA in both dQ modes at a ragged length, several seeds."""
    for seed in (1, 2):
        run_case(kernels, 2, *heads, 333, 517, 128, BF16, causal, deterministic=det, seed=seed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scale_parameter_and_large_scores(kernels, causal):
    """A non-default scale, and inputs x4 (scores up to ~+-100: P from LSE must not overflow)."""
    run_case(kernels, 1, 4, 2, 700, 900, 64, F16, causal, deterministic=False, seed=3, scale=0.3)
    run_case(kernels, 1, 4, 1, 700, 900, 64, F16, causal, deterministic=True, seed=4, amplitude=4.0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="fa3_sm90's forward needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_from_fa3_forward(kernels, causal):
    """fa3_sm90 returns natural-log LSE too: the backward works from its forward as well."""
    run_case(kernels, 2, 8, 2, 1000, 1000, 128, BF16, causal, deterministic=False, seed=5, forward="fa3")


def test_empty_lengths(kernels):
    """Nk = 0: out = 0, dq = 0. Nq = 0: dk = dv = 0."""
    _, bwd = kernels
    q, dout = (torch.randn(1, 2, 70, 128, device="cuda", dtype=BF16) for _ in range(2))
    k = torch.randn(1, 2, 0, 128, device="cuda", dtype=BF16)
    lse = torch.full((1, 2, 70), -math.inf, device="cuda")
    dq, dk, dv = bwd(dout, q, k, k.clone(), torch.zeros_like(q), lse, causal=True)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.numel() == 0
    q0 = torch.randn(1, 2, 0, 128, device="cuda", dtype=BF16)
    k = torch.randn(1, 2, 50, 128, device="cuda", dtype=BF16)
    dq, dk, dv = bwd(q0, q0, k, k.clone(), q0.clone(), torch.empty(1, 2, 0, device="cuda"))
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_runs_on_the_current_torch_stream(kernels):
    """The backward is ordered after earlier work on torch's current (non-default) stream."""
    fwd, bwd = kernels
    q, k, v, dout = inputs(1, 4, 1, 256, 256, 128, BF16, seed=6)
    out, lse = fwd(q, k, v, causal=True)
    dout_new = torch.randn_like(dout)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)   # ~10 ms: a kernel on another stream would read the old dout
        dout.copy_(dout_new)
        grads = bwd(dout, q, k, v, out, lse, causal=True)
    side.synchronize()
    golden = reference(q.double(), k.double(), v.double(), dout_new.double(), True, 128 ** -0.5)
    ref = reference(q, k, v, dout_new, True, 128 ** -0.5)
    for x, g, r in zip(grads, golden, ref):
        assert compare(x, g, r).passed


def test_rejects_bad_inputs_before_launch(kernels):
    from cubridge.errors import LaunchError
    _, bwd = kernels
    q, k, v, dout = inputs(1, 4, 2, 64, 64, 128, BF16, seed=7)
    lse = torch.zeros(1, 4, 64, device="cuda")
    with pytest.raises(LaunchError, match="lse"):
        bwd(dout, q, k, v, q.clone(), lse[..., :-1])
    with pytest.raises(LaunchError, match="dout"):
        bwd(dout.transpose(2, 3), q, k, v, q.clone(), lse)
    with pytest.raises(LaunchError, match="dk"):
        bwd(dout, q, k, v, q.clone(), lse, dk=torch.empty_like(q))


@pytest.mark.parametrize("lengths", [(333, 517), (517, 333)], ids=["q333-k517", "q517-k333"])
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_autograd_function(kernels, causal, det, lengths):
    """cubridge.runtime.autograd.attention: forward (fa3_sm90 on sm_90, else fa2_sm80) + this
    backward through torch.autograd; gradients pass the rule against autograd of the reference.
    Causal with Nq != Nk both ways (end-aligned in forward and backward; Nq > Nk: the first rows
    see no key and get zero gradients)."""
    from cubridge.runtime.autograd import attention
    q, k, v, dout = inputs(2, 8, 2, *lengths, 128, BF16, seed=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*leaves, causal=causal, deterministic=det).backward(dout)
    golden = reference(q.double(), k.double(), v.double(), dout.double(), causal, 128 ** -0.5)
    ref = reference(q, k, v, dout, causal, 128 ** -0.5)
    for name, leaf, g, r in zip(("dq", "dk", "dv"), leaves, golden, ref):
        verdict = compare(leaf.grad, g, r)
        assert verdict.passed, f"{name}: {verdict}"


def test_autograd_refuses_double_backward(kernels):
    from cubridge.runtime.autograd import attention
    q, k, v, _ = inputs(1, 2, 2, 64, 64, 64, F16, seed=9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    # A loss whose gradient w.r.t. out depends on out (as in training: dout requires grad under
    # create_graph): out.sum() would give a constant dout, so gq would not require grad at all and
    # the second backward would fail on torch's "does not require grad" before reaching ours.
    (gq,) = torch.autograd.grad((out.float() ** 2).sum(), leaves[0], create_graph=True)
    assert gq.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with @once_differentiable"):
        gq.sum().backward()
