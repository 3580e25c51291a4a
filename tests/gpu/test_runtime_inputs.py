"""Runtime inputs and Nq < Nk on the GPU: the block table of a data-dependent mask built by the GPU
kernel equals the host table (several layouts, shapes, Nq < Nk, a mask reading h, a captured
table), also when built inside a CUDA graph and replayed on new ids; the lowered document kernel
passes the verification rule with two different document layouts in two consecutive calls; causal,
prefixlm and document kernels pass it with fewer queries than keys (queries end-aligned)."""
from __future__ import annotations

import zlib

import pytest
import torch

from cubridge import rule
from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.transfer.rules import block_classes, transfer

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP < (8, 0), reason="needs an sm_80+ GPU")
DOC_SHAPES = [(2, 4, 2, 1000, 1000), (1, 8, 2, 300, 2500), (3, 2, 1, 77, 77), (1, 4, 4, 1, 4096)]  # B Hq Hkv Nq Nk


def _program(ref):
    if ref == "fa3_sm90" and CAP != (9, 0):
        pytest.skip("fa3_sm90 needs an sm_90 GPU (H100 / H200)")
    return parse_file(ref_kernel_dir(ref) / "kernel.cuir")


def documents(B, Nk, seed, device="cuda"):
    """Sorted document ids, a different random layout per row and per seed (lengths 1-700)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        cuts = torch.randint(1, 700, (Nk // 40 + 2,), generator=g).cumsum(0)
        ids = torch.zeros(Nk, dtype=torch.int64)
        for c in cuts[cuts < Nk].tolist():
            ids[c:] += 1
        rows.append(ids)
    return torch.stack(rows).to(device=device, dtype=torch.int32)


def _host_table(spec, cand, shape, runtime, bm, bn):
    B, Hq, Hkv, Nq, Nk = shape
    hooks = spec.hooks_for(Nq, Nk, Hq, Hkv, "cpu", B=B,
                           runtime={k: v.cpu() for k, v in runtime.items()} if runtime is not None else None)
    return block_classes(hooks, B, Hq, Nq, Nk, bm, bn, cand.per_bh).to(torch.int32)


@pytest.mark.parametrize("tiles", [(128, 128), (128, 64), (192, 176)])
@pytest.mark.parametrize("shape", DOC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_table_equals_host_table(shape, tiles):
    spec = load_spec("document")
    cand = transfer(parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir"), spec)
    B, Hq, Hkv, Nq, Nk = shape
    for seed in (1, 2):
        runtime = {"doc_ids": documents(B, Nk, seed)}
        extra = cand.bind(Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]},
                          device="cuda", runtime=runtime)
        assert extra["BLOCK_CLASS"].is_cuda
        host = _host_table(spec, cand, shape, runtime, *tiles)
        assert torch.equal(extra["BLOCK_CLASS"].cpu(), host), f"seed {seed}"


def test_gpu_table_of_a_mask_reading_h_and_of_a_captured_table(tmp_path):
    from cubridge.runtime.block_table import gpu_block_classes
    program = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")
    path = tmp_path / "doc_heads.py"
    path.write_text(
        "from cubridge.spec import Hooks\nfrom cubridge.specs.document import reference\n"
        "RUNTIME_INPUTS = {'doc_ids': ('B', 'Nk')}\n"
        "def hooks(Nq, Nk, Hq, Hkv, device, *, doc_ids):\n"
        "    def mask(b, h, q_idx, kv_idx):\n"
        "        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & ((kv_idx <= q_idx) | (h == 1))\n"
        "    return Hooks(mask_mod=mask)\n")
    cases = [(load_spec(path), (2, 4, 4, 600, 900), {"doc_ids": documents(2, 900, 5)}),
             (load_spec("share_question"), (1, 2, 1, 700, 700), None)]
    for spec, shape, runtime in cases:
        B, Hq, Hkv, Nq, Nk = shape
        cand = transfer(program, spec)
        inputs = cand.bind(Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": 64, "BLOCK_N": 64},
                           device="cuda", runtime=runtime)
        scalars = [(n, "int" if dt == "i32" else "float") for n, _, dt in cand.slots]
        table = gpu_block_classes(cand.binding.mask, inputs, scalars, B=B, Hq=Hq, Nq=Nq, Nk=Nk, block_m=64, block_n=64,
                                  per_bh=cand.per_bh, device="cuda")
        assert torch.equal(table.cpu(), _host_table(spec, cand, shape, runtime, 64, 64)), spec.name


def test_gpu_table_in_a_cuda_graph_follows_new_ids():
    spec = load_spec("document")
    cand = transfer(parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir"), spec)
    shape, params = (2, 4, 2, 1000, 1000), {"BLOCK_M": 128, "BLOCK_N": 128}
    ids = documents(2, 1000, 1)
    bind = lambda: cand.bind(Nq=1000, Nk=1000, Hq=4, Hkv=2, B=2, params=params, device="cuda",  # noqa: E731
                             runtime={"doc_ids": ids})
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        bind()                               # warm-up on the capture stream: per-shape state, compile, load
    torch.cuda.synchronize()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        table = bind()["BLOCK_CLASS"]
    for seed in (3, 4):
        ids.copy_(documents(2, 1000, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(table.cpu(), _host_table(spec, cand, shape, {"doc_ids": ids}, 128, 128))


def _run(ref, cand, kern, q, k, v, runtime):
    B, Hq, Nq, D = q.shape
    out = torch.full_like(q, float("nan"))
    if ref == "fa3_sm90":
        from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
        cfg = default_config(D, False, q.dtype == torch.bfloat16, k.shape[2], variant=True)
    else:
        from cubridge.runtime.fa2_sm80 import Fa2Sm80, default_config
        cfg = default_config(D)
    extra = cand.bind(Nq=Nq, Nk=k.shape[2], Hq=Hq, Hkv=k.shape[1], B=B, device=q.device, runtime=runtime,
                      params={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n})
    launch = kern.args(extra, q.device)
    if ref == "fa3_sm90":
        fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=launch)
    else:
        Fa2Sm80(cfg)(q, k, v, causal=False, out=out, variant=launch)
    torch.cuda.synchronize()
    return out


def _verify(ref, name, shape, runtime_of=lambda B, Nk, call: None, calls=1):
    spec = load_spec(name)
    cand = transfer(_program(ref), spec)
    kern = lower(cand.program, ref)
    B, Hq, Hkv, Nq, Nk, D = shape
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{ref}{name}{shape}".encode()))
    q, k, v = (torch.randn(B, h, n, D, device="cuda", generator=g).to(torch.bfloat16)
               for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
    before = [t.clone() for t in (q, k, v)]
    for call in range(calls):
        runtime = runtime_of(B, Nk, call)
        out = _run(ref, cand, kern, q, k, v, runtime)
        assert not torch.isnan(out).any(), "some output element was never written"
        golden = spec.run_reference(q.double(), k.double(), v.double(), runtime=runtime)
        verdict = rule.compare(out, golden, spec.run_reference(q, k, v, runtime=runtime))
        assert verdict.passed, f"{ref} {name} {shape} call {call}: {verdict}"
        assert torch.equal(out, _run(ref, cand, kern, q, k, v, runtime)), "second run differs"
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"


@pytest.mark.parametrize("ref", ["fa3_sm90", "fa2_sm80"])
# One head dim (128) throughout: every (variant, kernel) pair compiles once.
@pytest.mark.parametrize("shape", [(2, 8, 2, 2000, 2000, 128), (1, 4, 4, 700, 3000, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_document_kernel_with_two_layouts_in_a_row(ref, shape):
    _verify(ref, "document", shape, lambda B, Nk, call: {"doc_ids": documents(B, Nk, 10 + call)}, calls=2)


@pytest.mark.parametrize("ref", ["fa3_sm90", "fa2_sm80"])
@pytest.mark.parametrize("name", ["causal", "prefixlm", "document", "share_question", "relative_pos"])
@pytest.mark.parametrize("shape", [(1, 8, 2, 128, 2048, 128), (2, 4, 1, 77, 1000, 128), (1, 2, 2, 1, 300, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fewer_queries_than_keys(ref, name, shape):
    _verify(ref, name, shape)


@pytest.mark.parametrize("ref", ["fa3_sm90", "fa2_sm80"])
def test_reference_kernels_causal_is_end_aligned(ref):
    """The reference kernels' own causal mode (no variant) uses the query positions too."""
    _program(ref)
    spec = load_spec("causal")
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 4, 200, 128, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 1100, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    if ref == "fa3_sm90":
        from cubridge.runtime.fa3_sm90 import fa3_forward
        fa3_forward(q, k, v, causal=True, out=out)
    else:
        from cubridge.runtime.fa2_sm80 import Fa2Sm80, default_config
        Fa2Sm80(default_config(128))(q, k, v, causal=True, out=out)
    torch.cuda.synchronize()
    golden = spec.run_reference(q.double(), k.double(), v.double())
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v))
    assert verdict.passed, str(verdict)


SUPPORT = __import__("pathlib").Path(__file__).parents[1] / "support" / "specs"


@pytest.mark.parametrize("ref", ["fa3_sm90", "fa2_sm80"])
def test_prefix_lengths_and_bias_table_change_between_calls(ref):
    g = torch.Generator().manual_seed(9)
    prefix = lambda B, Nk, call: {"prefix_len": torch.randint(0, Nk + 1, (B,), generator=g).cuda()}  # noqa: E731
    bias = lambda B, Nk, call: {"bias": (3 * torch.randn(4, 32, generator=g)).cuda()}  # noqa: E731
    _verify(ref, str(SUPPORT / "prefix_lengths.py"), (3, 4, 2, 900, 1500, 128), prefix, calls=2)
    _verify(ref, str(SUPPORT / "bias_table.py"), (2, 4, 4, 1000, 1000, 128), bias, calls=2)


@pytest.mark.parametrize("sort_in_kernel", [False, True])
@pytest.mark.parametrize("bh,num_m,ctas", [(4, 8, 132), (32, 64, 132), (256, 8, 132), (3, 1500, 7), (1, 1, 1),
                                           (5, 13, 2), (64, 64, 132)])
def test_gpu_tile_order_equals_lpt_order(bh, num_m, ctas, sort_in_kernel, monkeypatch):
    """runtime.lpt (a per-call variant's tile order: one key kernel + argsort, or with
    SORT_IN_KERNEL one bitonic-sort kernel up to 4096 tiles) gives exactly fa3_sm90.lpt_order's
    permutation: counts with outliers, ties, negatives and values past 2^16 (clamped), odd tile
    counts, 4096 tiles exactly, and past it (the argsort path either way)."""
    from cubridge.runtime import lpt
    from cubridge.runtime.fa3_sm90 import current_stream, lpt_order
    from cubridge.runtime.lpt import gpu_lpt_order
    monkeypatch.setattr(lpt, "SORT_IN_KERNEL", sort_in_kernel)
    g = torch.Generator().manual_seed(bh * num_m + ctas)
    counts = torch.randint(0, 20, (bh * num_m,), generator=g, dtype=torch.int32)
    spots = torch.randperm(bh * num_m, generator=g)[:3]
    counts[spots] = torch.tensor([500, 70000, -4], dtype=torch.int32)[:len(spots)]
    want = lpt_order(counts.view(bh, num_m), ctas)
    got = gpu_lpt_order(counts.cuda(), num_m, ctas, current_stream(torch.cuda.current_device()))
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.to(torch.int32))
    assert torch.equal(got.sort().values.cpu(), torch.arange(bh * num_m, dtype=torch.int32))


@pytest.mark.parametrize("per", [1, 8])
@pytest.mark.parametrize("shape", DOC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_table_kernel_with_more_pairs_per_vote(shape, per):
    """block_table.PAIRS_PER_SYNC (evaluations per thread between block votes; 8 by default) gives
    the host table too: ragged tiles, tiles smaller than a round of 256 x 8 pairs, Nq < Nk. Only
    the builder made here sees the setting (the binders Candidate.bind caches keep the default)."""
    from cubridge.runtime import block_table
    spec = load_spec("document")
    cand = transfer(parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir"), spec)
    B, Hq, Hkv, Nq, Nk = shape
    scalars = [(n, "int" if dt == "i32" else "float") for n, _, dt in cand.slots]
    for bm, bn in ((128, 128), (192, 176), (64, 32)):
        runtime = {"doc_ids": documents(B, Nk, bm + bn)}
        inputs = cand.bind(Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": bm, "BLOCK_N": bn}, device="cuda",
                           runtime=runtime)
        default, block_table.PAIRS_PER_SYNC = block_table.PAIRS_PER_SYNC, per
        try:
            builder = block_table.TableBuilder(cand.binding.mask, inputs, scalars, B=B, Hq=Hq, Nq=Nq, Nk=Nk,
                                               block_m=bm, block_n=bn, per_bh=cand.per_bh, device="cuda")
        finally:
            block_table.PAIRS_PER_SYNC = default
        assert torch.equal(builder(inputs).cpu(), _host_table(spec, cand, shape, runtime, bm, bn)), (bm, bn)
