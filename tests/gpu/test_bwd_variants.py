"""GPU checks of variant backwards (cubridge.lower.fa2_bwd_sm80 lowered into ref_kernels/fa2_bwd_sm80)
under the verification rule: dQ, dK, dV against torch.autograd of the spec's reference in float64
(golden) and in the kernel dtype (ref). The forward's out and LSE come from the spec's hooks in
float64 (cubridge.runtime.variant_bwd.reference_forward) so that only the backward is under test
(tests/gpu/test_bwd_op.py runs the tuned forward + this backward end to end). Outputs poisoned
with NaN first, inputs unchanged, deterministic mode bitwise repeatable. Random normal inputs."""
from __future__ import annotations

import os
import zlib

import pytest
import torch


pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("the backward kernels need an sm_80+ GPU", allow_module_level=True)

F16, BF16 = torch.float16, torch.bfloat16
VARIANTS = [("causal", {}), ("prefixlm", {}), ("causal_blockwise", {}), ("global_sliding_window", {}), ("share_question", {}),
            ("relative_pos", {}), ("sigmoid", {}), ("relu", {}), ("composite", {}), ("composite", {"softcap": 2.0})]
# (B, Hq, Hkv, Nq, Nk, D, dtype, deterministic): ragged GQA, MQA, both head dims and dtypes; the
# last two with fewer queries than keys (rows end-aligned: row i at position Nk - Nq + i).
SHAPES = [(2, 8, 2, 1000, 1000, 128, BF16, False), (1, 4, 1, 777, 777, 64, F16, True),
          (1, 4, 2, 1400, 1400, 128, F16, False), (2, 8, 2, 700, 1300, 128, BF16, False),
          (1, 4, 1, 333, 1000, 64, F16, True)]


@pytest.fixture(scope="module")
def backwards():
    """One VariantBackward per variant, every specialisation the cases need compiled up front in
    parallel (NVRTC releases the GIL; about 27 builds)."""
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.runtime.launch import device_arch
    from cubridge.runtime.variant_bwd import VariantBackward
    # use_hopper=False: on an sm_90 GPU the default is the Hopper path, tested below
    out = {(n, tuple(sorted(p.items()))): VariantBackward(n, use_hopper=False, **p) for n, p in VARIANTS}
    arch = device_arch(torch.device("cuda"))
    jobs = [(bwd, d, dt, det) for bwd in out.values() for (*_, d, dt, det) in SHAPES]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: j[0].kernel.build(j[1], j[2], False, j[3], arch, source=j[0].source), jobs))
    return out


def _run_rule(bwd, name, params, shape, seed_key: str, **call):
    """Random inputs of `shape` (cubridge.runtime.variant_bwd.GradCase), then the backward twice
    (into NaN-poisoned gradients under cubridge.rule.check_backward, then fresh). Returns (grads,
    again) for the callers' repeatability checks."""
    from cubridge.runtime.variant_bwd import GradCase
    b, hq, hkv, nq, nk, d, dtype, _ = shape
    case = GradCase(bwd.spec, params, (b, hq, hkv, nq, nk, d), dtype, seed=zlib.crc32(seed_key.encode()))
    verdict = case.check(bwd, **call)
    assert verdict.passed, f"{name}: {verdict}"
    again = bwd(case.dout, case.q, case.k, case.v, case.out, case.lse, sm_scale=d ** -0.5, **call)
    return verdict.grads, again


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-h{}x{}-q{}-k{}-d{}-{}-{}".format(
    *s[:6], str(s[6])[6:], "det" if s[7] else "atomic"))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0] + "".join(f"-{k}{x}" for k, x in v[1].items()))
def test_variant_backward_rule(backwards, variant, shape):
    name, params = variant
    det = shape[7]
    bwd = backwards[(name, tuple(sorted(params.items())))]
    grads, again = _run_rule(bwd, name, params, shape, f"{name}{shape}", deterministic=det)
    same = [torch.equal(x, y) for x, y in zip(grads, again)]
    assert same[1] and same[2], "dk / dv not repeatable (they use no atomics)"
    if det:
        assert same[0], "deterministic dq not bitwise repeatable"


# ---- the same variants lowered onto the Hopper backward (cubridge.lower.fa3_bwd_sm90), sm_90 only
def _hopper_shapes():
    # the Hopper dQ is a reduce-add (not bitwise repeatable): every shape in atomic mode
    return [s[:7] + (False,) for s in SHAPES]


@pytest.fixture(scope="module")
def hopper_backwards():
    """One VariantBackward per variant on the Hopper path, every specialisation built up front."""
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.runtime import fa3_bwd_sm90 as hb
    from cubridge.runtime.variant_bwd import VariantBackward
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward (fa3_bwd_sm90) needs an sm_90 GPU")
    out = {(n, tuple(sorted(p.items()))): VariantBackward(n, **p) for n, p in VARIANTS}
    jobs = {(bwd.hopper.source, d, dt == BF16) for bwd in out.values() for (*_, d, dt, _) in _hopper_shapes()}
    with ThreadPoolExecutor(16) as pool:
        staged = hb.staged_convert_enabled(hb.STAGED_VARIANT_DEFAULT)   # the convert a variant call builds with
        list(pool.map(lambda j: hb.build_cubin(j[1], False, j[2], option=hb.variant_option(), source=j[0],
                                               staged_convert=staged), jobs))
    return out


@pytest.mark.parametrize("shape", _hopper_shapes(),
                         ids=lambda s: "b{}-h{}x{}-q{}-k{}-d{}-{}".format(*s[:6], str(s[6])[6:]))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0] + "".join(f"-{k}{x}" for k, x in v[1].items()))
def test_variant_backward_rule_hopper(hopper_backwards, variant, shape, monkeypatch):
    """As test_variant_backward_rule, on fa3_bwd_sm90 (opt-in env set here, restored by monkeypatch);
    dK, dV are register sums in a fixed order: bitwise repeatable; dQ is not (bulk reduce-add)."""
    from cubridge.runtime.variant_bwd import HOPPER_ENV
    monkeypatch.setenv(HOPPER_ENV, "1")
    name, params = variant
    bwd = hopper_backwards[(name, tuple(sorted(params.items())))]
    assert bwd.uses_hopper(torch.device("cuda")), "the opt-in did not select the Hopper backward"
    grads, again = _run_rule(bwd, name, params, shape, f"hopper{name}{shape}")
    assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), "dk / dv not repeatable"


def _other_variant_options() -> list[str]:
    """VARIANT_OPTIONS but VARIANT_OPTION; CUBRIDGE_BWD_OPTIONS (as tests/gpu/test_bwd_sm90.py reads
    it) narrows them to the ones it names (none of them: no case)."""
    from cubridge.runtime.fa3_bwd_sm90 import VARIANT_OPTIONS, variant_option
    wanted = [o for o in os.environ.get("CUBRIDGE_BWD_OPTIONS", "").split(",") if o]
    return [o for o in VARIANT_OPTIONS if o != variant_option() and (not wanted or o in wanted)]


# a block table with runs (prefixlm), a GQA document-like table (share_question), the one-pass P / dS
# path (composite's softcap, relu): the two kinds of stage reads the release covers
HOPPER_OPTION_VARIANTS = [("prefixlm", {}), ("share_question", {}), ("composite", {"softcap": 2.0}), ("relu", {})]


@pytest.mark.parametrize("shape", [_hopper_shapes()[0], _hopper_shapes()[4]],
                         ids=lambda s: "b{}-h{}x{}-q{}-k{}-d{}-{}".format(*s[:6], str(s[6])[6:]))
@pytest.mark.parametrize("variant", HOPPER_OPTION_VARIANTS, ids=lambda v: v[0] + "".join(f"-{k}{x}" for k, x in v[1].items()))
@pytest.mark.parametrize("option", _other_variant_options())
def test_variant_backward_rule_hopper_options(option, variant, shape):
    """The Hopper variant path on every other option of VARIANT_OPTIONS (hopper_option=; e.g.
    ARRIVE_ALL), as test_variant_backward_rule_hopper on a few variants."""
    from cubridge.runtime.variant_bwd import VariantBackward
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward (fa3_bwd_sm90) needs an sm_90 GPU")
    name, params = variant
    bwd = VariantBackward(name, use_hopper=True, hopper_option=option, **params)
    grads, again = _run_rule(bwd, name, params, shape, f"hopper{name}{shape}")
    assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), "dk / dv not repeatable"


@pytest.mark.parametrize("variant", [("share_question", {}), ("global_sliding_window", {}), ("composite", {})],
                         ids=lambda v: v[0])
def test_variant_backward_rule_hopper_persist_queue(variant, monkeypatch):
    """PERSIST (ref_kernels/fa3_bwd_sm90/persist.cuh): the grid capped at 1 and at 5 CTAs, so each CTA runs
    many tiles of the queue (GQA, ragged, a block table, an interval band, the one-pass path): both pass the
    rule, and dK / dV are bitwise equal between the two (a tile's sums do not depend on which CTA ran it or
    what it ran before: no state carried across tiles)."""
    from cubridge.runtime import fa3_bwd_sm90 as hb
    from cubridge.runtime.variant_bwd import VariantBackward
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward (fa3_bwd_sm90) needs an sm_90 GPU")
    name, params = variant
    bwd = VariantBackward(name, use_hopper=True, hopper_option=hb.VARIANT_ONLY_OPTIONS[0], **params)
    shape = (2, 8, 2, 1000, 1000, 128, BF16, False)   # 8 KV tiles x 2 kv heads x 2 batches = 32 tiles
    runs = []
    for ctas in ("1", "5"):
        monkeypatch.setenv(hb.PERSIST_CTAS_ENV, ctas)
        runs.append(_run_rule(bwd, name, params, shape, f"persist{name}")[0])
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2]), "dk / dv depend on the CTA count"


# session 15: the dense default's body for the variants (writer warp + early row loads, TILE_ORDER 2), against the
# body it would replace (bulk_overlap_lse_lean_issue_pf32_epi_l2lpt, VARIANT_OPTION until then)
DQW_EARLY, L2LPT = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt", "bulk_overlap_lse_lean_issue_pf32_epi_l2lpt"


@pytest.mark.parametrize("shape", [_hopper_shapes()[0], _hopper_shapes()[4]],
                         ids=lambda s: "b{}-h{}x{}-q{}-k{}-d{}-{}".format(*s[:6], str(s[6])[6:]))
@pytest.mark.parametrize("variant", [*HOPPER_OPTION_VARIANTS, ("global_sliding_window", {}), ("sigmoid", {})],
                         ids=lambda v: v[0] + "".join(f"-{k}{x}" for k, x in v[1].items()))
def test_dqw_early_gradients_equal_l2lpt(variant, shape):
    """DQ_WRITER only moves who issues each dQ bulk add (the writer warp, in the consumers' step order over the
    variant's runs / list) and ROWS_EARLY only when the LSE / Dvec rows are read: both options pass the rule, dK /
    dV are bitwise equal (same operations on the same values in each CTA), dQ within 2^-6 of its max (reduce-add
    order across CTAs)."""
    from cubridge.runtime.variant_bwd import VariantBackward
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward (fa3_bwd_sm90) needs an sm_90 GPU")
    name, params = variant
    runs = [_run_rule(VariantBackward(name, use_hopper=True, hopper_option=o, **params), name, params, shape,
                      f"dqw{name}{shape}")[0] for o in (DQW_EARLY, L2LPT)]
    new, old = runs
    assert torch.equal(new[1], old[1]) and torch.equal(new[2], old[2]), "dk / dv differ from the l2lpt body's"
    scale = old[0].float().abs().max().item()
    assert (new[0].float() - old[0].float()).abs().max().item() <= scale * 2 ** -6, "dq differs beyond reduce order"



@pytest.mark.parametrize("d,dtype,nq", [(128, BF16, 1000), (64, F16, 777), (128, F16, 64)])
def test_staged_convert_equals_tiled(d, dtype, nq):
    """kernel.cu DQ_CONVERT 2 (CUBRIDGE_BWD_STAGED_CONVERT=1's convert): from the same random tiled accumulator
    (padding rows included) into NaN-poisoned dq, the staged convert writes every element and the same bits as the
    tiled one (the same multiply and pack per element); the accumulator is left as it was."""
    import math
    import types

    from cubridge.runtime import fa3_bwd_sm90 as hb
    from cubridge.runtime.driver import current_stream
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward (fa3_bwd_sm90) needs an sm_90 GPU")
    b, hq, dev = 2, 3, torch.device("cuda", torch.cuda.current_device())   # an index: current_stream takes it
    g = torch.Generator(device=dev).manual_seed(nq * d)
    accum = torch.randn(b * hq * math.ceil(nq / 64) * 64 * d, device=dev, generator=g)
    before = accum.clone()
    shape = types.SimpleNamespace(batch=b, heads_q=hq, len_q=nq, head_dim=d)
    outs = []
    for staged in (False, True):
        funcs = hb._functions(d, False, dtype == BF16, hb.DEFAULT_OPTION, dev, None, staged_convert=staged)
        dq = torch.full((b, hq, nq, d), float("nan"), device=dev, dtype=dtype)
        launch = hb._convert_staged if staged else hb._convert
        launch(funcs[1], accum, dq, shape, d ** -0.5, current_stream(dev.index))
        torch.cuda.synchronize()
        outs.append(dq)
    assert not outs[1].isnan().any(), "the staged convert left poisoned elements"
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), "staged dq differs from the tiled"
    assert torch.equal(accum, before), "the accumulator was written"


@pytest.mark.parametrize("variant", [("prefixlm", {}), ("share_question", {}), ("composite", {"softcap": 2.0})],
                         ids=lambda v: v[0])
def test_variant_backward_rule_hopper_staged_convert(variant, monkeypatch):
    """The Hopper variant backward with CUBRIDGE_BWD_STAGED_CONVERT=1 passes the rule (ragged Nq, GQA, D 128 and
    64), on the l2lpt and the dqw_early bodies."""
    from cubridge.runtime import fa3_bwd_sm90 as hb
    from cubridge.runtime.variant_bwd import VariantBackward
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward (fa3_bwd_sm90) needs an sm_90 GPU")
    monkeypatch.setenv(hb.STAGED_CONVERT_ENV, "1")
    name, params = variant
    for option, shape in ((L2LPT, _hopper_shapes()[0]), (DQW_EARLY, _hopper_shapes()[4])):
        bwd = VariantBackward(name, use_hopper=True, hopper_option=option, **params)
        _run_rule(bwd, name, params, shape, f"staged{name}{shape}")
