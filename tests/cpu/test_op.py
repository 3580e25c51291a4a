"""The tuned op on CPU: every refusal (each names the argument and the fix), the fake
implementation (FakeTensorMode, torch.library.opcheck, torch.compile(fullgraph=True)), the
per-shape caches (a repeated call re-checks and re-prepares nothing) and relocatable runs. The
launch is stubbed: the stub writes q into out, so data flow through the op is observable.
GPU behaviour: tests/gpu/test_op.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import cubridge
from cubridge.errors import LaunchError
from cubridge.runtime.fa3_sm90 import map_strides as layout_strides
from support.fake_driver import FakeLib
from support.tuned_run import cpu_op, replayed_run

BF = torch.bfloat16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return replayed_run(tmp_path_factory.mktemp("op"), "share_question",
                        "{heads_q: 8, heads_kv: 2, head_dim: 128, lengths: [1024, 8192]}").output


def stubbed(run_dir, counts=None):
    """A TunedOp that accepts CPU tensors and 'launches' out.copy_(q), lse = scale."""
    return cpu_op(run_dir, lambda q, k, v, out, lse, scale: (out.copy_(q), lse.fill_(scale)), counts=counts)


def qkv(b=2, n=64, hq=8, hkv=2, d=128, dtype=BF):
    g = torch.Generator().manual_seed(n)
    return (torch.randn(b, hq, n, d, generator=g).to(dtype), torch.randn(b, hkv, n, d, generator=g).to(dtype),
            torch.randn(b, hkv, n, d, generator=g).to(dtype))


# ------------------------------------------------------------------ refusals
def test_refusals_name_the_argument_and_the_fix(run_dir):
    attn = stubbed(run_dir)
    q, k, v = qkv()
    cases = [
        (dict(args=(q.half(), k.half(), v.half())), r"cubridge op: q: q is torch.float16.*built for bf16(.|\n)*hint: convert"),
        (dict(args=(q[..., :64], k[..., :64], v[..., :64])), r"q: q has head dim 64(.|\n)*hint: tune a config with head_dim: 64"),
        (dict(args=(q[0], k, v)), r"q: q must be a 4-d torch.Tensor, got \(8, 64, 128\)"),
        (dict(args=(q, "k", v)), r"k: k must be a 4-d torch.Tensor, got str"),
        (dict(args=(q, k, v), layout="nhbd"), r"layout: layout='nhbd'(.|\n)*hint: pass layout='bhnd'"),
        (dict(args=(q[:, :3], k, v)), r"tuned for Hq=8, Hkv=2 and neither layout"),
        (dict(args=(q, k, v[:, :, :32])), r"k and v must have one shape"),
        (dict(args=(q[:, :, :32], k, v)), r"32 queries and k 64 keys; this kernel was tuned for Nq == Nk"),
        (dict(args=(q, k, v), scale=-1.0), r"scale: scale=-1.0 is not a positive finite number"),
        (dict(args=(q, k, v), scale=float("nan")), r"scale=nan is not a positive finite"),
        (dict(args=(q, k, v), scale=True), r"scale=True"),
        (dict(args=(q, k, v), scale=torch.tensor(0.1)), r"scale=tensor"),
        (dict(args=(q, k, v), doc_ids=torch.zeros(2, 64)), r"unexpected keyword argument\(s\) doc_ids: spec "
                                                           r"'share_question' declares runtime inputs: none"),
    ]
    for kw, pattern in cases:
        kw = dict(kw)
        with pytest.raises(LaunchError, match=pattern):
            attn(*kw.pop("args"), **kw)


def test_a_layout_is_never_misread(run_dir):
    attn = stubbed(run_dir)
    q, k, v = qkv()
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))      # [B, N, H, D]
    with pytest.raises(LaunchError, match=r"they look like \[B, N, H, D\](.|\n)*hint: pass layout='bnhd'"):
        attn(qt, kt, vt)
    with pytest.raises(LaunchError, match=r"layout='bhnd' reads q \(2, 64, 8, 128\) as Hq=64(.|\n)*pass layout='bnhd'"):
        attn(qt, kt, vt, layout="bhnd")
    with pytest.raises(LaunchError, match=r"layout='bnhd' reads(.|\n)*look like bhnd tensors: pass layout='bhnd'"):
        attn(q, k, v, layout="bnhd")
    out = attn(qt, kt, vt, layout="bnhd")
    assert out.shape == qt.shape and torch.equal(out, qt)                   # the stub copies q through
    attn.heads = (8, 8)                                                     # MHA with N == H: ambiguous
    q8 = torch.randn(1, 8, 8, 128, dtype=BF)
    with pytest.raises(LaunchError, match="ambiguous(.|\n)*pass layout='bhnd' or layout='bnhd'"):
        attn(q8, q8, q8)
    assert torch.equal(attn(q8, q8, q8, layout="bnhd"), q8)


def test_strides_read_in_place_copied_or_refused(run_dir, caplog):
    attn = stubbed(run_dir)
    q, k, v = qkv()
    bnhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    views = [t.transpose(1, 2) for t in bnhd]                               # transformers' [B, H, N, D] views
    out = attn(*views)                                                      # B = 2: read in place (4-D maps)
    assert torch.equal(out, q) and attn._plans[next(reversed(attn._plans))][1] == (False, False, False)
    assert out.stride() == views[0].stride() and out.transpose(1, 2).is_contiguous()   # O in the caller's order
    one = [t[:1].transpose(1, 2) for t in bnhd]                             # B = 1 likewise
    assert torch.equal(attn(*one), q[:1])
    assert attn._plans[next(reversed(attn._plans))][1] == (False, False, False)
    odd = torch.randn(2, 8, 64, 136, dtype=BF)[..., :128]                  # 272-byte rows: fine; 130-element rows: not
    wide = torch.randn(2, 8, 64, 130, dtype=BF)[..., :128]
    with caplog.at_level("INFO", logger="cubridge"):
        assert torch.equal(attn(odd, k, v), odd) and attn._plans[next(reversed(attn._plans))][1] == (False,) * 3
        assert torch.equal(attn(wide, k, v), wide) and attn._plans[next(reversed(attn._plans))][1] == (True, False, False)
    assert "the N stride 130 (260 bytes) is not a positive multiple of 16 bytes" in caplog.text
    bad = torch.randn(2, 8, 128, 64, dtype=BF).transpose(-1, -2)            # D not contiguous
    with pytest.raises(LaunchError, match=r"q: q has strides .* last \(head\) dim is not contiguous(.|\n)*\.contiguous\(\)"):
        attn(bad, k, v)


def test_layout_strides_follow_the_kernels_tma_map():
    """(row, head, batch) strides of the 4-D maps (D, N, H, B); an extent-1 dim takes the
    contiguous stride (its coordinate is always 0)."""
    assert layout_strides((2, 4, 8, 64), (2048, 512, 64, 1), 2) == (64, 512, 2048)
    assert layout_strides((1, 8, 4, 64), (2048, 64, 512, 1), 2) == (512, 64, 2048)     # B = 1 bnhd view
    assert layout_strides((2, 8, 4, 64), (2048, 64, 512, 1), 2) == (512, 64, 2048)     # B = 2 bnhd view
    assert layout_strides((2, 1, 4, 64), (4096, 256, 1024, 1), 2) == (1024, 256, 4096)  # H = 1
    assert layout_strides((3, 2, 5, 64), (7 * 640, 640, 128, 1), 2) == (128, 640, 4480)  # padded rows, spaced batches
    assert layout_strides((2, 4, 8, 64), (2048, 512, 65, 1), 2) is None           # 130-byte rows
    assert layout_strides((2, 4, 8, 64), (0, 0, 64, 1), 2) is None                # broadcast heads
    assert layout_strides((2, 4, 8, 64), (2048, 512, 64, 2), 2) is None           # D not contiguous
    assert layout_strides((2, 4, 8, 64), (1 << 40, 512, 64, 1), 2) is None        # batch stride >= 2^40 bytes


def test_lse_only_for_softmax(run_dir):
    attn = stubbed(run_dir)
    q, k, v = qkv()
    out, lse = attn(q, k, v, return_lse=True, scale=0.25)
    assert torch.equal(out, q) and lse.shape == (2, 8, 64) and bool((lse == 0.25).all())
    attn.softmax = False
    with pytest.raises(LaunchError, match="not a softmax attention, it has no LSE"):
        attn(q, k, v, return_lse=True)


# ------------------------------------------------------------------ caches
def test_a_repeated_call_rechecks_and_reprepares_nothing(run_dir, monkeypatch):
    from cubridge.op import tuned
    counts = {}
    attn = stubbed(run_dir, counts)
    checks = []
    real = tuned.check_plan
    monkeypatch.setattr(tuned, "check_plan", lambda *a: checks.append(1) or real(*a))
    q, k, v = qkv()
    for _ in range(5):
        attn(q, k, v)
    assert counts["prepare"] == 1 and len(checks) == 1
    attn(*qkv(n=96))                                  # a new shape: checked and prepared once more
    assert counts["prepare"] == 2 and len(checks) == 2
    attn(q, k, v, scale=0.5)                          # scale is part of the prepared launch
    assert counts["prepare"] == 3 and len(checks) == 2


def test_the_repeated_call_fast_path_matches_the_checked_path(run_dir):
    """A repeated eager call goes through one cached closure (plan + prepared launch): same data
    out, same layout back, a fresh output each call, and it never serves what the checks refuse
    or what needs the autograd / LSE path."""
    attn = stubbed(run_dir)
    q, k, v = qkv(b=2)
    first = attn(q, k, v)
    assert len(attn._fast) == 1
    again = attn(q, k, v)
    assert torch.equal(first, q) and torch.equal(again, q) and again.data_ptr() != first.data_ptr()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))            # [B, N, H, D] views of bhnd memory
    a, b = attn(qt, kt, vt, layout="bnhd"), attn(qt, kt, vt, layout="bnhd")
    assert len(attn._fast) == 2 and a.shape == qt.shape and torch.equal(a, qt) and torch.equal(b, qt)
    bq, bk, bv = (t.transpose(1, 2).contiguous() for t in (q, k, v))   # [B, N, H, D] memory: O comes back so
    c, d = attn(bq, bk, bv, layout="bnhd"), attn(bq, bk, bv, layout="bnhd")
    assert torch.equal(c, bq) and torch.equal(d, bq) and c.is_contiguous() and d.is_contiguous()
    with pytest.raises(LaunchError, match="q is torch.float16"):    # another dtype: a new key, re-checked
        attn(q.half(), k.half(), v.half())
    out, lse = attn(q, k, v, return_lse=True)                       # LSE asked: the checked path, its own LSE
    assert torch.equal(out, q) and lse.shape == q.shape[:3] and len(attn._fast) == 3
    served = []
    attn._fast = {key: (lambda f: lambda *a: served.append(1) or f(*a))(f) for key, f in attn._fast.items()}
    attn(q, k, v)
    assert served == [1]
    try:
        attn(q.clone().requires_grad_(), k, v)                      # needs grad: the autograd path, never the closure
    except LaunchError:
        pass                                                        # (a spec without a backward refuses: also fine)
    assert served == [1]


# ------------------------------------------------------------------ the fake implementation
def test_torch_compile_fullgraph_traces_through_the_op(run_dir):
    attn = stubbed(run_dir)
    q, k, v = qkv()

    def f(q, k, v):
        o, lse = attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bnhd", return_lse=True)
        return o * 2, lse + 1
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward
    o, lse = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    assert len(graphs) == 1 and "cubridge.attention_lse" in str(graphs[0].graph)
    assert torch.equal(o, 2 * q.transpose(1, 2)) and lse.shape == (2, 8, 64)
    o2 = torch.compile(lambda a, b, c: attn(a, b, c) + 0, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(o2, q)
    dyn = torch.compile(lambda a, b, c: attn(a, b, c) * 2, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (64, 96, 130):                           # dynamic sequence lengths: one graph, no break
        q, k, v = qkv(n=n)
        assert torch.equal(dyn(q, k, v), 2 * q)


def test_fake_tensor_mode_and_opcheck(run_dir):
    from torch._subclasses.fake_tensor import FakeTensorMode
    attn = stubbed(run_dir)
    q, k, v = qkv()
    attn(q, k, v)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]   # [B, N, H, D] memory
    eager = attn(*views, return_lse=True)[0]
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, lse = attn(fq, fk, fv, return_lse=True)
        assert out.shape == q.shape and out.dtype == BF and lse.shape == (2, 8, 64) and lse.dtype == torch.float32
        fake = attn(*(mode.from_tensor(t) for t in views), return_lse=True)[0]
        assert fake.stride() == eager.stride() == views[0].stride()     # the strides the kernel writes
    torch.library.opcheck(torch.ops.cubridge.attention.default, (q, k, v, attn.handle, 0.125, []),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.cubridge.attention_lse.default, (q, k, v, attn.handle, 0.125, []),
                          test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------ relocatable runs
def test_a_moved_run_loads_its_cubins_without_a_compiler(run_dir, tmp_path, monkeypatch):
    from cubridge.runtime import build
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(run_dir, moved)
    shutil.rmtree(moved / "cache", ignore_errors=True)
    for name in ("dispatch.json", "manifest.json", "run.json"):
        text = (moved / name).read_text()
        assert str(run_dir) not in text and "/ref_kernels/" not in text, f"{name} holds an absolute path"
    dispatch = json.loads((moved / "dispatch.json").read_text())
    (moved / "cubins").mkdir(exist_ok=True)
    for e in dispatch["buckets"]:                     # the replay run timed nothing: give it cubins
        e["cubin"] = f"cubins/{e['label']}.cubin"
        (moved / e["cubin"]).write_bytes(b"CUBIN " + e["label"].encode())
    (moved / "dispatch.json").write_text(json.dumps(dispatch))
    monkeypatch.setattr(build, "available_compiler", lambda: None)
    monkeypatch.setattr(build, "compile_cubin", lambda *a, **k: pytest.fail("compiled at load"))
    attn = cubridge.load(moved)
    assert [b.cubin() for b in attn._buckets] == [b"CUBIN " + e["label"].encode() for e in dispatch["buckets"]]
    (moved / dispatch["buckets"][0]["cubin"]).unlink()
    with pytest.raises(LaunchError, match="carries no cubin .* no CUDA compiler here"):
        cubridge.load(moved)._buckets[0].cubin()


# ------------------------------------------------------------------ the launch, driver stubbed
def test_fa3_launch_packs_the_kernels_arguments(monkeypatch):
    import ctypes

    from cubridge.runtime import driver as drv
    from cubridge.runtime import fa3_fast
    from cubridge.runtime.fa3_sm90 import Fa3Config
    lib = FakeLib()
    real = drv.Driver.__new__(drv.Driver)      # the real tensor_map / check, on the recording lib
    real.lib = lib
    monkeypatch.setattr(fa3_fast, "driver", lambda: real)
    monkeypatch.setattr(fa3_fast.fa3, "driver", lambda: real)      # the descriptor cache's encoder
    # an empty descriptor cache: an earlier test's tensors may have had these addresses and shapes
    # (a cache hit there made this count 3 in a shuffled order)
    monkeypatch.setattr(fa3_fast.fa3, "_TENSOR_MAPS", type(fa3_fast.fa3._TENSOR_MAPS)())
    monkeypatch.setattr(fa3_fast, "sm_count", lambda index: 132)
    monkeypatch.setattr(fa3_fast, "current_stream", lambda index: 7)
    cfg = Fa3Config(head_dim=128, block_m=128, block_n=128, stages=2, persistent=True)
    launch = fa3_fast.Fa3Launch(ctypes.c_void_p(1), None, cfg, torch.device("cpu"), 2, 8, 2, 1000, 1000, 0.125)
    q, k, v = qkv(n=1000)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 1000)
    launch(q, k, v, out, lse)
    launch(q, k, v, out, lse)
    assert lib.encoded == 4, "a repeated call re-encoded a TMA descriptor"
    (grid, threads, smem), argv = lib.launches[-1]
    assert (grid, threads, smem) == (min(8 * 8 * 2, 132), cfg.threads, cfg.smem_bytes)   # persistent: <= one CTA per SM
    assert ctypes.c_uint64.from_address(argv[4]).value == lse.data_ptr()
    assert [ctypes.c_int32.from_address(argv[i]).value for i in range(7, 12)] == [1000, 1000, 8, 2, 2]
    assert ctypes.c_float.from_address(argv[12]).value == 0.125
    assert lib.launches[0][1] == argv                                              # the same packed array
    launch(q, k, v, torch.empty_like(q), lse)                                      # a new output buffer
    assert lib.encoded == 5


def test_tma_maps_express_both_layouts(monkeypatch):
    """The descriptor math, encoded without a GPU: 4-D (D, N, H, B) with the view's strides in
    bytes and a box of one head, for contiguous [B, H, N, D] and for [B, N, H, D] memory."""
    import ctypes

    from cubridge.runtime import driver as drv
    from cubridge.runtime import fa3_fast
    lib = FakeLib()
    real = drv.Driver.__new__(drv.Driver)
    real.lib = lib
    monkeypatch.setattr(fa3_fast.fa3, "driver", lambda: real)
    monkeypatch.setattr(fa3_fast.fa3, "_TENSOR_MAPS", type(fa3_fast.fa3._TENSOR_MAPS)())
    b, h, n, d = 2, 8, 1000, 128
    bhnd = torch.empty(b, h, n, d, dtype=BF)
    bnhd = torch.empty(b, n, h, d, dtype=BF).transpose(1, 2)
    fa3_fast.fa3.tensor_map(bhnd, 128)
    fa3_fast.fa3.tensor_map(bnhd, 64)
    first, second = lib.maps
    assert first == dict(rank=4, ptr=bhnd.data_ptr(), dims=[d, n, h, b], strides=[2 * d, 2 * n * d, 2 * h * n * d],
                         box=[64, 128, 1, 1], elem_strides=[1, 1, 1, 1])
    assert second == dict(rank=4, ptr=bnhd.data_ptr(), dims=[d, n, h, b], strides=[2 * h * d, 2 * d, 2 * n * h * d],
                          box=[64, 64, 1, 1], elem_strides=[1, 1, 1, 1])
    with pytest.raises(LaunchError, match=r"not addressable by the kernel's 4-D TMA maps: the N stride 130"):
        fa3_fast.fa3.tensor_map(torch.empty(1, 2, 8, 130, dtype=BF)[..., :128], 64)
    assert ctypes.sizeof(fa3_fast.fa3.tensor_map(bhnd, 128)) == 128


def test_a_cubin_for_3d_maps_is_refused():
    """A run's cubin built before the 4-D maps would read them as 3-D ones (wrong heads): refused."""
    from cubridge.runtime import fa3_fast
    from cubridge.runtime.fa3_sm90 import Fa3Config, check_cubin
    with pytest.raises(LaunchError, match=r"3-D TMA maps(.|\n)*hint: rebuild it"):
        fa3_fast.load_cubin(b"\x7fELF old cubin, no marker", Fa3Config(), torch.device("cpu"))
    check_cubin(b"\x7fELF ... fa3_sm90_maps_4d ...")


def test_build_writes_a_relocatable_run_from_default_configs(tmp_path, monkeypatch):
    """cubridge.op.build (what a GPU machine without Optuna uses): compiled cubins, relative paths,
    loads with the compilers hidden. Compiles one kernel (cached on disk after the first run)."""
    from cubridge.op import build
    from cubridge.runtime import build as rbuild
    if rbuild.available_compiler() is None:
        pytest.skip(rbuild.NO_COMPILER)
    run = build("prefixlm", tmp_path / "a" / "run", heads_q=8, heads_kv=2)
    moved = tmp_path / "b" / "run"
    shutil.copytree(run, moved)
    shutil.rmtree(run)
    text = (moved / "dispatch.json").read_text()
    assert str(tmp_path) not in text and "-I" not in text
    monkeypatch.setattr(rbuild, "available_compiler", lambda: None)
    monkeypatch.setattr(rbuild, "compile_cubin", lambda *a, **k: pytest.fail("compiled at load"))
    attn = cubridge.load(moved)
    assert attn.heads == (8, 2) and [e["seqlen"] for e in attn.buckets] == [1024, 8192]
    assert attn.select(1000)["max_seqlen"] == 2896 and attn.select(100000)["min_seqlen"] == 2897
    cubin = attn._buckets[0].cubin()
    assert cubin[:4] == b"\x7fELF" and cubin == (moved / attn.buckets[0]["cubin"]).read_bytes()


def test_a_run_binds_its_own_kernel(run_dir):
    """Binding re-derives the rules candidate from the run's spec copy (spec.py) and must find the
    run's own program: the transfer records the spec's name in it, so the copy loads under the name
    the run was tuned as (an H100 run of bench_op failed every variant on this before the fix)."""
    for bucket in cubridge.load(run_dir)._buckets:
        assert callable(bucket.binder())
