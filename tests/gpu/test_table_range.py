"""The block-table masks' trimmed arithmetic KV range (cubridge/lower/tablerange.py,
CUBRIDGE_TABLE_RANGE=1) on fa3_sm90, under the verification rule: masks R & X (R an index-only
monotone row interval, X reading a table) at 128 x 128, ragged lengths, MHA / GQA, both head dims,
batches past the padded / packed tables' distinct rows; poisoned output fully written, inputs
unchanged, a bitwise second run. share_question and bitpacked_blocks visit empty tiles inside the
range (fully masked): correct, checked here too. The range itself is checked tile by tile on the host
(tests/cpu/test_kv_range_rows.py)."""
from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cubridge import rule
from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.lower.tablerange import TABLE_RANGE_ENV
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP != (9, 0), reason="fa3_sm90 needs an sm_90 GPU (H100 / H200)")
CORPUS = Path(__file__).resolve().parents[1] / "corpus"
SPECS = ["padded_causal", "packed_sequences", "share_question", "bitpacked_blocks"]
# B, Hq, Hkv, N, D (the corpus tables have 8 rows)
SHAPES = [(3, 4, 2, 1000, 128), (2, 8, 2, 300, 64), (1, 4, 1, 17, 128), (8, 2, 2, 2500, 128)]


def _spec(name):
    path = CORPUS / f"{name}.py"
    return load_spec(str(path) if path.exists() else name)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", SPECS)
def test_table_range_passes_the_rule(name, shape, monkeypatch):
    monkeypatch.setenv(TABLE_RANGE_ENV, "1")
    _lowered_passes_the_rule(name, shape, "#define CUIR_TABLE_RANGE 1", "no trimmed range", "")


def _lowered_passes_the_rule(name, shape, marker: str, missing: str, seed_tag: str):
    """`name` transferred and lowered under the current environment (its source must hold `marker`), run at
    128 x 128 on the GPU under the rule: every element written, inputs unchanged, a second run bitwise equal."""
    from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
    B, Hq, Hkv, N, D = shape
    spec = _spec(name)
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec, spec_params={})
    kern = lower(cand.program, "fa3_sm90")
    assert marker in kern.source, f"{name}: {missing}"
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{seed_tag}{name}{shape}".encode()))
    dtype = torch.float16 if N == 300 else torch.bfloat16
    q = torch.randn(B, Hq, N, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, device="cuda", generator=g).to(dtype)
    before = [t.clone() for t in (q, k, v)]
    cfg = replace(default_config(D, False, dtype == torch.bfloat16, N, variant=True), block_m=128, block_n=128)
    inputs = cand.bind(Nq=N, Nk=N, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": 128, "BLOCK_N": 128},
                       device=q.device)
    launch = kern.args(inputs, q.device)

    def run():
        out = torch.full_like(q, float("nan"))
        fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=launch)
        torch.cuda.synchronize()
        return out
    out = run()
    assert not torch.isnan(out).any(), "some output element was never written"
    golden = spec.run_reference(q.double(), k.double(), v.double())
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v))
    assert verdict.passed, f"{name} {shape}: {verdict}"
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"
    assert torch.equal(out, run()), "second run differs"


# CUBRIDGE_CLASS_HEAD0=1 (session 16, cubridge/lower/itspace.py): a per-(b, h) block table of a mask that reads no h
# read at head 0 for every head, under both ranges (the trimmed one and the bitmap scan); the masks with such a table.
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("table_range", ["1", "0"])
@pytest.mark.parametrize("name", ["padded_causal", "packed_sequences"])
def test_class_head0_passes_the_rule(name, table_range, shape, monkeypatch):
    from cubridge.lower.itspace import HEAD0_ENV
    monkeypatch.setenv(TABLE_RANGE_ENV, table_range)
    monkeypatch.setenv(HEAD0_ENV, "1")
    _lowered_passes_the_rule(name, shape, "#define CUIR_CLASS_HEAD0 1", "no head-0 classes", "h0")


# Session 17 (pad17, tablerange.py), off by default: CUBRIDGE_FULL_BITS=1, the consumers' bitmap of full tiles (one
# round trip per warp at a work tile's start, a ballot; tile_partial a bit test), and CUBRIDGE_TABLE_ROWS=1, every
# partial tile in one pass by R's row interval and X's column bits, X skipped on the tile R cuts and X keeps whole
# (kernel.cu score_and_mask_x); each alone and both, under the trimmed range. The document masks and ag_head_mask
# (no trimmed range: the switches must leave them as they are) under the rule too.
SWITCH_SPECS = ["padded_causal", "packed_sequences", "document", "ag_document_causal", "ag_head_mask"]
SWITCHES = {"full_bits": ("1", "0"), "table_rows": ("0", "1"), "both": ("1", "1")}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", SWITCH_SPECS)
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_s17_switches_pass_the_rule(switch, name, shape, monkeypatch):
    from cubridge.lower.tablerange import FULL_BITS_ENV, TABLE_ROWS_ENV
    full_bits, table_rows = SWITCHES[switch]
    monkeypatch.setenv(FULL_BITS_ENV, full_bits)
    monkeypatch.setenv(TABLE_ROWS_ENV, table_rows)
    monkeypatch.setenv(TABLE_RANGE_ENV, "1")
    ranged = name in ("padded_causal", "packed_sequences", "document")
    marker = ("#define CUIR_FULL_BITS 1" if full_bits == "1" else "#define CUIR_TABLE_ROWS 1") if ranged else ""
    _lowered_passes_the_rule(name, shape, marker, f"{switch}: not in the source", f"s17{switch}")
