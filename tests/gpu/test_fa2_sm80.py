"""GPU checks of ref_kernels/fa2_sm80 under the verification rule of docs/DESIGN.md.

golden = attention in float64 (on the GPU), ref = the same math in the kernel dtype; out and LSE
pass iff max|x - golden| <= 2 max|ref - golden| + 1e-5 (cubridge.rule.compare). Also: outputs
poisoned with NaN are fully written, inputs are unchanged, a second run is bitwise identical.
Inputs are random normal, never zeros.
"""
from __future__ import annotations

import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cubridge.rule import compare

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128]
# (Nq, Nk): equal lengths 1..4096, and Nq != Nk both ways (queries aligned to the end of the keys).
LENGTHS = [(1, 1), (17, 17), (128, 128), (1000, 1000), (4096, 4096),
           (17, 128), (128, 17), (1000, 4096), (4096, 1000), (1, 1000), (1000, 1)]
GROUPS = [1, 4, 8]                      # Hq / Hkv: MHA, GQA, MQA-like


def _dt(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


@pytest.fixture(scope="session")
def fa2():
    from cubridge.runtime.fa2_sm80 import Fa2Sm80
    return Fa2Sm80()   # default config per head dim, NVRTC


CONFIGS = {  # a spread of what Config.space enumerates: tile shapes, ring depths, warp counts
    64: ["128x128s2w4", "128x64s3w8", "64x128s2w4", "256x64s2w8", "64x32s4w4"],
    128: ["128x128s2w8", "64x64s3w4", "128x32s4w8", "256x64s2w8", "64x128s2w4",
          "128x64s2w4f", "128x128s2w4f", "256x64s2w8f"],    # f: spill_free (KV_SPLIT=2 + QK_ROLLED=1, session 17)
}


@pytest.fixture(scope="session")
def by_config():
    from cubridge.runtime.fa2_sm80 import Config, Fa2Sm80
    return {name: Fa2Sm80(Config.parse(name)) for names in CONFIGS.values() for name in names}


@pytest.fixture(scope="session", autouse=True)
def prebuilt(fa2, by_config):
    """Compile every specialisation the suite uses, in parallel, once (NVRTC releases the GIL)."""
    from cubridge.runtime.launch import device_arch
    arch = device_arch(torch.device("cuda"))
    jobs = [(fa2, d, t, c) for d in HEAD_DIMS for t in DTYPES for c in (False, True)]
    jobs += [(by_config[n], d, t, c) for d, names in CONFIGS.items() for n in names
             for t, c in ((torch.bfloat16, True), (torch.float16, False))]
    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: j[0].build(j[1], j[2], j[3], arch), jobs))
    print(f"\nfa2_sm80: {len(jobs)} specialisations built/cached in {time.time() - t0:.1f} s")


def attention(q, k, v, causal: bool):
    """Attention in the dtype of q/k/v (scores, softmax, P V all in it): (out, lse)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = s.shape[-2:]
        # queries aligned to the end of the keys: row i sits at position i + Nk - Nq
        keep = torch.arange(nk, device=s.device)[None, :] <= torch.arange(nk - nq, nk, device=s.device)[:, None]
        s = s.masked_fill(~keep, -math.inf)
    # a row with no attended key (causal, Nq > Nk: positions below 0) gives O = 0, LSE = -inf
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v, torch.logsumexp(s, dim=-1)


def run_case(fa2, b, hq, hkv, nq, nk, d, dtype, causal, *, seed=0, amplitude=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (amplitude * torch.randn(shape, device="cuda", dtype=torch.float32, generator=gen)
               for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    saved = [t.clone() for t in (q, k, v)]
    out = torch.full_like(q, math.nan)
    lse = torch.full((b, hq, nq), math.nan, device="cuda", dtype=torch.float32)
    fa2(q, k, v, causal=causal, out=out, lse=lse)
    out2 = torch.full_like(q, math.nan)
    lse2 = torch.full_like(lse, math.nan)
    fa2(q, k, v, causal=causal, out=out2, lse=lse2)
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements never written"
    assert not lse.isnan().any(), f"{int(lse.isnan().sum())} LSE elements never written"
    for t, s, name in zip((q, k, v), saved, "qkv"):
        assert torch.equal(t, s), f"kernel modified input {name}"
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "second run differs (not deterministic)"
    golden, golden_lse = attention(q.double(), k.double(), v.double(), causal)
    ref, ref_lse = attention(q, k, v, causal)
    v_out = compare(out, golden, ref)
    v_lse = compare(lse, golden_lse, ref_lse)
    assert v_out.passed, f"out: {v_out}"
    assert v_lse.passed, f"lse: {v_lse}"
    return v_out, v_lse


def _cases():
    for d in HEAD_DIMS:
        for dtype in DTYPES:
            for causal in (False, True):
                for i, (nq, nk) in enumerate(LENGTHS):
                    group = GROUPS[(i + d // 64 + int(causal)) % len(GROUPS)]
                    big = max(nq, nk) >= 4096
                    hkv = 1 if big else 2
                    yield pytest.param(1 if big else 2, group * hkv, hkv, nq, nk, d, dtype, causal,
                                       id=f"d{d}-{_dt(dtype)}-{'causal' if causal else 'full'}-"
                                          f"q{nq}-k{nk}-g{group}")


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,dtype,causal", list(_cases()))
def test_rule(fa2, b, hq, hkv, nq, nk, d, dtype, causal):
    run_case(fa2, b, hq, hkv, nq, nk, d, dtype, causal)


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"g{g}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_gqa_ratio(fa2, group, causal):
    """Each ratio at a ragged length with several kv heads (head_map: h_kv = h // G)."""
    run_case(fa2, 2, 2 * group, 2, 333, 517, 128, torch.bfloat16, causal, seed=group)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_scores(fa2, causal):
    """Inputs x4: scores up to ~+-100 exercise the running-max rescale."""
    run_case(fa2, 1, 4, 1, 700, 900, 64, torch.float16, causal, seed=3, amplitude=4.0)


def test_no_key_rows(fa2):
    """Nk = 0: every row attends nothing, so O = 0 and LSE = -inf (no NaN)."""
    q = torch.randn(1, 2, 70, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 0, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, math.nan)
    out, lse = fa2(q, k, k.clone(), causal=True, out=out)
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((lse == -math.inf).all())


@pytest.mark.parametrize("d,name", [(d, n) for d, ns in CONFIGS.items() for n in ns])
def test_configs(by_config, d, name):
    """Non-default tilings the tuner may pick: a ragged causal GQA case and a full one."""
    fa2 = by_config[name]
    assert fa2.config.is_valid(d), fa2.config.problems(d)
    run_case(fa2, 2, 8, 2, 333, 517, d, torch.bfloat16, True, seed=1)
    run_case(fa2, 1, 4, 4, 517, 333, d, torch.float16, False, seed=2)


@pytest.fixture(scope="session")
def kv_split(tmp_path_factory):
    """The kernel with KV_SPLIT=2 (S and the softmax of each KV tile in two column blocks; off by
    default until the H100 A/B, experiments/ab_fa2_spills.py), at the default tiles and at 128x128."""
    from cubridge.runtime.fa2_sm80 import Config, Fa2Sm80, kernel_source
    path = tmp_path_factory.mktemp("kv_split") / "kernel.cu"
    path.write_text("#define KV_SPLIT 2\n" + kernel_source())
    return {name: Fa2Sm80(None if name == "default" else Config.parse(name), source_path=path)
            for name in ("default", "128x128s2w4")}


@pytest.mark.parametrize("d,name", [(64, "default"), (128, "default"), (64, "128x128s2w4")])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kv_split_option(kv_split, d, name, causal):
    """KV_SPLIT=2 under the rule: ragged GQA both ways, and large scores (the rescale between the
    two column blocks of a tile)."""
    fa2 = kv_split[name]
    run_case(fa2, 2, 8, 2, 333, 517, d, torch.bfloat16, causal, seed=5)
    run_case(fa2, 1, 4, 4, 517, 333, d, torch.float16, causal, seed=6)
    run_case(fa2, 1, 4, 1, 700, 900, d, torch.float16, causal, seed=7, amplitude=4.0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: nvcc/NVRTC equality needs both")
def test_nvcc_and_nvrtc_agree(fa2):
    """The same text built by nvcc and by NVRTC computes the same bits."""
    from cubridge.runtime.fa2_sm80 import Fa2Sm80
    q = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    a = fa2(q, k, v, causal=True)
    b = Fa2Sm80(compiler="nvcc")(q, k, v, causal=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_runs_on_the_current_torch_stream(fa2):
    """The kernel is ordered after earlier work on torch's current (non-default) stream."""
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 1, 256, 128, device="cuda", dtype=torch.bfloat16)
    q_new = torch.randn_like(q)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)   # ~10 ms: a kernel on another stream would read the old q
        q.copy_(q_new)
        out, lse = fa2(q, k, v, causal=True)
    side.synchronize()
    golden, golden_lse = attention(q_new.double(), k.double(), v.double(), True)
    ref, ref_lse = attention(q_new, k, v, True)
    assert compare(out, golden, ref).passed and compare(lse, golden_lse, ref_lse).passed


def test_rejects_bad_inputs_before_launch(fa2):
    from cubridge.errors import LaunchError
    q = torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 3, 64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="multiple of Hkv"):
        fa2(q, k, k)
    with pytest.raises(LaunchError, match="contiguous"):
        fa2(q.transpose(1, 2), k, k)
    with pytest.raises(LaunchError, match="out"):
        fa2(q, q, q, out=torch.empty(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(LaunchError, match="overlaps"):
        fa2(q, q, q, out=q)
