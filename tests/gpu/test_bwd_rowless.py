"""GPU checks of session 17's row-term switch (CUBRIDGE_BWD_ROWLESS=1, cubridge.lower.fa3_bwd_sm90): sigmoid and
relu (and composite, a softcapped sigmoid) lowered with kRowTerms = false (no O / dO read in the preprocess, no
LSE / Dvec rows loaded per stage) pass the verification rule, and their dK / dV are bitwise the default lowering's
(the same operations on the same values: only loads whose values were never used are gone), dQ within 2^-6 of its
max (reduce-add order). Also VARIANT_OPTION's DESC64 twin (_u64) against VARIANT_OPTION: dK / dV bitwise. And
CUBRIDGE_BWD_DS_FACTOR=1 (the P pass leaves dS / dP in the f32 P^T; composite and relu then take the split passes): the
rule, dV bitwise (the same 16-bit P^T), dK / dQ within 2^-6 (dS's product in another order)."""
from __future__ import annotations

import pytest
import torch

from test_bwd_variants import _hopper_shapes, _run_rule   # tests/gpu is on sys.path (no __init__.py)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Hopper backward (fa3_bwd_sm90) needs an sm_90 GPU", allow_module_level=True)

VARIANTS = [("sigmoid", {}), ("relu", {}), ("composite", {}), ("composite", {"softcap": 2.0})]
U64 = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_u64"
SHAPE_IDS = lambda s: "b{}-h{}x{}-q{}-k{}-d{}-{}".format(*s[:6], str(s[6])[6:])  # noqa: E731


def _lowered(name, params, monkeypatch, rowless: bool, option: str | None = None, factor: bool = False,
             scan_bits: bool = False):
    """A VariantBackward whose Hopper source is lowered now, with the switches as asked."""
    from cubridge.lower.fa3_bwd_sm90 import DS_FACTOR_ENV, ROWLESS_ENV, SCAN_BITS_ENV
    from cubridge.runtime.variant_bwd import VariantBackward
    monkeypatch.setenv(ROWLESS_ENV, "1" if rowless else "0")
    monkeypatch.setenv(DS_FACTOR_ENV, "1" if factor else "0")
    monkeypatch.setenv(SCAN_BITS_ENV, "1" if scan_bits else "0")
    bwd = VariantBackward(name, use_hopper=True, **({"hopper_option": option} if option else {}), **params)
    src = bwd.hopper.source   # lowered once, here
    assert ("constexpr bool kRowTerms = false;" in src) == rowless
    assert ("constexpr bool kDsFactor = kDsFromP32;" in src) == factor
    monkeypatch.delenv(ROWLESS_ENV)
    assert ("q_ffs(rest)" in src) == scan_bits
    monkeypatch.delenv(DS_FACTOR_ENV)
    monkeypatch.delenv(SCAN_BITS_ENV)
    return bwd


def _close(new, old, i: int) -> bool:
    scale = old[i].float().abs().max().item()
    return (new[i].float() - old[i].float()).abs().max().item() <= scale * 2 ** -6


def _same(new, old, what: str) -> None:
    assert torch.equal(new[1], old[1]) and torch.equal(new[2], old[2]), f"dk / dv differ from {what}"
    assert _close(new, old, 0), "dq differs beyond reduce order"


@pytest.mark.parametrize("shape", _hopper_shapes(), ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0] + "".join(f"-{k}{x}" for k, x in v[1].items()))
def test_rowless_rule_and_equal(variant, shape, monkeypatch):
    name, params = variant
    runs = [_run_rule(_lowered(name, params, monkeypatch, r), name, params, shape, f"rowless{name}{shape}")
            for r in (True, False)]
    (new, again), (old, _) = runs
    assert torch.equal(new[1], again[1]) and torch.equal(new[2], again[2]), "dk / dv not repeatable"
    _same(new, old, "the default lowering's")


@pytest.mark.parametrize("shape", [_hopper_shapes()[0], _hopper_shapes()[4]], ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", [("sigmoid", {}), ("prefixlm", {}), ("share_question", {})],
                         ids=lambda v: v[0])
def test_u64_rowless_equal_variant_option(variant, shape, monkeypatch):
    """_u64 (one 64-bit add per wgmma descriptor) with the rows switch and the run-at-a-time scan
    (CUBRIDGE_BWD_SCAN_BITS=1: the same runs, so the same steps) on, against VARIANT_OPTION with both off."""
    name, params = variant
    new = _run_rule(_lowered(name, params, monkeypatch, name != "prefixlm" and name != "share_question", U64,
                             scan_bits=True), name, params, shape, f"u64{name}{shape}")[0]
    old = _run_rule(_lowered(name, params, monkeypatch, False), name, params, shape, f"u64{name}{shape}")[0]
    _same(new, old, "VARIANT_OPTION's")


@pytest.mark.parametrize("shape", _hopper_shapes(), ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0] + "".join(f"-{k}{x}" for k, x in v[1].items()))
def test_ds_factor_rule_and_close(variant, shape, monkeypatch):
    """DS_FACTOR with the rows switch and the run-at-a-time scan on (the proposed stack), against the default lowering:
    the rule; dV bitwise; dK / dQ within 2^-6."""
    name, params = variant
    new, again = _run_rule(_lowered(name, params, monkeypatch, True, factor=True, scan_bits=True), name, params, shape,
                           f"dsf{name}{shape}")
    old = _run_rule(_lowered(name, params, monkeypatch, False), name, params, shape, f"dsf{name}{shape}")[0]
    assert torch.equal(new[1], again[1]) and torch.equal(new[2], again[2]), "dk / dv not repeatable"
    assert torch.equal(new[2], old[2]), "dv differs from the default lowering's (the same 16-bit P^T)"
    assert _close(new, old, 1) and _close(new, old, 0), "dk / dq beyond 2^-6 of the default lowering's"
