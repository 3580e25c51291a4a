"""Lowered variants with their host tile order in L2 sections of heads (CUBRIDGE_LPT_SECTIONS=1, the
default since session 17; runtime.lpt.section_shift, fa3_sm90.lpt_order's shift) on fa3_sm90, under the
verification rule:
float64 golden, poisoned output fully written, inputs unchanged, a bitwise second run, and bitwise equal
to the head-by-head order (a variant has no tail split: a tile's result does not depend on when it runs).
Shapes with one section, with two and a short last one, and a per-call variant (runtime inputs: the
order sorted on the GPU, runtime.lpt). The GPU order equals lpt_order's at every shift. CPU side:
tests/cpu/test_lpt_sections.py."""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from cubridge import rule
from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.paths import ref_kernel_dir
from cubridge.runtime.lpt import SECTIONS_ENV, section_shift
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP != (9, 0), reason="fa3_sm90 needs an sm_90 GPU (H100 / H200)")
CORPUS = Path(__file__).resolve().parents[1] / "corpus"
# (spec, spec params): an interval mask (prefixlm: 128 x 176 from 8k), a window with a softcap, outliers first
# (global_sliding_window's first query block sees every key), runtime inputs (document: per call)
SPECS = [("prefixlm", {}), ("gemma2_local", {"window": 1024}), ("global_sliding_window", {}), ("document", {})]
# B, Hq, Hkv, N, D: at 1k 64 heads a section (80 = 64 + a short 16); at 3000 one section of all 6 (8 would fit).
# Small float64 goldens (under 1 GB: the job runs 8 workers); one head dim and tile (128 x 128 below 8k): one build
# per spec.
SHAPES = [(2, 40, 8, 1024, 128), (1, 6, 2, 3000, 128)]


def _spec(name):
    path = CORPUS / f"{name}.py"
    return load_spec(str(path) if path.exists() else name)


def _documents(B, Nk, seed):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(1, 700, (B, Nk // 40 + 2), generator=g).cumsum(1)
    return torch.stack([torch.bucketize(torch.arange(Nk), row, right=True) for row in cuts]).to("cuda", torch.int32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name,params", SPECS, ids=[s for s, _ in SPECS])
def test_lowered_variant_in_sections_passes_the_rule(name, params, shape, monkeypatch):
    from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
    B, Hq, Hkv, N, D = shape
    spec = _spec(name)
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec, spec_params=params)
    kern = lower(cand.program, "fa3_sm90")
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"lptsec{name}{shape}".encode()))
    q = torch.randn(B, Hq, N, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, Hkv, N, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, Hkv, N, D, device="cuda", generator=g).to(torch.bfloat16)
    before = [t.clone() for t in (q, k, v)]
    cfg = default_config(D, False, True, N, variant=True)
    runtime = {"doc_ids": _documents(B, N, 3)} if name == "document" else None
    inputs = cand.bind(Nq=N, Nk=N, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n},
                       device=q.device, runtime=runtime)

    def run(on: str):
        monkeypatch.setenv(SECTIONS_ENV, on)                 # read when the launch is packed
        launch = kern.args(inputs, q.device, per_call=runtime is not None)
        assert launch.lpt_sections == (on == "1")
        out = torch.full_like(q, float("nan"))
        fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=launch)
        torch.cuda.synchronize()
        return out, [key[-1] for key in launch.tile_orders]
    out, shifts = run("1")
    want = section_shift(N, D, B * Hq)
    assert want > 0 and shifts == [want], f"the order was not sectioned: {shifts} (want shift {want})"
    assert not torch.isnan(out).any(), "some output element was never written"
    golden = spec.run_reference(q.double(), k.double(), v.double(), runtime=runtime, **params)
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v, runtime=runtime, **params))
    assert verdict.passed, f"{name} {shape}: {verdict}"
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"
    assert torch.equal(out, run("1")[0]), "second run differs"
    off, shifts = run("0")
    assert shifts == [0] and torch.equal(out, off), "sections and head by head differ"


@pytest.mark.parametrize("sort_in_kernel", [False, True])
@pytest.mark.parametrize("shift", [1, 2, 3, 5])
@pytest.mark.parametrize("bh,num_m,ctas", [(4, 8, 132), (32, 64, 132), (3, 1500, 7), (5, 13, 2), (64, 64, 132)])
def test_gpu_order_in_sections_equals_lpt_order(bh, num_m, ctas, shift, sort_in_kernel, monkeypatch):
    """runtime.lpt's key kernel (+ argsort, or the in-kernel sort up to 4096 tiles) at a shift: exactly
    lpt_order's permutation (outliers, ties, clamped counts, a short last section)."""
    from cubridge.runtime import lpt
    from cubridge.runtime.fa3_sm90 import current_stream, lpt_order
    monkeypatch.setattr(lpt, "SORT_IN_KERNEL", sort_in_kernel)
    g = torch.Generator().manual_seed(bh * num_m + ctas + shift)
    counts = torch.randint(0, 20, (bh * num_m,), generator=g, dtype=torch.int32)
    spots = torch.randperm(bh * num_m, generator=g)[:3]
    counts[spots] = torch.tensor([500, 70000, -4], dtype=torch.int32)[:len(spots)]
    want = lpt_order(counts.view(bh, num_m), ctas, shift)
    got = lpt.gpu_lpt_order(counts.cuda(), num_m, ctas, current_stream(torch.cuda.current_device()), shift=shift)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
