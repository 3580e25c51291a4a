"""The adversarial corpus on the GPU (issue 20, item 3): lowering patches of fa2_sm80's kernel.cu
that only the compiled kernel shows to be wrong (tests/adversarial/cuda_cheats.py: a skipped KV
tile, right only at short lengths, half of O unwritten, LSE off by 5) pass the CPU guard and must be
rejected here under the rule: poisoned O fully written, O within the rule's bound of the float64
golden, LSE within the rule's bound of the float64 log-sum-exp. The unpatched kernel passes the same
check (so the check can pass)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cubridge import rule
from cubridge.spec import load_spec
from cubridge.verify import lse_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adversarial"))
from cuda_cheats import KERNEL, OUTPUT_CHEATS  # noqa: E402

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP < (8, 0), reason="needs an sm_80+ GPU")
SHAPES = [(1, 4, 2, 1000, 64), (2, 2, 1, 300, 128)]    # B, Hq, Hkv, N, D: 16 KV tiles; ragged


def problems(source: str, shape) -> list[str]:
    """Why this kernel source fails the rule at `shape` (causal, bf16); empty when it passes."""
    from cubridge.llm.regions import apply_patch  # noqa: F401  (the source is already patched)
    from cubridge.runtime.build import compile_cubin
    from cubridge.runtime.fa2_sm80 import Fa2Sm80
    B, Hq, Hkv, N, D = shape
    fa2 = Fa2Sm80(compiler="nvcc")
    arch = f"sm_{CAP[0]}{CAP[1]}"
    cubin = compile_cubin(source, arch=arch, options=fa2.options(D, torch.bfloat16, True), compiler="nvcc",
                          name="cheat.cu").cubin
    g = torch.Generator(device="cuda").manual_seed(N * 31 + D)
    q, k, v = (torch.randn(B, h, N, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, N), float("nan"), device="cuda")
    fa2(q, k, v, causal=True, out=out, lse=lse, cubin=cubin)
    torch.cuda.synchronize()
    spec, found = load_spec("causal"), []
    if torch.isnan(out).any():
        found.append(f"{int(torch.isnan(out).sum())} O elements never written")
    verdict = rule.compare(out, spec.run_reference(q.double(), k.double(), v.double()), spec.run_reference(q, k, v))
    if not verdict.passed:
        found.append(f"O: {verdict.reason}")
    qc, kc = q.cpu(), k.cpu()
    lse_verdict = rule.compare(lse.cpu(), lse_of(spec, qc.double(), kc.double(), {}), lse_of(spec, qc, kc, {}))
    if not lse_verdict.passed:
        found.append(f"LSE: {lse_verdict.reason}")
    return found


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_unpatched_kernel_passes(shape):
    assert problems(KERNEL, shape) == []


@pytest.mark.parametrize("name, patch", OUTPUT_CHEATS, ids=[c[0] for c in OUTPUT_CHEATS])
def test_output_cheat_is_rejected_on_the_gpu(name, patch):
    from cubridge.llm.regions import apply_patch
    source = apply_patch(KERNEL, patch)
    found = problems(source, SHAPES[0])
    assert found, f"{name}: the GPU check found nothing wrong"
    expected = {"skip_the_last_kv_tile": "O: ", "pass_only_at_short_lengths": "O: ",
                "write_part_of_O": "never written", "wrong_lse": "LSE: "}[name]
    assert any(expected in f for f in found), found
