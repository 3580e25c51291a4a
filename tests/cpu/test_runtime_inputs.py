"""Runtime inputs (issue 15, deliverable 3) and queries aligned to the end of the keys (Nq < Nk):
declaration, checks with their messages, representative values, the binding (per-shape cache,
runtime inputs passed through, the host path for derived captures), block tables, and the
interpreter's verification with two document layouts in a row and at Nq < Nk."""
from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest
import torch

from cubridge import inputs as rt
from cubridge import rule
from cubridge.cuir.interp import interpret
from cubridge.cuir.parser import parse_file
from cubridge.errors import LaunchError, SpecError
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.transfer import call_binding as binding_module
from cubridge.transfer.call_binding import bind_inputs
from cubridge.transfer.rules import Binding, block_classes, transfer
from cubridge.verify import Case, make_inputs, verify_transfer

REFS = ("fa2_sm80", "fa3_sm90")
DOC = {"doc_ids": rt.RuntimeInput(("B", "Nk"))}


@pytest.fixture(scope="module")
def programs():
    return {r: parse_file(ref_kernel_dir(r) / "kernel.cuir") for r in REFS}


@pytest.fixture(scope="module")
def document(programs):
    return {r: transfer(programs[r], load_spec("document")) for r in REFS}


def _spec_file(tmp_path, body: str):
    path = tmp_path / "runtime_spec.py"
    path.write_text(textwrap.dedent(body))
    return path


def layout(B, Nk, cuts):
    """Document ids with documents starting at `cuts` (the same in every batch row but the last,
    which gets one more boundary so that rows differ)."""
    ids = torch.zeros(B, Nk, dtype=torch.int64)
    for c in cuts:
        ids[:, c:] += 1
    ids[-1, Nk // 3:] += 1
    return ids


# ------------------------------------------------------------------ declaration
def test_document_spec_declares_its_runtime_input():
    spec = load_spec("document")
    assert spec.runtime_inputs == {"doc_ids": rt.RuntimeInput(("B", "Nk"), "int32", "segments")}


@pytest.mark.parametrize("decl, message", [
    ('{"doc_ids": rt.RuntimeInput(("B", "Nk"), "int8")}', "dtype 'int8'"),
    ('{"doc_ids": ("B", "Nq")}', "a size Nq"),
    ('{"doc_ids": ("B", "Nk"), "window": ("B",)}', "also a PARAMS name"),
    ('{"doc_ids": rt.RuntimeInput(("B", "Nk"), kind="zipf")}', "kind 'zipf'"),
])
def test_bad_declarations_are_refused(tmp_path, decl, message):
    path = _spec_file(tmp_path, f"""
        import cubridge.inputs as rt
        from cubridge.spec import Hooks
        PARAMS = {{"window": 4}}
        RUNTIME_INPUTS = {decl}
        def hooks(Nq, Nk, Hq, Hkv, device, *, doc_ids, window=4):
            return Hooks()
        def reference(q, k, v, *, doc_ids, window=4):
            return q
        """)
    with pytest.raises(SpecError, match=message):
        load_spec(path)


def test_runtime_inputs_need_a_hooks_factory_and_keyword_arguments(tmp_path):
    path = _spec_file(tmp_path, """
        RUNTIME_INPUTS = {"doc_ids": ("B", "Nk")}
        def reference(q, k, v, *, doc_ids):
            return q
        """)
    with pytest.raises(SpecError, match="without a hooks"):
        load_spec(path)
    path.write_text(path.read_text().replace("*, doc_ids", "*, ids") + "\ndef hooks(Nq, Nk, Hq, Hkv, device, *, doc_ids):\n    pass\n")
    with pytest.raises(SpecError, match="reference is defined as"):
        load_spec(path)


# ------------------------------------------------------------------ checks
def _check(runtime, **shape):
    dims = {"Nk": 300, "Hq": 4, "Hkv": 2, "B": 2, **shape}
    return rt.check(DOC, runtime, params={}, device="cpu", **dims)


def test_check_accepts_any_integer_dtype():
    for dtype in (torch.int32, torch.int64, torch.int16):
        ids = torch.zeros(2, 300, dtype=dtype)
        assert _check({"doc_ids": ids})["doc_ids"] is ids


@pytest.mark.parametrize("runtime, message, hint", [
    ({}, "missing runtime input.s. doc_ids", r"pass doc_ids=<tensor \[B, Nk\]>"),
    ({"doc_ids": torch.zeros(2, 300), "ids": torch.zeros(1)}, "unexpected runtime input.s. ids",
     "declares: doc_ids"),
    ({"doc_ids": torch.zeros(2, 299, dtype=torch.int32)}, r"shape \[2, 299\], expected \[B, Nk\] = \[2, 300\]",
     "B=2, Nk=300"),
    ({"doc_ids": torch.zeros(300, dtype=torch.int32)}, r"shape \[300\], expected \[B, Nk\]", "pass doc_ids"),
    ({"doc_ids": torch.zeros(2, 300)}, "dtype torch.float32, expected int32", r"doc_ids.to\(torch.int32\)"),
    ({"doc_ids": [0] * 300}, "is a list, not a tensor", "torch tensor"),
    ({"doc_ids": torch.zeros(2, 300, dtype=torch.int32, device="meta")}, "is on meta, the call runs on cpu",
     r"doc_ids.to\('cpu'\)"),
])
def test_bad_runtime_inputs_say_what_and_how_to_fix(runtime, message, hint):
    with pytest.raises(LaunchError, match=message) as exc:
        _check(runtime)
    assert exc.value.hint and __import__("re").search(hint, exc.value.hint), exc.value.hint


def test_named_sizes_must_agree_between_inputs():
    decl = {"bias": rt.RuntimeInput(("Hq", "buckets"), "float32"), "scale": rt.RuntimeInput(("buckets",), "float32")}
    ok = {"bias": torch.zeros(4, 32), "scale": torch.zeros(32)}
    rt.check(decl, ok, Nk=8, Hq=4, Hkv=4, B=1, params={}, device="cpu")
    with pytest.raises(LaunchError, match=r"scale has shape \[31\], expected \[buckets\] = \[32\]"):
        rt.check(decl, {**ok, "scale": torch.zeros(31)}, Nk=8, Hq=4, Hkv=4, B=1, params={}, device="cpu")


# ------------------------------------------------------------------ representative values
def test_segments_are_sorted_documents_of_100_to_2000_tokens():
    ids = rt.sample(DOC, Nq=8192, Nk=8192, Hq=16, Hkv=4, B=3)["doc_ids"]
    assert ids.shape == (3, 8192) and ids.dtype == torch.int32
    for row in ids:
        assert (row[1:] >= row[:-1]).all() and row[0] == 0
        lengths = torch.unique_consecutive(row, return_counts=True)[1]
        assert len(lengths) >= 4 and (lengths[:-1] >= 100).all() and (lengths <= 2000).all()
    assert not torch.equal(ids[0], ids[1])               # each sequence its own layout
    again = rt.sample(DOC, Nq=8192, Nk=8192, Hq=16, Hkv=4, B=3)["doc_ids"]
    assert torch.equal(ids, again)                        # a function of the shape
    short = rt.sample(DOC, Nq=300, Nk=300, Hq=2, Hkv=1, B=1)["doc_ids"][0]
    assert 2 <= len(torch.unique(short)) <= 6             # boundaries inside the test shapes' tiles


def test_default_kinds_and_the_spec_hook(tmp_path):
    decl = {"prefix": rt.RuntimeInput(("B",)), "bias": rt.RuntimeInput(("Hq", 5), "float32"),
            "keep": rt.RuntimeInput(("Nk",), "bool")}
    out = rt.sample(decl, Nq=10, Nk=10, Hq=3, Hkv=1, B=4)
    assert out["prefix"].shape == (4,) and 0 <= out["prefix"].min() and out["prefix"].max() <= 10
    assert out["bias"].dtype == torch.float32 and out["bias"].std() > 0
    assert out["keep"].dtype == torch.bool
    bad = lambda Nq, Nk, Hq, Hkv, B, device, gen: {"prefix": torch.zeros(B + 1, dtype=torch.int32)}  # noqa: E731
    with pytest.raises(LaunchError, match=r"prefix has shape \[5\]"):
        rt.sample({"prefix": decl["prefix"]}, Nq=10, Nk=10, Hq=3, Hkv=1, B=4, sampler=bad)


# ------------------------------------------------------------------ binding
def test_binding_passes_runtime_inputs_through_and_builds_their_table(document):
    cand = document["fa2_sm80"]
    assert cand.runtime == {"DOC_IDS": "doc_ids"} and cand.table_reads_runtime and not cand.host_path
    ids = layout(2, 300, (100, 230)).to(torch.int32)
    cached = set(binding_module._CACHE)       # keys (the cache is a bounded LRU: its length can stay put)
    extra = cand.bind(Nq=300, Nk=300, Hq=4, Hkv=2, B=2, runtime={"doc_ids": ids})
    assert extra["DOC_IDS"] is ids                        # int32 already: no copy
    hooks = load_spec("document").hooks_for(300, 300, 4, 2, B=2, runtime={"doc_ids": ids})
    assert torch.equal(extra["BLOCK_CLASS"], block_classes(hooks, 2, 4, 300, 300, 128, 64, True))
    other = cand.bind(Nq=300, Nk=300, Hq=4, Hkv=2, B=2, runtime={"doc_ids": layout(2, 300, (64,))})
    assert not torch.equal(other["BLOCK_CLASS"], extra["BLOCK_CLASS"])     # the table follows the batch
    assert len(set(binding_module._CACHE) - cached) <= 1   # one shape, one static part (0: an earlier test bound it)
    # a search worker binds from the Binding JSON alone (no transfer): the same inputs
    worker = Binding.from_json(json.loads(json.dumps(cand.binding.to_json())))
    again = bind_inputs(worker, load_spec("document"), {}, Nq=300, Nk=300, Hq=4, Hkv=2, B=2,
                        runtime={"doc_ids": ids})
    assert again.keys() == extra.keys() and all(torch.equal(again[k], extra[k]) for k in extra)


def test_binding_refuses_bad_calls(document):
    cand = document["fa3_sm90"]
    with pytest.raises(LaunchError, match="missing runtime input"):
        cand.bind(Nq=300, Nk=300, Hq=4, Hkv=2, B=2, runtime={})
    with pytest.raises(LaunchError, match=r"expected \[B, Nk\] = \[2, 300\]"):
        cand.bind(Nq=300, Nk=300, Hq=4, Hkv=2, B=2, runtime={"doc_ids": torch.zeros(1, 300, dtype=torch.int32)})
    with pytest.raises(SpecError, match="Nq=301 > Nk=300"):
        cand.bind(Nq=301, Nk=300, Hq=4, Hkv=2, B=2)


def test_captures_derived_from_runtime_inputs_take_the_host_path(tmp_path, programs):
    path = _spec_file(tmp_path, """
        from cubridge.spec import Hooks
        from cubridge.specs.document import reference
        RUNTIME_INPUTS = {"doc_ids": ("B", "Nk")}
        def hooks(Nq, Nk, Hq, Hkv, device, *, doc_ids):
            shifted = doc_ids.long() + 7          # a new tensor computed from the runtime input
            def mask(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (shifted[b, q_idx] == shifted[b, kv_idx])
            return Hooks(mask_mod=mask)
        """)
    spec = load_spec(path)
    cand = transfer(programs["fa2_sm80"], spec)
    assert cand.host_path and cand.derived == ("SHIFTED",) and cand.runtime == {}
    for cuts in ((100,), (40, 250)):
        ids = layout(1, 300, cuts)
        extra = cand.bind(Nq=200, Nk=300, Hq=2, Hkv=1, B=1, runtime={"doc_ids": ids})
        assert torch.equal(extra["SHIFTED"], ids + 7)
        assert _interpreted_error(cand, spec, Case(1, 2, 1, 200, 300, 16, 0), {"doc_ids": ids}).passed


# ------------------------------------------------------------------ verification in the interpreter
def _interpreted_error(cand, spec, case, runtime):
    q, k, v = make_inputs(case, torch.bfloat16)
    extra = cand.bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B, runtime=runtime)
    out = interpret(cand.program, {"Q": q, "K": k, "V": v, **extra}).outputs["O"]
    golden = spec.run_reference(q.double(), k.double(), v.double(), runtime=runtime)
    return rule.compare(out, golden, spec.run_reference(q, k, v, runtime=runtime))


@pytest.mark.parametrize("ref", REFS)
def test_two_document_layouts_in_a_row_both_pass(document, ref):
    spec, cand = load_spec("document"), document[ref]
    case = Case(2, 2, 1, 150, 290, 16, 5)
    first, second = layout(2, 290, (70, 200)), layout(2, 290, (150,))
    for ids in (first, second):
        verdict = _interpreted_error(cand, spec, case, {"doc_ids": ids})
        assert verdict.passed, verdict.reason
    # and not vacuously: the first layout's inputs cannot answer for the second batch
    q, k, v = make_inputs(case, torch.bfloat16)
    stale = cand.bind(Nq=150, Nk=290, Hq=2, Hkv=1, B=2, runtime={"doc_ids": first})
    out = interpret(cand.program, {"Q": q, "K": k, "V": v, **stale}).outputs["O"]
    golden = spec.run_reference(q.double(), k.double(), v.double(), runtime={"doc_ids": second})
    assert not rule.compare(out, golden, spec.run_reference(q, k, v, runtime={"doc_ids": second})).passed


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("name", ["causal", "prefixlm", "document"])
def test_fewer_queries_than_keys_verify(programs, ref, name):
    cases = [Case(1, 2, 1, 70, 300, 16, 1), Case(2, 4, 2, 1, 129, 16, 2), Case(1, 2, 2, 200, 201, 16, 3)]
    rep = verify_transfer(programs[ref], load_spec(name), cases=cases, schedules=("in_order",))
    assert rep.passed, rep.table()


def test_end_alignment_is_not_vacuous(programs):
    """A program with top-left queries (the old convention) fails at Nq < Nk."""
    cand = transfer(programs["fa2_sm80"], load_spec("causal"))
    case = Case(1, 2, 1, 70, 300, 16, 1)
    q, k, v = make_inputs(case, torch.bfloat16)
    spec = load_spec("causal")
    top_left = spec.reference(q.double(), k.double(), v.double())
    out = interpret(cand.program, {"Q": q, "K": k, "V": v}).outputs["O"]
    assert (out.double() - top_left).abs().max() > 0.1
    golden = spec.run_reference(q.double(), k.double(), v.double())
    assert rule.compare(out, golden, spec.run_reference(q, k, v)).passed


def test_host_block_table_uses_query_positions():
    hooks = load_spec("causal").hooks_for(64, 256, 1, 1)
    table = block_classes(hooks, 1, 1, 64, 256, 64, 64, False)
    # one query tile at positions 192..255: tiles 0-2 full, the diagonal tile 3 partial
    assert table.tolist() == [[2, 2, 2, 1]]


# ------------------------------------------------------------------ lowering
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_document_lowers_and_its_table_kernel_compiles(document, tmp_path):
    from cubridge.lower import lower
    from cubridge.runtime.block_table import table_source
    jobs = []
    for ref, arch, hd in (("fa2_sm80", "-arch=sm_80", "-DHEAD_DIM=128"),
                          ("fa3_sm90", "-gencode=arch=compute_90a,code=sm_90a", "-DHEAD_DIM=128")):
        src = tmp_path / f"{ref}.cu"
        src.write_text(lower(document[ref].program, ref).source)
        jobs.append(["nvcc", "-cubin", "-std=c++17", arch, hd, f"-I{ref_kernel_dir(ref)}", "-o", str(src) + ".cubin", str(src)])
    cand = document["fa3_sm90"]
    extra = cand.bind(Nq=300, Nk=300, Hq=2, Hkv=1, B=1)
    lowered, reads_h = table_source(cand.binding.mask, extra, [])
    assert not reads_h and "mask_pred(va, b, h, q0 + e / cols + shift" in lowered.source
    table = tmp_path / "table.cu"
    table.write_text(lowered.source)
    jobs.append(["nvcc", "-cubin", "-std=c++17", "-arch=sm_90a", "-o", str(table) + ".cubin", str(table)])
    for cmd in jobs:
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------------ other kinds of runtime input
SUPPORT = __import__("pathlib").Path(__file__).parents[1] / "support" / "specs"


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("name", ["prefix_lengths", "bias_table"])
def test_per_sequence_lengths_and_a_bias_table_verify(programs, ref, name):
    """prefix_len [B] (a mask: block table per call) and bias [Hq, buckets] (a score_mod: passed
    through, no table), sampled by kind and given explicitly."""
    spec = load_spec(SUPPORT / f"{name}.py")
    cases = [Case(2, 4, 2, 100, 260, 16, 0), Case(1, 2, 1, 200, 200, 16, 1)]
    assert verify_transfer(programs[ref], spec, cases=cases, schedules=("in_order",)).passed
    cand = transfer(programs[ref], spec)
    case = cases[0]
    values = ({"prefix_len": torch.tensor([0, 250])} if name == "prefix_lengths"
              else {"bias": 3 * torch.randn(4, 32, generator=torch.Generator().manual_seed(2))})
    assert _interpreted_error(cand, spec, case, values).passed
    assert cand.table == (name == "prefix_lengths") and list(cand.runtime.values()) == list(spec.runtime_inputs)


def test_a_named_size_from_params_is_checked():
    spec = load_spec(SUPPORT / "bias_table.py")
    with pytest.raises(LaunchError, match=r"bias has shape \[4, 31\], expected \[Hq, buckets\] = \[4, 32\]"):
        spec.runtime_for(10, 10, 4, 2, 1, torch.device("cpu"), {"bias": torch.zeros(4, 31)}, {"buckets": 32})


def test_a_spec_can_sample_its_own_runtime_inputs(tmp_path):
    path = _spec_file(tmp_path, """
        import torch
        from cubridge.spec import Hooks
        from cubridge.specs.document import reference
        RUNTIME_INPUTS = {"doc_ids": ("B", "Nk")}
        def sample_runtime_inputs(Nq, Nk, Hq, Hkv, B, device, generator):
            return {"doc_ids": (torch.arange(Nk, device=device) // 10).expand(B, Nk).to(torch.int32)}
        def hooks(Nq, Nk, Hq, Hkv, device, *, doc_ids):
            return Hooks(mask_mod=lambda b, h, q, kv: (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv]))
        """)
    spec = load_spec(path)
    ids = spec.runtime_for(5, 40, 2, 1, 3, torch.device("cpu"), None, {})["doc_ids"]
    assert ids.shape == (3, 40) and ids[0, 39] == 3
    assert spec.picture(12).splitlines()[10] == "..........#."


# ------------------------------------------------------------------ configs: shapes.query_length
def _config(tmp_path, query_length: str):
    from cubridge.config import load_config
    path = tmp_path / "run.yaml"
    path.write_text("spec: document\nreference: fa3_sm90\narch: sm_90a\ndtype: bf16\n"
                    "shapes:\n  heads_q: 8\n  heads_kv: 2\n  head_dim: 128\n  lengths: [8192, 1024]\n"
                    f"{query_length}")
    return load_config(path)


def test_config_query_length():
    import tempfile
    from pathlib import Path

    from cubridge.config import ConfigError
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        targets = _config(tmp, "  query_length: [512, 1024]\n").shapes.targets
        assert [(t.seqlen, t.nq, t.key) for t in targets] == [(1024, 1024, "N=1024,B=16"),
                                                              (8192, 512, "N=8192,Nq=512,B=2")]
        assert [t.nq for t in _config(tmp, "  query_length: 256\n").shapes.targets] == [256, 256]
        assert [t.nq for t in _config(tmp, "").shapes.targets] == [1024, 8192]
        with pytest.raises(ConfigError, match="query length 2048 > length 1024") as exc:
            _config(tmp, "  query_length: 2048\n")
        assert "shapes.query_length" in str(exc.value) and "Nq <= N" in exc.value.hint
        with pytest.raises(ConfigError, match="1 query lengths for 2 lengths"):
            _config(tmp, "  query_length: [512]\n")
