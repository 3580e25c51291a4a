"""The lift check: each reference kernel's CUDA and its CuIR program, run by the interpreter on the
same inputs, agree within the verification rule (and each passes it against the float64 golden).
This is what makes a lifted CuIR program trustworthy as the source of transfers."""
from __future__ import annotations

import pytest
import torch

from cubridge import rule
from cubridge.cuir.interp import interpret
from cubridge.cuir.parser import parse_file
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
SHAPES = [(1, 4, 2, 300, 64), (2, 2, 2, 130, 128), (1, 8, 1, 77, 64)]   # B, Hq, Hkv, N, D


def _cuda(ref, q, k, v, causal):
    if ref == "fa2_sm80":
        from cubridge.runtime.fa2_sm80 import Fa2Sm80
        return Fa2Sm80()(q, k, v, causal=causal)
    from cubridge.runtime.fa3_sm90 import fa3_forward
    return fa3_forward(q, k, v, causal=causal)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ref", ["fa2_sm80", "fa3_sm90"])
def test_cuda_and_cuir_agree(ref, causal, shape):
    if ref == "fa3_sm90" and CAP != (9, 0):
        pytest.skip("fa3_sm90 needs an sm_90 GPU")
    if CAP < (8, 0):
        pytest.skip("needs an sm_80+ GPU")
    B, Hq, Hkv, N, D = shape
    g = torch.Generator(device="cuda").manual_seed(N * 7 + D + causal)
    q, k, v = (torch.randn(B, h, N, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    out, lse = _cuda(ref, q, k, v, causal)
    torch.cuda.synchronize()
    prog = parse_file(ref_kernel_dir(ref) / "kernel.cuir")
    run = interpret(prog, {"Q": q.cpu(), "K": k.cpu(), "V": v.cpu()}, params={"CAUSAL": int(causal)})
    spec = load_spec("causal" if causal else "full")
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    golden = spec.run_reference(qc.double(), kc.double(), vc.double())
    ref_out = spec.run_reference(qc, kc, vc)
    cuda_v = rule.compare(out.cpu(), golden, ref_out)
    interp_v = rule.compare(run.outputs["O"], golden, ref_out)
    assert cuda_v.passed, f"CUDA: {cuda_v}"
    assert interp_v.passed, f"interpreter: {interp_v}"
    gap = (out.cpu().double() - run.outputs["O"].double()).abs().max().item()
    assert gap <= cuda_v.bound, f"CUDA and CuIR differ by {gap:.3e} > {cuda_v.bound:.3e}"
    lse_gap = (lse.cpu() - run.outputs["LSE"]).abs().max().item()
    assert lse_gap <= 1e-2, f"LSE differs by {lse_gap:.3e}"
