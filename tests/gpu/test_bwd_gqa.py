"""GPU checks of the Hopper backward's GQA split (cubridge.runtime.fa3_bwd_gqa, kernel.cu GQA_SPLIT)
under the verification rule: dQ, dK, dV against torch.autograd of attention in float64 (golden) and
in the kernel dtype (ref), pass iff max|x - golden| <= 2 max|ref - golden| + 1e-5. Also: gradients
poisoned with NaN are fully written, inputs unchanged, dK / dV bitwise repeatable (the partials are
summed in a fixed order). Dense (causal / full, GQA 16 / 4, 32 / 8, 4 / 2, MQA, ragged lengths, both
head dims and dtypes) and lowered variants (prefixlm, share_question, causal_blockwise) at every split.
Random normal inputs, never zeros. Needs an sm_90 GPU (skipped otherwise).

CUBRIDGE_BWD_GQA_SPLITS=2,4,group (the default) picks the splits; -k s2 / -k dense / -k variant narrow.
"""
from __future__ import annotations

import math
import os
import sys
import zlib
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


def _splits() -> list[str]:
    return [s for s in os.environ.get("CUBRIDGE_BWD_GQA_SPLITS", "2,4,group").split(",") if s]


SPLITS = _splits()
# (B, Hq, Hkv, Nq, Nk, D, dtype, causal): GQA 16 / 4 and 32 / 8 (the Llama client's groups), 4 / 2,
# MQA 8 / 1, ragged and Nq != Nk both ways, one key tile, both head dims and dtypes.
DENSE = [(2, 16, 4, 1000, 1000, 128, BF16, True), (2, 16, 4, 777, 777, 128, BF16, False),
         (1, 32, 8, 2048, 2048, 128, BF16, True), (1, 32, 8, 300, 1000, 128, F16, False),
         (2, 4, 2, 1000, 300, 64, F16, True), (1, 8, 1, 333, 517, 128, BF16, True),
         (1, 8, 1, 1000, 1000, 64, BF16, False), (2, 16, 4, 77, 128, 64, F16, True),
         (1, 16, 4, 1, 1, 128, BF16, False)]


def _id(case) -> str:
    b, hq, hkv, nq, nk, d, dtype, causal = case
    return f"b{b}-h{hq}x{hkv}-q{nq}-k{nk}-d{d}-{str(dtype)[6:]}-{'causal' if causal else 'full'}"


def run_case(split, b, hq, hkv, nq, nk, d, dtype, causal, seed):
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    from cubridge.runtime.fa3_sm90 import fa3_forward
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, hq, nq, d))
    q, k, v, dout = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    out, lse = fa3_forward(q, k, v, causal=causal)
    saved = [t.clone() for t in (q, k, v, dout, out, lse)]
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    fa3_backward(dout, q, k, v, out, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2], gqa_split=split)
    again = fa3_backward(dout, q, k, v, out, lse, causal=causal, gqa_split=split)
    torch.cuda.synchronize()
    for g, name in zip(grads, ("dq", "dk", "dv")):
        assert not g.isnan().any(), f"{name}: {int(g.isnan().sum())} elements never written (or NaN)"
    for t, s, name in zip((q, k, v, dout, out, lse), saved, ("q", "k", "v", "dout", "out", "lse")):
        assert torch.equal(t, s), f"the backward modified its input {name}"
    assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), "dk / dv not repeatable"
    scale = 1.0 / math.sqrt(d)
    golden = bwd_reference.reference(q.double(), k.double(), v.double(), dout.double(), causal, scale)[2]
    ref = bwd_reference.reference(q, k, v, dout, causal, scale)[2]
    for name, x, g, r in zip(("dq", "dk", "dv"), grads, golden, ref):
        verdict = compare(x, g, r)
        assert verdict.passed, f"{name} (split {split}): {verdict}"


@pytest.fixture(scope="module")
def built():
    """Every dense specialisation of the cases at every split, compiled up front in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.runtime import fa3_bwd_gqa as gqa
    from cubridge.runtime import fa3_bwd_sm90 as hb
    jobs = {(d, causal, dt == BF16, gqa.effective(gqa.requested(s), hq // hkv))
            for s in SPLITS for (_, hq, hkv, _, _, d, dt, causal) in DENSE}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: hb.build_cubin(j[0], j[1], j[2], gqa_split=j[3]), jobs))
    return True


@pytest.mark.parametrize("case", DENSE, ids=_id)
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"s{s}")
def test_dense_split_rule(built, split, case):
    run_case(split, *case, seed=zlib.crc32(f"{split}{case}".encode()))


VARIANTS = [("prefixlm", {}), ("share_question", {}), ("causal_blockwise", {})]
VARIANT_SHAPES = [(2, 8, 2, 1000, 1000, 128, BF16), (1, 16, 4, 700, 1300, 128, BF16), (1, 4, 1, 777, 777, 64, F16)]


@pytest.mark.parametrize("shape", VARIANT_SHAPES, ids=lambda s: "b{}-h{}x{}-q{}-k{}-d{}-{}".format(*s[:6], str(s[6])[6:]))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0])
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"s{s}")
def test_variant_split_rule(split, variant, shape, monkeypatch):
    """A lowered variant backward on the Hopper kernel with the split (CUBRIDGE_BWD_GQA_SPLIT, set
    here and restored by monkeypatch): the rule, dK / dV bitwise repeatable."""
    from cubridge.runtime import fa3_bwd_gqa as gqa
    from cubridge.runtime.variant_bwd import GradCase, VariantBackward
    monkeypatch.setenv(gqa.SPLIT_ENV, split)
    name, params = variant
    bwd = VariantBackward(name, use_hopper=True, **params)
    b, hq, hkv, nq, nk, d, dtype = shape
    case = GradCase(bwd.spec, params, (b, hq, hkv, nq, nk, d), dtype, seed=zlib.crc32(f"{split}{name}{shape}".encode()))
    verdict = case.check(bwd)
    assert verdict.passed, f"{name} split {split}: {verdict}"
    again = bwd(case.dout, case.q, case.k, case.v, case.out, case.lse, sm_scale=d ** -0.5)
    assert torch.equal(verdict.grads[1], again[1]) and torch.equal(verdict.grads[2], again[2]), "dk / dv not repeatable"
