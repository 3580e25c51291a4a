"""GPU checks of ref_kernels/fa3_bwd_sm90 (the Hopper backward) under the verification rule.

golden = torch.autograd of the attention reference in float64, ref = the same autograd in the
kernel dtype; dQ, dK, dV each pass iff max|x - golden| <= 2 max|ref - golden| + 1e-5
(cubridge.rule.compare). out and the natural-log LSE come from the Hopper forward (fa3_sm90).
Also: outputs poisoned with NaN are fully written, inputs unchanged, dK / dV (no atomics) bitwise
repeatable. Inputs are random normal, never zeros. Needs an sm_90 GPU (skipped otherwise).

Every kernel test runs once per performance option (cubridge.runtime.fa3_bwd_sm90.OPTIONS; the
test id starts with it). CUBRIDGE_BWD_OPTIONS=bulk,base
narrows the set (one option per pytest process runs them side by side).
"""
from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from cubridge.rule import compare

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import bwd_reference  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="fa3_bwd_sm90 needs an sm_90 GPU (H100 / H200)")]

F16, BF16 = torch.float16, torch.bfloat16
# (Nq, Nk): ragged 77 / 300 / 1000 both ways, one key tile, a single row, a longer square.
LENGTHS = [(77, 77), (300, 300), (1000, 1000), (77, 300), (300, 77), (1000, 300), (300, 1000),
           (128, 128), (1, 1), (2048, 2048)]
HEADS = [(2, 2), (8, 2), (4, 1)]   # MHA, GQA 8/2, MQA


def _options() -> list[str]:
    from cubridge.runtime.fa3_bwd_sm90 import OPTIONS
    wanted = [o for o in os.environ.get("CUBRIDGE_BWD_OPTIONS", "").split(",") if o]
    unknown = sorted(set(wanted) - set(OPTIONS))
    if unknown:   # a typo must not silently select nothing
        raise ValueError(f"CUBRIDGE_BWD_OPTIONS: unknown option(s) {unknown}; known: {sorted(OPTIONS)}")
    return wanted or list(OPTIONS)


@pytest.fixture(scope="session", params=_options())
def bwd(request):
    """fa3_backward with one performance option (every specialisation built first)."""
    from cubridge.runtime import fa3_bwd_sm90
    for d in (64, 128):
        for causal in (False, True):
            for bf16 in (False, True):
                fa3_bwd_sm90.build_cubin(d, causal, bf16, option=request.param)
    return functools.partial(fa3_bwd_sm90.fa3_backward, option=request.param)


def reference(q, k, v, dout, causal: bool, scale: float):
    """(dq, dk, dv) by torch.autograd of attention in q's dtype (causal end-aligned: row i sees
    keys j <= i + Nk - Nq, as the forward kernels; a row that sees no key gets zero gradients)."""
    return bwd_reference.reference(q, k, v, dout, causal, scale)[2]


def run_case(bwd, b, hq, hkv, nq, nk, d, dtype, causal, *, seed=0, scale=None, amplitude=1.0):
    from cubridge.runtime.fa3_sm90 import fa3_forward
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, hq, nq, d))
    q, k, v, dout = [(amplitude * torch.randn(s, device="cuda", generator=gen)).to(dtype) for s in shapes]
    out, lse = fa3_forward(q, k, v, causal=causal, softmax_scale=scale)
    saved = [t.clone() for t in (q, k, v, dout, out, lse)]
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    bwd(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, dq=grads[0], dk=grads[1], dv=grads[2])
    again = bwd(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    torch.cuda.synchronize()
    for g, name in zip(grads, ("dq", "dk", "dv")):
        assert not g.isnan().any(), f"{name}: {int(g.isnan().sum())} elements never written (or NaN)"
    for t, s, name in zip((q, k, v, dout, out, lse), saved, ("q", "k", "v", "dout", "out", "lse")):
        assert torch.equal(t, s), f"the backward modified its input {name}"
    assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), "dk / dv not repeatable"
    scale_ = 1.0 / math.sqrt(d) if scale is None else scale
    golden = reference(q.double(), k.double(), v.double(), dout.double(), causal, scale_)
    ref = reference(q, k, v, dout, causal, scale_)
    for name, x, g, r in zip(("dq", "dk", "dv"), grads, golden, ref):
        verdict = compare(x, g, r)
        assert verdict.passed, f"{name}: {verdict}"


def _cases():
    for d in (64, 128):
        for dtype in (F16, BF16):
            for causal in (False, True):
                for i, (nq, nk) in enumerate(LENGTHS):
                    hq, hkv = HEADS[(i + d // 64 + int(causal)) % len(HEADS)]
                    b = 1 if max(nq, nk) >= 2048 else 2
                    yield pytest.param(b, hq, hkv, nq, nk, d, dtype, causal,
                                       id=f"d{d}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-"
                                          f"q{nq}-k{nk}-h{hq}x{hkv}")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,dtype,causal", list(_cases()))
def test_rule(bwd, b, hq, hkv, nq, nk, d, dtype, causal):
    run_case(bwd, b, hq, hkv, nq, nk, d, dtype, causal)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}x{h[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_head_layout(bwd, causal, heads):
    """MHA / GQA / MQA at a ragged length, two seeds (dK / dV summed over the group in the CTA)."""
    for seed in (1, 2):
        run_case(bwd, 2, *heads, 333, 517, 128, BF16, causal, seed=seed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scale_parameter_and_large_scores(bwd, causal):
    """A non-default scale, and inputs x4 (scores up to ~+-100: P from LSE must not overflow)."""
    run_case(bwd, 1, 4, 2, 700, 900, 64, F16, causal, seed=3, scale=0.3)
    run_case(bwd, 1, 4, 1, 700, 900, 128, BF16, causal, seed=4, amplitude=4.0)


@pytest.mark.parametrize("d,dtype", [(128, BF16), (64, F16)], ids=["d128-bf16", "d64-f16"])
def test_l2_sections(bwd, d, dtype):
    """TILE_ORDER 2 with an L2 budget of four (batch, kv head) pairs: six pairs run as sections of
    four and two (the narrower last section's decode), causal ragged GQA, 8 KV tiles."""
    from cubridge.runtime.fa3_bwd_sm90 import OPTIONS, tile_sections
    if OPTIONS[bwd.keywords["option"]].tile_order not in (2, 5):   # 5 (zsec): sections of 2 and 1 of the 6 pairs
        pytest.skip("only TILE_ORDER 2 options decode L2 sections")
    b, hq, hkv, nq, nk = 3, 4, 2, 1000, 1000
    per_pair = (hq // hkv) * nq * (2 * d * 2 + d * 4 + 2 * 4)
    assert tile_sections(b * hkv, hq // hkv, nq, d, True, 4 * per_pair) == 4
    run_case(functools.partial(bwd, l2_bytes=4 * per_pair), b, hq, hkv, nq, nk, d, dtype, True)
    run_case(functools.partial(bwd, l2_bytes=per_pair), b, hq, hkv, nq, nk, d, dtype, True, seed=5)   # width 1


def test_more_than_64_kv_tiles(bwd):
    """Full attention over 66 KV tiles: M_ROTATE 2's second group of 64 KV tiles (session 15) starts its sweep at tile
    128 mod the range (3 of a ragged 5-tile range here, 7 of 11 in the second case), which the lengths above never
    reach; every option must pass it."""
    run_case(bwd, 1, 4, 2, 300, 8400, 64, F16, False)
    run_case(bwd, 1, 2, 2, 700, 8400, 128, BF16, False, seed=1)


@pytest.mark.parametrize("env", [None, "1"], ids=["default", "env1"])
def test_autograd_routes_here_by_default(monkeypatch, env):
    """Unless CUBRIDGE_HOPPER_BWD=0, autograd.attention's backward is this kernel's with the default
    option (bitwise dK/dV)."""
    from cubridge.runtime import autograd
    from cubridge.runtime.fa3_bwd_sm90 import default_option, fa3_backward
    bwd = functools.partial(fa3_backward, option=default_option(True))
    if env is None:
        monkeypatch.delenv("CUBRIDGE_HOPPER_BWD", raising=False)
    else:
        monkeypatch.setenv("CUBRIDGE_HOPPER_BWD", env)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(s, device="cuda", generator=gen).to(BF16).requires_grad_()
               for s in ((1, 4, 300, 128), (1, 2, 300, 128), (1, 2, 300, 128)))
    dout = torch.randn(1, 4, 300, 128, device="cuda", generator=gen).to(BF16)
    autograd.attention(q, k, v, causal=True).backward(dout)
    out, lse = autograd.forward_with_lse(q.detach(), k.detach(), v.detach(), True, None)
    _, dk, dv = bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=True)
    assert autograd.hopper_backward_used(q, deterministic=False)
    assert torch.equal(k.grad, dk) and torch.equal(v.grad, dv)


def test_bad_input_is_a_clear_error(bwd):
    from cubridge.errors import LaunchError
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    q = torch.randn(1, 2, 64, 96, device="cuda", dtype=BF16)
    with pytest.raises(LaunchError, match="head dim"):
        bwd(q, q, q, q, q, torch.zeros(1, 2, 64, device="cuda"))
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=BF16)
    with pytest.raises(LaunchError, match="unknown option"):
        fa3_backward(q, q, q, q, q, torch.zeros(1, 2, 64, device="cuda"), option="fast")


@pytest.mark.parametrize("b,hq,nq,nk,d,dtype", [(1, 4, 77, 300, 128, BF16), (2, 2, 300, 77, 64, F16),
                                                 (1, 2, 128, 128, 128, F16), (1, 3, 1000, 1000, 64, BF16)],
                         ids=["q77-k300", "q300-k77", "q128", "q1000-h3"])
def test_lean_preprocess_matches_the_classic_one(b, hq, nq, nk, d, dtype):
    """LEAN's one fa3_bwd_preprocess launch writes bitwise the padded log2 LSE and Dvec that
    fa2_bwd_preprocess + _padded_row_terms make (Nq > Nk: rows that see no key, LSE -inf -> +inf;
    ragged Nq: padding +inf / 0), and zeroes the whole tiled accumulator: its memory is a freed
    NaN-filled block of the same size first (the caching allocator hands it back)."""
    from cubridge.runtime import fa3_bwd_sm90 as hb
    from cubridge.runtime.driver import current_stream
    from cubridge.runtime.fa3_sm90 import fa3_forward
    gen = torch.Generator(device="cuda").manual_seed(nq + nk)
    q, dout = (torch.randn(b, hq, nq, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hq, nk, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    out, lse = fa3_forward(q, k, v, causal=True)
    num_m, stream = math.ceil(nq / 64), current_stream(q.device.index)
    shape = type("Shape", (), dict(batch=b, heads_q=hq, len_q=nq, head_dim=d))
    (lse_c, dvec_c), _ = hb._classic_prep(out, dout, lse, shape, 1, 1, q.device, stream)
    junk = torch.full((b * hq * num_m * 64 * d,), math.nan, device="cuda")
    del junk
    prep = hb._functions(d, True, dtype == BF16, "bulk_overlap_lse_lean", q.device, None)[2]
    (lse_l, dvec_l), accum = hb._lean_prep(prep, out, dout, lse, b * hq, nq, num_m, d, stream)
    torch.cuda.synchronize()
    assert torch.equal(lse_l, lse_c), "padded log2 LSE differs from _padded_lse"
    assert torch.equal(dvec_l.flatten(), dvec_c.flatten()), "padded Dvec differs from fa2_bwd_preprocess's"
    assert accum.numel() == b * hq * num_m * 64 * d and not accum.isnan().any() and not accum.any()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lean_gradients_equal_arriveall(causal):
    """LEAN changes only the launches around the kernel and the CTA's last wait: dK, dV bitwise
    equal to bulk_overlap_lse_arriveall's (same Dvec bits, same kernel body), dQ under the rule
    (test_rule; its reduce-add order varies between runs anyway)."""
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    from cubridge.runtime.fa3_sm90 import fa3_forward
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, dout = (torch.randn(2, 8, 333, 128, device="cuda", generator=gen).to(BF16) for _ in range(2))
    k, v = (torch.randn(2, 2, 517, 128, device="cuda", generator=gen).to(BF16) for _ in range(2))
    out, lse = fa3_forward(q, k, v, causal=causal)
    _, dk_a, dv_a = fa3_backward(dout, q, k, v, out, lse, causal=causal, option="bulk_overlap_lse_arriveall")
    _, dk_l, dv_l = fa3_backward(dout, q, k, v, out, lse, causal=causal, option="bulk_overlap_lse_lean")
    assert torch.equal(dk_a, dk_l) and torch.equal(dv_a, dv_l)


@pytest.mark.parametrize("option", ["bulk_overlap_lse_lean_issue", "bulk_overlap_lse_lean_issue_epi",
                                    "bulk_overlap_lse_lean_issue_pf32_epi"])
@pytest.mark.parametrize("d,dtype", [(128, BF16), (64, F16)], ids=["d128-bf16", "d64-f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_issue_gradients_equal_lean(causal, d, dtype, option):
    """ISSUE changes how instructions are issued, not what is computed: dK, dV bitwise equal to
    bulk_overlap_lse_lean's; dQ (the GEMM that reads the stmatrix-stored dS^T slot) equal up to the
    order of the fp32 reduce-adds: within 2^-6 of max|dQ| (a wrong dS layout is off by O(max|dQ|)).
    EPILOGUE (dK / dV staged through shared memory, Nk = 517: a partial last tile) the same. ISSUE 2
    (_pf32: dS from the f32 P instead of its 16-bit copy) changes dS by P's rounding: dV bitwise, dK
    like dQ (its rule cases are test_rule's)."""
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    from cubridge.runtime.fa3_sm90 import fa3_forward
    gen = torch.Generator(device="cuda").manual_seed(13 + d)
    q, dout = (torch.randn(2, 8, 333, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 517, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    out, lse = fa3_forward(q, k, v, causal=causal)
    dq_l, dk_l, dv_l = fa3_backward(dout, q, k, v, out, lse, causal=causal, option="bulk_overlap_lse_lean")
    dq_i, dk_i, dv_i = fa3_backward(dout, q, k, v, out, lse, causal=causal, option=option)
    close = [(dq_i, dq_l)]
    if "pf32" in option:
        close.append((dk_i, dk_l))
    else:
        assert torch.equal(dk_i, dk_l)
    assert torch.equal(dv_i, dv_l)
    for mine, lean in close:
        scale = lean.float().abs().max().item()
        assert scale > 0 and (mine.float() - lean.float()).abs().max().item() <= scale * 2 ** -6


@pytest.mark.parametrize("shape", [(2, 8, 2, 333, 517, 128, BF16), (1, 4, 1, 1000, 300, 64, F16),
                                   (1, 2, 2, 2048, 2048, 128, F16)], ids=["gqa-q333-k517-d128", "mqa-q1000-k300-d64",
                                                                          "q2048-d128"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("option", ["bulk_overlap_lse_lean_issue_pf32_epi_carry",
                                    "bulk_overlap_lse_lean_issue_pf32_epi_carry_dvlate",
                                    "bulk_overlap_lse_lean_issue_pf32_epi_dqw",
                                    "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early",
                                    "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_carry",
                                    "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt",
                                    "bulk_dqfirst_lse_lean_issue_pf32_epi_dqw_early",
                                    "bulk_dqfirst_lse_lean_issue_pf32_epi_dqw_early_l2lpt",
                                    "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_u64",
                                    "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_u64"])
def test_carry_gradients_equal_pf32(option, causal, shape):
    """CARRY (session 12) only moves where each step waits for its dK GEMM (the next step's first
    wgmma wait) and when the stage is released, DV_LATE where dV is issued, DQ_WRITER (session 13)
    who adds the dQ parts (a writer warp; dK / dV then staged in the slots it read last), ROWS_EARLY
    (session 14) when the stage's LSE / Dvec rows are read into registers, TILE_ORDER 2 (session 15)
    which CTA takes which KV tile, in what order, and SCHED 2 (session 15) where dV is waited for: the same
    operations on the same values in the same order per accumulator, so dK and dV are bitwise
    bulk_overlap_lse_lean_issue_pf32_epi's (a dS^T or P^T register reused while a GEMM still read
    it, or a stage reloaded under it, would change them), dQ equal up to the reduce-add order
    (within 2^-6 of max |dQ|). GQA (the stage ring wraps across heads), Nq > Nk, many steps."""
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    from cubridge.runtime.fa3_sm90 import fa3_forward
    b, hq, hkv, nq, nk, d, dtype = shape
    gen = torch.Generator(device="cuda").manual_seed(17 + nq)
    q, dout = (torch.randn(b, hq, nq, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    out, lse = fa3_forward(q, k, v, causal=causal)
    dq_p, dk_p, dv_p = fa3_backward(dout, q, k, v, out, lse, causal=causal, option="bulk_overlap_lse_lean_issue_pf32_epi")
    dq_c, dk_c, dv_c = fa3_backward(dout, q, k, v, out, lse, causal=causal, option=option)
    assert torch.equal(dk_c, dk_p) and torch.equal(dv_c, dv_p)
    scale = dq_p.float().abs().max().item()
    assert scale > 0 and (dq_c.float() - dq_p.float()).abs().max().item() <= scale * 2 ** -6


@pytest.mark.parametrize("shape", [(2, 8, 2, 333, 517, 128, BF16), (1, 2, 2, 2048, 2048, 128, F16)],
                         ids=["gqa-q333-k517", "q2048-f16"])
def test_desc64_gradients_equal_m80(shape):
    """DESC64 (session 16) builds the same wgmma descriptors by another add: TILE_M80 with it gives TILE_M80's dK / dV
    bitwise, dQ up to the reduce-add order (full attention, D 128)."""
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    from cubridge.runtime.fa3_sm90 import fa3_forward
    b, hq, hkv, nq, nk, d, dtype = shape
    gen = torch.Generator(device="cuda").manual_seed(23 + nq)
    q, dout = (torch.randn(b, hq, nq, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    out, lse = fa3_forward(q, k, v, causal=False)
    base = "bulk_overlap_lse_lean_issue_epi_dqw_early_m80"
    dq_p, dk_p, dv_p = fa3_backward(dout, q, k, v, out, lse, causal=False, option=base)
    dq_c, dk_c, dv_c = fa3_backward(dout, q, k, v, out, lse, causal=False, option=base + "_u64")
    assert torch.equal(dk_c, dk_p) and torch.equal(dv_c, dv_p)
    scale = dq_p.float().abs().max().item()
    assert scale > 0 and (dq_c.float() - dq_p.float()).abs().max().item() <= scale * 2 ** -6
