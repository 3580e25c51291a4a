"""The tuned op's repeated call on CPU (cubridge/op/NOTES.md 10): the eager closure enters
Fa3Launch.fixed_layout by addresses (the driver recorded by support.fake_driver, so the packed
descriptors are observable), the output comes back in the caller's layout, and the custom op's
implementation repeats through its own closure. The checked path and the refusals: test_op.py."""
from __future__ import annotations

import pytest
import torch

import cubridge
from cubridge.errors import LaunchError
from support.fake_driver import recording_launches
from support.tuned_run import cpu_op, replayed_run

BF = torch.bfloat16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return replayed_run(tmp_path_factory.mktemp("op_fast"), "share_question",
                        "{heads_q: 8, heads_kv: 2, head_dim: 128, lengths: [1024, 8192]}").output


def stubbed(run_dir):
    """A TunedOp that accepts CPU tensors and 'launches' out.copy_(q), lse = scale."""
    return cpu_op(run_dir, lambda q, k, v, out, lse, scale: (out.copy_(q), lse.fill_(scale)))


def qkv(b=2, n=64, hq=8, hkv=2, d=128, dtype=BF):
    g = torch.Generator().manual_seed(n)
    return (torch.randn(b, hq, n, d, generator=g).to(dtype), torch.randn(b, hkv, n, d, generator=g).to(dtype),
            torch.randn(b, hkv, n, d, generator=g).to(dtype))


def test_fixed_layout_launches_by_address_with_the_arguments_call_packs(monkeypatch):
    """Fa3Launch.fixed_layout (the op's repeated call): found by addresses and stream alone, the
    views made only to pack, and the same descriptors and scalars __call__ packs for those views."""
    import ctypes

    from cubridge.runtime.fa3_sm90 import Fa3Config
    lib, fa3_fast = recording_launches(monkeypatch)
    cfg = Fa3Config(head_dim=128, block_m=128, block_n=128, stages=2, persistent=True)
    launch = fa3_fast.Fa3Launch(ctypes.c_void_p(1), None, cfg, torch.device("cpu"), 2, 8, 2, 64, 64, 0.125)
    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv())         # [B, N, H, D] memory, as a caller holds it
    out, lse = torch.empty_like(q), torch.empty(2, 8, 64)
    made = []

    def views(*ts):
        made.append(1)
        return tuple(t.transpose(1, 2) for t in ts)
    fixed = launch.fixed_layout(views)
    fixed(q, k, v, out, lse)
    fixed(q, k, v, out, lse)
    assert made == [1] and lib.encoded == 4 and lib.launches[0] == lib.launches[1]
    launch(*(t.transpose(1, 2) for t in (q, k, v, out)), lse)         # the general path, the same views
    assert lib.encoded == 4                                            # the same four descriptors
    first, general = lib.launches[1][1], lib.launches[2][1]
    assert [ctypes.string_at(first[i], 128) for i in range(4)] == [ctypes.string_at(general[i], 128) for i in range(4)]
    assert [m["strides"] for m in lib.maps] == [[2 * 8 * 128, 2 * 128, 2 * 64 * 8 * 128]] + \
        [[2 * 2 * 128, 2 * 128, 2 * 64 * 2 * 128]] * 2 + [[2 * 8 * 128, 2 * 128, 2 * 64 * 8 * 128]]
    assert ctypes.c_uint64.from_address(first[4]).value == lse.data_ptr()
    assert [ctypes.c_int32.from_address(first[i]).value for i in range(7, 12)] == [64, 64, 8, 2, 2]
    other = torch.empty_like(q)
    fixed(q, k, v, other, lse)                                         # a new output address: packed anew
    assert made == [1, 1] and lib.maps[-1]["ptr"] == other.data_ptr()


def test_the_op_enters_the_launch_by_address_and_returns_the_callers_layout(run_dir, monkeypatch):
    """A repeated eager call at a checked signature goes through Fa3Launch.fixed_layout: the output
    comes back in the caller's layout and q's memory order (bhnd contiguous; bnhd contiguous for
    [B, N, H, D] memory), and the kernel's O descriptor is that memory seen as [B, H, N, D]."""
    import ctypes

    from cubridge.op.kernels import Prepared
    from cubridge.runtime.fa3_sm90 import Fa3Config
    lib, fa3_fast = recording_launches(monkeypatch)
    attn = cubridge.load(run_dir)
    attn.device_type = "cpu"
    cfg = Fa3Config(head_dim=128, block_m=128, block_n=128, stages=2, persistent=True)

    def prepare(q, k, scale, rt):
        launch = fa3_fast.Fa3Launch(ctypes.c_void_p(1), None, cfg, q.device, q.shape[0], q.shape[1], k.shape[1],
                                    q.shape[2], k.shape[2], scale)
        prep = attn._prepared[(q.shape, k.shape, q.device, scale)] = Prepared(launch, torch.empty(q.shape[:3]))
        return prep
    attn._prepare = prepare
    real_fixed, entered = fa3_fast.Fa3Launch.fixed_layout, []
    monkeypatch.setattr(fa3_fast.Fa3Launch, "fixed_layout",
                        lambda self, views: entered.append(1) or real_fixed(self, views))
    bhnd = qkv()
    bnhd = [t.transpose(1, 2).contiguous() for t in bhnd]
    padded = [torch.randn(2, 8, 64, 136, dtype=BF)[..., :128], bhnd[1], bhnd[2]]   # read in place, not dense:
    for layout, (q, k, v) in (("bhnd", bhnd), ("bnhd", bnhd), ("bhnd", padded)):  # O contiguous, not like q
        attn(q, k, v, layout=layout)                                   # checked, prepared, remembered
        fa3_fast.fa3._TENSOR_MAPS.clear()                              # the closure's first call packs all four
        lib.maps.clear()
        out = attn(q, k, v, layout=layout)                             # the cached closure
        assert out.shape == q.shape and out.is_contiguous() and out.dtype == BF
        assert [m["ptr"] for m in lib.maps] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
        o_map = lib.maps[-1]
        assert o_map["ptr"] == out.data_ptr() and o_map["dims"] == [128, 64, 8, 2]
        row, head = (2 * 128, 2 * 64 * 128) if layout == "bhnd" else (2 * 8 * 128, 2 * 128)
        assert o_map["strides"][:2] == [row, head]
    assert len(attn._fast) == 3 and len(lib.launches) == 6 and entered == [1, 1, 1]


def test_the_custom_op_repeats_through_its_own_closure(run_dir):
    """cubridge::attention's implementation (what a compiled graph runs) remembers a closure per
    signature in its own cache: the same data and the fake implementation's strides (q's memory
    order) on the first and the repeated call, for [B, H, N, D] memory, [B, N, H, D] memory seen as
    [B, H, N, D], and a view the kernel cannot read in place (copied; O still in q's order); an
    eager call with a layout string never finds these closures."""
    from cubridge.op.checks import out_like
    attn = stubbed(run_dir)
    q, k, v = qkv()
    bnhd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    wide = torch.randn(2, 8, 64, 130, dtype=BF)[..., :128]                 # 260-byte rows: copied
    served = []
    for i, args in enumerate(((q, k, v), bnhd, (wide, k, v))):
        first = torch.ops.cubridge.attention(*args, attn.handle, 0.125, [])
        assert len(attn._fast_op) == i + 1
        key, closure = next(reversed(attn._fast_op.items()))
        attn._fast_op[key] = lambda *a, f=closure: served.append(1) or f(*a)
        again = torch.ops.cubridge.attention(*args, attn.handle, 0.125, [])
        assert len(served) == i + 1, "the repeated call did not run the remembered closure"
        for out in (first, again):
            assert torch.equal(out, args[0]) and out.stride() == out_like(args[0]).stride()
    assert len(attn._fast_op) == 3 and not attn._fast
    with pytest.raises(LaunchError, match="layout="):
        attn(q, k, v, layout="op", scale=0.125)
