"""The tuned op (cubridge.load) for all ten built-in variants on an H100, under the verification
rule: eagerly, inside torch.compile(fullgraph=True), replayed from a CUDA graph, in the bnhd
layout and with strided inputs, with scale= and (softmax specs) the LSE; the document spec with its
ids as a runtime input (new ids each call, in a CUDA graph, in torch.compile). Run directories come
from cubridge.op.build (default tile configs; no Optuna needed), built once per session.

Outputs are poisoned first: the op allocates its output, so the test fills and frees a NaN block of
the same size just before each call (the caching allocator hands that block to the op's output),
then checks that no NaN is left."""
from __future__ import annotations

import math
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import cubridge
from cubridge import rule
from cubridge.errors import LaunchError
from cubridge.spec import builtin_specs, load_spec

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP != (9, 0), reason="the tuned op launches fa3_sm90 kernels: needs an sm_90 GPU")
HQ, HKV, D = 8, 2, 128
SHAPES = [(2, 300), (1, 1000), (1, 2500)]      # B, N: ragged, and both dispatch buckets (1k / 8k)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """CUBRIDGE_OP_RUNS names a folder to build them in (and keep), else a temporary one."""
    import os
    from pathlib import Path

    from cubridge.op import build
    root = Path(os.environ["CUBRIDGE_OP_RUNS"]) if os.environ.get("CUBRIDGE_OP_RUNS") else tmp_path_factory.mktemp("op_runs")
    with ThreadPoolExecutor(8) as pool:            # nvcc runs in subprocesses: threads overlap them
        dirs = dict(zip(builtin_specs(), pool.map(
            lambda s: build(s, root / s, heads_q=HQ, heads_kv=HKV, head_dim=D, lengths=(1024, 8192)), builtin_specs())))
    return dirs


def _inputs(name, B, N, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"op{name}{B}{N}".encode()))
    q = torch.randn(B, HQ, N, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, HKV, N, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, HKV, N, D, device="cuda", generator=g).to(dtype)
    return q, k, v


def _poison(shape, dtype):
    torch.empty(shape, dtype=dtype, device="cuda").fill_(float("nan"))   # freed at once: the next block of this size


def _check(spec, out, q, k, v, scale_gain=1.0):
    assert not torch.isnan(out).any(), "some output element was never written"
    qs = q * scale_gain if scale_gain != 1.0 else q
    golden = spec.run_reference(qs.double(), k.double(), v.double())
    verdict = rule.compare(out, golden, spec.run_reference(qs, k, v))
    assert verdict.passed, f"{spec.name}: {verdict}"


@pytest.mark.parametrize("name", builtin_specs())
@pytest.mark.parametrize("shape", SHAPES)
def test_op_eager_matches_the_reference(runs, name, shape):
    attn, spec = cubridge.load(runs[name]), load_spec(name)
    q, k, v = _inputs(name, *shape)
    before = [t.clone() for t in (q, k, v)]
    _poison(q.shape, q.dtype)
    out = attn(q, k, v)
    torch.cuda.synchronize()
    _check(spec, out, q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"
    _poison(q.shape, q.dtype)
    assert torch.equal(out, attn(q, k, v)), "second run differs"


@pytest.mark.parametrize("name", builtin_specs())
def test_op_in_torch_compile_and_cuda_graph(runs, name):
    attn, spec = cubridge.load(runs[name]), load_spec(name)
    q, k, v = _inputs(name, 2, 1000)
    eager = attn(q, k, v)
    compiled = torch.compile(lambda a, b, c: attn(a, b, c) * 1.0, fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager), "torch.compile(fullgraph=True) differs from eager"
    static = [t.clone() for t in (q, k, v)]
    attn(*static)                                   # the shape's first call happens before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attn(*static)
    q2, k2, v2 = _inputs(name + "second", 2, 1000)   # new values, same buffers
    for dst, src in zip(static, (q2, k2, v2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _check(spec, static_out, q2, k2, v2)
    assert torch.equal(static_out, attn(q2, k2, v2)), "graph replay differs from eager"


@pytest.mark.parametrize("name", ["causal", "prefixlm", "share_question"])
def test_layouts_strides_scale_and_lse(runs, name):
    attn, spec = cubridge.load(runs[name]), load_spec(name)
    q, k, v = _inputs(name, 2, 777)
    out = attn(q, k, v)
    # bnhd: contiguous [B, N, H, D] and a B = 1 slice (both read in place: 4-D TMA maps)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    assert torch.equal(attn(qt, kt, vt, layout="bnhd"), out.transpose(1, 2))
    one = attn(qt[:1], kt[:1], vt[:1], layout="bnhd")
    assert torch.equal(one, out[:1].transpose(1, 2))
    # the transformers convention: [B, H, N, D] views of [B, N, H, D] buffers
    assert torch.equal(attn(qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2)), out)
    # scale: 0.5 / sqrt(D) equals the reference at q * 0.5 (exact in bf16)
    half = attn(q, k, v, scale=0.5 / math.sqrt(D))
    _check(spec, half, q, k, v, scale_gain=0.5)
    out2, lse = attn(q, k, v, return_lse=True)
    assert torch.equal(out2, out) and lse.shape == (2, HQ, 777) and lse.dtype == torch.float32
    if name == "causal":
        s = (q.double() @ k.double().repeat_interleave(HQ // HKV, 1).transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(torch.ones(777, 777, device="cuda", dtype=torch.bool).triu(1), -math.inf)
        assert torch.allclose(lse.double(), torch.logsumexp(s, -1), atol=2e-2)


@pytest.mark.parametrize("name", ["causal", "prefixlm", "share_question"])
def test_bnhd_memory_is_read_and_written_in_place(runs, name):
    """issue 15's Llama path: [B, N, H, D] projections (B > 1, GQA 8 / 2, ragged N) are read in
    place and O comes back contiguous in the caller's layout, so neither the op nor transformers
    copies; bitwise the [B, H, N, D] result; also inside torch.compile (the fake's strides)."""
    attn, spec = cubridge.load(runs[name]), load_spec(name)
    q, k, v = _inputs(name, 2, 777)
    bq, bk, bv = (t.transpose(1, 2).contiguous() for t in (q, k, v))      # [B, N, H, D] memory
    before = [t.clone() for t in (bq, bk, bv)]
    _poison(bq.shape, bq.dtype)
    out = attn(bq, bk, bv, layout="bnhd")
    torch.cuda.synchronize()
    assert out.shape == bq.shape and out.is_contiguous(), "O is not contiguous [B, N, H, D]"
    assert attn._plans[next(reversed(attn._plans))][1] == (False, False, False), "an input was copied"
    _check(spec, out.transpose(1, 2), q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, (bq, bk, bv))), "inputs changed"
    views = [t.transpose(1, 2) for t in (bq, bk, bv)]                       # transformers' [B, H, N, D] views
    _poison(bq.shape, bq.dtype)
    seen = attn(*views)
    assert seen.transpose(1, 2).is_contiguous() and torch.equal(seen, out.transpose(1, 2))
    assert torch.equal(attn(q, k, v), seen), "the bhnd result differs from the bnhd one"
    merged = torch.compile(lambda a, b, c: attn(a, b, c).transpose(1, 2).reshape(2, 777, -1) * 1.0, fullgraph=True)
    assert torch.equal(merged(*views), out.reshape(2, 777, -1)), "torch.compile differs from eager"


def test_first_call_inside_a_capture_is_refused(runs):
    attn = cubridge.load(runs["prefixlm"])
    q, k, v = _inputs("capture", 1, 640)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(LaunchError, match="before capturing"):
        with torch.cuda.graph(graph):
            attn(q, k, v)


def test_sigmoid_has_no_lse(runs):
    attn = cubridge.load(runs["sigmoid"])
    q, k, v = _inputs("sig", 1, 128)
    with pytest.raises(LaunchError, match="has no LSE"):
        attn(q, k, v, return_lse=True)


def test_run_directory_loads_without_a_compiler(runs, tmp_path, monkeypatch):
    """A moved run directory launches from its own cubins: the compilers are hidden."""
    import shutil

    from cubridge.runtime import build
    moved = tmp_path / "moved"
    shutil.copytree(runs["causal"], moved)
    monkeypatch.setattr(build, "available_compiler", lambda: None)
    monkeypatch.setattr(build, "compile_cubin", lambda *a, **k: pytest.fail("compiled at load"))
    attn = cubridge.load(moved)
    q, k, v = _inputs("moved", 1, 500)
    _check(load_spec("causal"), attn(q, k, v), q, k, v)


# ------------------------------------------------------------------ runtime inputs (issue 15)
@pytest.fixture(scope="session")
def document_run(tmp_path_factory):
    from cubridge.op import build
    return build("document", tmp_path_factory.mktemp("op_doc") / "document", heads_q=HQ, heads_kv=HKV, head_dim=D,
                 lengths=(1024, 8192))


def _documents(B, N, seed):
    """Sorted int32 document ids [B, N], a different layout per row and seed (lengths 30-900)."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.randint(30, 900, (B, N // 30 + 1), generator=g).cumsum(1)
    return torch.stack([torch.bucketize(torch.arange(N), row, right=True) for row in ends]).to("cuda", torch.int32)


def _check_documents(spec, out, q, k, v, ids):
    assert not torch.isnan(out).any(), "some output element was never written"
    golden = spec.run_reference(q.double(), k.double(), v.double(), runtime={"doc_ids": ids})
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v, runtime={"doc_ids": ids}))
    assert verdict.passed, f"document: {verdict}"


@pytest.mark.parametrize("sort_in_kernel", [False, True])
@pytest.mark.parametrize("shape", [(2, 1000), (1, 2500), (3, 77)])
def test_document_op_follows_each_calls_ids(document_run, shape, sort_in_kernel, monkeypatch):
    """Three calls in a row with three layouts (the launch is built once and re-pointed per call:
    kernels.RuntimePrepared, Fa3Launch.rebind; the tile order sorted on the GPU, runtime.lpt, both
    ways), an int64 layout among them; each under the rule, the inputs unchanged, bitwise on a rerun."""
    from cubridge.runtime import lpt
    monkeypatch.setattr(lpt, "SORT_IN_KERNEL", sort_in_kernel)
    attn, spec = cubridge.load(document_run), load_spec("document")
    q, k, v = _inputs("document", *shape)
    before = [t.clone() for t in (q, k, v)]
    for seed in (1, 2, 3):
        ids = _documents(shape[0], shape[1], seed)
        ids = ids.long() if seed == 2 else ids
        _poison(q.shape, q.dtype)
        out = attn(q, k, v, doc_ids=ids)
        torch.cuda.synchronize()
        _check_documents(spec, out, q, k, v, ids)
        _poison(q.shape, q.dtype)
        assert torch.equal(out, attn(q, k, v, doc_ids=ids)), f"seed {seed}: second run differs"
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"
    assert len(attn._prepared) == 1, "the shape's launch was built more than once"


def test_document_op_in_a_cuda_graph_and_torch_compile(document_run):
    """Captured once, replayed on new ids copied into the captured buffer: the table, tile order
    and output follow them; torch.compile(fullgraph=True) traces the call (the fake) and equals eager."""
    attn, spec = cubridge.load(document_run), load_spec("document")
    q, k, v = _inputs("document graph", 2, 1000)
    ids = _documents(2, 1000, 5)
    eager = attn(q, k, v, doc_ids=ids)
    compiled = torch.compile(lambda a, b, c, d: attn(a, b, c, doc_ids=d) * 1.0, fullgraph=True)
    assert torch.equal(compiled(q, k, v, ids), eager), "torch.compile(fullgraph=True) differs from eager"
    static = _documents(2, 1000, 6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attn(q, k, v, doc_ids=static)
    for seed in (7, 8):
        static.copy_(_documents(2, 1000, seed))
        graph.replay()
        torch.cuda.synchronize()
        _check_documents(spec, static_out, q, k, v, static)
        assert torch.equal(static_out, attn(q, k, v, doc_ids=static)), f"seed {seed}: replay differs from eager"
