"""All ten variants, transferred by the rules proposer and lowered onto both reference kernels
(fa3_sm90 on Hopper, fa2_sm80 on sm_80+), under the verification rule on the GPU: golden = the spec's reference in float64, ref = the
same reference in the kernel dtype; poisoned outputs fully written; inputs unchanged; bitwise
determinism. Ragged lengths, MHA / GQA / MQA, both head dims."""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from cubridge import rule
from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.paths import ref_kernel_dir
from cubridge.spec import builtin_specs, load_spec
from cubridge.transfer.rules import transfer

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP < (8, 0), reason="needs an sm_80+ GPU")
SHAPES = [  # B, Hq, Hkv, N, D
    (1, 4, 4, 1000, 128), (2, 8, 2, 300, 64), (1, 4, 1, 17, 128), (1, 2, 2, 2500, 128)]


@pytest.fixture(scope="module", params=["fa3_sm90", "fa2_sm80"])
def reference(request):
    if request.param == "fa3_sm90" and CAP != (9, 0):
        pytest.skip("fa3_sm90 needs an sm_90 GPU (H100 / H200)")
    return request.param, parse_file(ref_kernel_dir(request.param) / "kernel.cuir")


def _run(ref, kern, cand, q, k, v, D):
    B, Hq, N, _ = q.shape
    out = torch.full_like(q, float("nan"))
    if ref == "fa3_sm90":
        from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
        cfg = default_config(D, False, q.dtype == torch.bfloat16, N, variant=True)
        bm, bn = cfg.block_m, cfg.block_n
    else:
        from cubridge.runtime.fa2_sm80 import Fa2Sm80, default_config
        cfg = default_config(D)
        bm, bn = cfg.block_m, cfg.block_n
    inputs = cand.bind(Nq=N, Nk=k.shape[2], Hq=Hq, Hkv=k.shape[1], B=B,
                       params={"BLOCK_M": bm, "BLOCK_N": bn}, device=q.device)
    launch = kern.args(inputs, q.device)
    if ref == "fa3_sm90":
        fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=launch)
    else:
        Fa2Sm80(cfg)(q, k, v, causal=False, out=out, variant=launch)
    torch.cuda.synchronize()
    return out


def _check(ref_name, program, name, shape, *, params=None, gain=1.0):
    """Transfer, lower and run one variant at one shape; the rule, unwritten outputs, unchanged
    inputs and a bitwise second run. gain scales q and k (saturating softcaps and sigmoids)."""
    B, Hq, Hkv, N, D = shape
    params = params or {}
    spec = load_spec(name)
    cand = transfer(program, spec, spec_params=params)
    kern = lower(cand.program, ref_name)
    seed = f"{name}{shape}" if not params and gain == 1.0 else f"{name}{params}{gain}{shape}"
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(seed.encode()))
    dtype = torch.float16 if N == 300 else torch.bfloat16
    q = (gain * torch.randn(B, Hq, N, D, device="cuda", generator=g)).to(dtype)
    k = (gain * torch.randn(B, Hkv, N, D, device="cuda", generator=g)).to(dtype)
    v = torch.randn(B, Hkv, N, D, device="cuda", generator=g).to(dtype)
    before = [t.clone() for t in (q, k, v)]
    out = _run(ref_name, kern, cand, q, k, v, D)
    assert not torch.isnan(out).any(), "some output element was never written"
    golden = spec.run_reference(q.double(), k.double(), v.double(), **params)
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v, **params))
    assert verdict.passed, f"{name} {params or ''} x{gain} {shape}: {verdict}"
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"
    assert torch.equal(out, _run(ref_name, kern, cand, q, k, v, D)), "second run differs"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", builtin_specs())
def test_variant_on_gpu(reference, name, shape):
    _check(*reference, name, shape)


# Composite's softcap fused into its sigmoid (cubridge/lower/fusion.py) takes a polynomial where
# |bias| <= its bound (14.79 at softcap 50, 5.54 at 30) and the tanh elsewhere: both paths, with
# scores scaled up so the softcap and the sigmoid saturate.
FUSION_CASES = [({"bias": 20.0}, 1.0), ({"bias": -14.0}, 1.0), ({"bias": -14.0}, 4.0), ({"softcap": 30.0}, 1.0),
                ({"softcap": 30.0, "bias": 0.0}, 4.0), ({"bias": 0.5}, 4.0)]


@pytest.mark.parametrize("shape", [(1, 4, 4, 1000, 128), (2, 8, 2, 300, 64), (1, 4, 1, 17, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("params, gain", FUSION_CASES, ids=lambda c: str(c))
def test_composite_softcap_sigmoid_paths(reference, params, gain, shape):
    _check(*reference, "composite", shape, params=params, gain=gain)


# A scattered block-sparse layout (tests/corpus/bitpacked_blocks.py): a query tile's KV tiles form
# many runs, which a block-table range keeps as a bitmap (cubridge/lower/itspace.py bitmap_region);
# blocks of 64 keys split 128-key tiles (partial tiles), and 17000 keys make 133 fa3 tiles, more
# than the bitmap's 128-tile window (its tail runs, fully masked where empty).
BITPACKED = str(Path(__file__).resolve().parents[1] / "corpus" / "bitpacked_blocks.py")


@pytest.mark.parametrize("params, shape", [({"block": 128}, (1, 4, 2, 3000, 128)),
                                           ({"block": 64, "density": 0.5}, (2, 4, 1, 2500, 64)),
                                           ({"block": 128}, (1, 1, 1, 17000, 128))],
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c))
def test_scattered_block_table_on_gpu(reference, params, shape):
    _check(*reference, BITPACKED, shape, params=params)


# T5-style clamped bucket biases (tests/corpus/t5_*.py, longt5_local.py): full fa3 tiles wholly past
# the saturation bounds (cubridge/lower/saturate.py) evaluate the score_mod at the bound. The scores
# are bitwise those of the per-pair path, so the output must equal, bit for bit, the kernel built
# without the bounds (the CUIR_SAT defines removed), besides passing the rule.
CORPUS = Path(BITPACKED).parent


@pytest.mark.parametrize("name", ["t5_encoder_bias", "t5_decoder_bias", "longt5_local"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 1000, 128), (2, 4, 1, 2500, 64), (1, 2, 2, 300, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_saturated_score_is_bitwise_the_per_pair_score(name, shape):
    import dataclasses
    if CAP != (9, 0):
        pytest.skip("fa3_sm90 needs an sm_90 GPU (H100 / H200)")
    program = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
    params = {"radius": 500} if name == "longt5_local" else {}   # full tiles past 91 only where the window is wide
    _check("fa3_sm90", program, str(CORPUS / f"{name}.py"), shape, params=params)
    spec = load_spec(str(CORPUS / f"{name}.py"))
    cand = transfer(program, spec, spec_params=params)
    kern = lower(cand.program, "fa3_sm90")
    assert "#define CUIR_SAT_HI" in kern.source
    plain = dataclasses.replace(kern, source="\n".join(line for line in kern.source.splitlines()
                                                       if not line.startswith("#define CUIR_SAT")))
    B, Hq, Hkv, N, D = shape
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    q, k, v = (torch.randn(B, h, N, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    assert torch.equal(_run("fa3_sm90", kern, cand, q, k, v, D), _run("fa3_sm90", plain, cand, q, k, v, D))
