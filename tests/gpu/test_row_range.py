"""The arithmetic KV range (cubridge/lower/rowrange.py, CUBRIDGE_ROW_RANGE=1) on fa3_sm90, under the
verification rule: each mask that qualifies (one interval per row, bounds nondecreasing in q) at
128 x 128 and 128 x 176, ragged lengths, MHA / GQA, both head dims; poisoned output fully written,
inputs unchanged, a bitwise second run. The range itself is checked tile by tile on the host
(tests/cpu/test_kv_range_rows.py); this runs the kernel built around it."""
from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cubridge import rule
from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.lower.rowrange import ROW_RANGE_ENV
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP != (9, 0), reason="fa3_sm90 needs an sm_90 GPU (H100 / H200)")
CORPUS = Path(__file__).resolve().parents[1] / "corpus"
SPECS = ["causal", "prefixlm", "causal_blockwise", "relative_pos", "sigmoid", "ag_causal", "ag_prefix_lm",
         "llama4_chunked", "ag_sliding_window", "mistral_sliding_window", "fa_local_softcap", "ag_head_mask"]
SHAPES = [(1, 4, 2, 1000, 128), (2, 8, 2, 300, 64), (1, 4, 1, 17, 128), (1, 2, 2, 2500, 128)]   # B, Hq, Hkv, N, D
# Windows wider than these lengths would be plain causal here: smaller ones so that the window shows.
PARAMS = {"llama4_chunked": {"chunk": 640}, "mistral_sliding_window": {"window": 700},
          "ag_sliding_window": {"window": 300}, "fa_local_softcap": {"left": 400, "right": 100, "softcap": 30.0},
          "ag_head_mask": {"window": 200}}


def _spec(name):
    path = CORPUS / f"{name}.py"
    return load_spec(str(path) if path.exists() else name)


@pytest.mark.parametrize("block_n", [128, 176])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", SPECS)
def test_row_range_passes_the_rule(name, shape, block_n, monkeypatch):
    from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
    monkeypatch.setenv(ROW_RANGE_ENV, "1")
    B, Hq, Hkv, N, D = shape
    spec, params = _spec(name), PARAMS.get(name, {})
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec, spec_params=params)
    kern = lower(cand.program, "fa3_sm90")
    assert "#define CUIR_ROW_RANGE 1" in kern.source, f"{name}: no arithmetic range"
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name}{shape}{block_n}".encode()))
    dtype = torch.float16 if N == 300 else torch.bfloat16
    q = torch.randn(B, Hq, N, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, device="cuda", generator=g).to(dtype)
    before = [t.clone() for t in (q, k, v)]
    cfg = replace(default_config(D, False, dtype == torch.bfloat16, N, variant=True), block_m=128, block_n=block_n)
    inputs = cand.bind(Nq=N, Nk=N, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": 128, "BLOCK_N": block_n},
                       device=q.device)
    launch = kern.args(inputs, q.device)

    def run():
        out = torch.full_like(q, float("nan"))
        fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=launch)
        torch.cuda.synchronize()
        return out
    out = run()
    assert not torch.isnan(out).any(), "some output element was never written"
    golden = spec.run_reference(q.double(), k.double(), v.double(), **params)
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v, **params))
    assert verdict.passed, f"{name} {shape} 128x{block_n}: {verdict}"
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"
    assert torch.equal(out, run()), "second run differs"
