"""GPU checks of the fused dQ convert (kernel.cu DQ_FUSE, CUBRIDGE_BWD_FUSED_CONVERT=1; session 16): the CTA whose
step completes a query tile converts it into dQ and zeroes its accumulator lines, counted per tile by a launch before
the preprocess. Against the same option unfused: dK / dV bitwise (the consumers' work is unchanged), dQ within 2^-6
of its max (reduce-add order) in NaN-poisoned dq (every element written, rows no key sees included); the kept
accumulator and counters are all zero after each call; a second call and a CUDA graph replay agree; the variant path
passes the verification rule. The full rule sweep runs tests/gpu/test_bwd_variants.py with the switch set (jobs)."""
from __future__ import annotations

import zlib

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the fused dQ convert is the Hopper backward's (fa3_bwd_sm90): needs an sm_90 GPU",
                allow_module_level=True)

from cubridge.runtime import fa3_bwd_sm90 as hb  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16
DQW_EARLY = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early"
# (B, Hq, Hkv, Nq, Nk, D, dtype): GQA ragged both ways, MQA with Nq > Nk (causal: query tiles no key sees), many tiles
SHAPES = [(2, 8, 2, 333, 517, 128, BF16), (1, 4, 1, 1000, 300, 64, F16), (1, 2, 2, 2048, 2048, 128, F16),
          (3, 4, 4, 640, 1100, 128, BF16)]


VARIANT_CASES = [("prefixlm", {}), ("share_question", {}), ("global_sliding_window", {}), ("document", {}),
                 ("composite", {"softcap": 2.0})]
VARIANT_SHAPES = [(2, 8, 2, 1000, 1000, 128, BF16, False), (1, 4, 1, 333, 1000, 64, F16, False)]


def prebuild() -> None:
    """Every cubin these cases build, fused and not, 16 at a time (the job runs it before pytest -n 8, whose workers
    would each build them otherwise): python3 -c "import runpy; runpy.run_path('tests/gpu/test_bwd_fuse.py')['prebuild']()"."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.runtime import fa3_bwd_gqa as gqa
    from cubridge.runtime.variant_bwd import VariantBackward
    t0 = time.time()
    jobs = set()
    for b, hq, hkv, nq, nk, d, dtype in SHAPES + [(2, 8, 2, 700, 900, 128, BF16)]:
        for causal in (False, True):
            split = gqa.effective(gqa.requested(None, gqa.default_split(causal, False)), hq // hkv)
            for option in (DQW_EARLY, hb.CAUSAL_OPTION):
                jobs |= {(None, d, causal, dtype == BF16, option, split, fuse) for fuse in (False, True)}
    for name, params in VARIANT_CASES:
        source = VariantBackward(name, use_hopper=True, **params).hopper.source
        jobs |= {(source, s[5], False, s[6] == BF16, hb.variant_option(), 1, fuse)
                 for s in VARIANT_SHAPES for fuse in (False, True)}

    def build(job):
        source, d, causal, bf16, option, split, fuse = job
        try:
            hb.build_cubin(d, causal, bf16, option=option, source=source, gqa_split=split, fuse=fuse)
        except Exception as e:  # noqa: BLE001 - the test that needs it reports the failure
            print(f"  prebuild failed: {option} D{d} causal={causal} fuse={fuse}: {type(e).__name__}: {str(e)[:160]}")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(build, jobs))
    print(f"prebuilt {len(jobs)} fused / unfused cubins in {time.time() - t0:.0f} s", flush=True)


def _inputs(shape, causal, seed):
    from cubridge.runtime.fa3_sm90 import fa3_forward
    b, hq, hkv, nq, nk, d, dtype = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(b, hq, nq, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    out, lse = fa3_forward(q, k, v, causal=causal)
    return dout, q, k, v, out, lse


def _poisoned(shape, dtype):
    b, hq, hkv, nq, nk, d, _ = shape
    return (torch.full((b, hq, nq, d), float("nan"), device="cuda", dtype=dtype),
            torch.full((b, hkv, nk, d), float("nan"), device="cuda", dtype=dtype),
            torch.full((b, hkv, nk, d), float("nan"), device="cuda", dtype=dtype))


def _assert_rest_state_zero():
    assert hb._FUSE_BUFFERS, "the fused path kept no accumulator"
    for (accum, ctr) in hb._FUSE_BUFFERS.values():
        assert int(torch.count_nonzero(ctr)) == 0, "tile counters not back at 0"
        assert int(torch.count_nonzero(accum)) == 0, "accumulator not left zero"


def _close(mine, ref, what):
    scale = ref.float().abs().max().item()
    err = (mine.float() - ref.float()).abs().max().item()
    assert scale > 0 and err <= scale * 2 ** -6, f"{what}: max err {err} vs max |ref| {scale}"


@pytest.mark.parametrize("option", [DQW_EARLY, hb.CAUSAL_OPTION])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-h{}x{}-q{}-k{}-d{}".format(*s[:6]))
def test_fused_equals_unfused(shape, causal, option, monkeypatch):
    dout, q, k, v, out, lse = _inputs(shape, causal, zlib.crc32(repr((shape, causal)).encode()))
    before = [t.clone() for t in (dout, q, k, v, out, lse)]
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "0")
    ref = hb.fa3_backward(dout, q, k, v, out, lse, causal=causal, option=option)
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "1")
    for call in range(2):   # the second call starts from the state the first left
        dq, dk, dv = _poisoned(shape, q.dtype)
        hb.fa3_backward(dout, q, k, v, out, lse, causal=causal, option=option, dq=dq, dk=dk, dv=dv)
        torch.cuda.synchronize()
        assert not dq.isnan().any(), f"call {call}: dq left poisoned"
        assert torch.equal(dk, ref[1]) and torch.equal(dv, ref[2]), f"call {call}: dk / dv differ from unfused"
        _close(dq, ref[0], f"call {call}: dq")
        _assert_rest_state_zero()
    for t, t0 in zip((dout, q, k, v, out, lse), before):
        assert torch.equal(t, t0), "an input was written"


def test_fused_cuda_graph(monkeypatch):
    """Captured with the switch on (a fresh zeroed accumulator inside the graph), replayed twice on new data."""
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "1")
    shape, causal = (2, 8, 2, 700, 900, 128, BF16), True
    args = _inputs(shape, causal, 5)
    static = [t.clone() for t in args]
    hb.fa3_backward(*static, causal=causal)   # warm-up: the build and launch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = hb.fa3_backward(*static, causal=causal)
    for seed in (6, 7):
        new = _inputs(shape, causal, seed)
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "0")
        ref = hb.fa3_backward(*new, causal=causal)
        monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "1")
        assert torch.equal(grads[1], ref[1]) and torch.equal(grads[2], ref[2]), "graph dk / dv differ"
        _close(grads[0], ref[0], "graph dq")


@pytest.mark.parametrize("variant", VARIANT_CASES, ids=lambda v: v[0])
@pytest.mark.parametrize("shape", VARIANT_SHAPES, ids=["gqa-d128", "mqa-q333-d64"])
def test_fused_variant_rule(variant, shape, monkeypatch):
    """The variant path (VARIANT_OPTION) fused: the verification rule (float64 golden, poisoned outputs, inputs
    unchanged), dK / dV bitwise the unfused kernel's, the kept state zero after."""
    from cubridge.runtime.variant_bwd import GradCase, VariantBackward
    name, params = variant
    bwd = VariantBackward(name, use_hopper=True, **params)
    b, hq, hkv, nq, nk, d, dtype, _ = shape
    case = GradCase(bwd.spec, params, (b, hq, hkv, nq, nk, d), dtype, seed=zlib.crc32(f"fuse{name}{shape}".encode()))
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "0")
    ref = bwd(case.dout, case.q, case.k, case.v, case.out, case.lse, sm_scale=d ** -0.5)
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "1")
    verdict = case.check(bwd)
    assert verdict.passed, f"{name}: {verdict}"
    grads = verdict.grads
    assert torch.equal(grads[1], ref[1]) and torch.equal(grads[2], ref[2]), "dk / dv differ from unfused"
    _close(grads[0], ref[0], "dq")
    _assert_rest_state_zero()
