"""The lowered variants' host tile order in L2 sections of heads (CUBRIDGE_LPT_SECTIONS, on by default since session 17;
issues 18 / 19): fa3_sm90.lpt_order's `shift` and runtime.lpt's key kernel, checked without a GPU.
Off (shift 0) is today's head-by-head order bit for bit; on, every order is a permutation with the
outliers first and each section's tiles consecutive, longest first; the key kernel's C key (compiled
for the host with g++ here) gives lpt_order's order; tile_order takes the shift only from a launch
packed with the switch on. GPU: tests/gpu/test_runtime_inputs.py (the kernel's order) and
tests/gpu/test_lpt_sections.py (lowered variants under the rule with the switch on)."""
from __future__ import annotations

import ctypes
import doctest
import re
import shutil
import subprocess
import types

import pytest
import torch

from cubridge.errors import LaunchError
from cubridge.runtime import fa3_sm90, lpt
from cubridge.runtime.fa3_sm90 import lpt_order
from cubridge.runtime.lpt import section_shift

SHAPES = [(4, 8, 132), (32, 64, 132), (3, 1500, 7), (1, 1, 1), (5, 13, 2), (64, 64, 132), (7, 3, 4)]


def _counts(bh, num_m, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 20, (bh * num_m,), generator=g, dtype=torch.int32)
    if outliers:
        spots = torch.randperm(bh * num_m, generator=g)[:3]
        c[spots] = torch.tensor([500, 70000, -4], dtype=torch.int32)[:len(spots)]
    return c.view(bh, num_m)


def _today(counts, ctas):
    """lpt_order before sections (session 9's key), written out again: the off switch's reference."""
    bh, num_m = counts.shape
    c = counts.to(torch.int64).clamp(min=0, max=(1 << 16) - 1)
    total = c.sum()
    long = (c * c.numel() > 2 * total) & (8 * c * max(1, ctas) > total)
    heads = torch.arange(bh).view(-1, 1).expand(bh, num_m)
    ms = torch.arange(num_m).view(1, -1).expand(bh, num_m)
    rank = (1 << 16) - 1 - c
    key = torch.where(long, (rank << 40) | (heads << 20) | ms,
                      (1 << 60) | (heads << 36) | (rank << 20) | (num_m - 1 - ms))
    return torch.argsort(key.reshape(-1), stable=True).to(torch.int32)


def test_doctests():
    for mod in (fa3_sm90, lpt):
        result = doctest.testmod(mod)
        assert result.failed == 0 and result.attempted > 0, mod.__name__


@pytest.mark.parametrize("bh,num_m,ctas", SHAPES)
def test_shift_zero_is_todays_order_bit_for_bit(bh, num_m, ctas):
    counts = _counts(bh, num_m, bh * num_m + ctas)
    want = _today(counts, ctas)
    assert torch.equal(lpt_order(counts, ctas), want) and torch.equal(lpt_order(counts, ctas, 0), want)


@pytest.mark.parametrize("bh,num_m,ctas", SHAPES)
@pytest.mark.parametrize("shift", [1, 2, 3, 6])
def test_sections_are_a_permutation_outliers_first_sections_in_turn(bh, num_m, ctas, shift):
    counts = _counts(bh, num_m, 7 * bh + num_m + shift)
    order = lpt_order(counts, ctas, shift).long()
    n = bh * num_m
    assert torch.equal(order.sort().values, torch.arange(n))
    c = counts.reshape(-1).long().clamp(0, 65535)
    long = (c * n > 2 * c.sum()) & (8 * c * ctas > c.sum())
    k = int(long.sum())
    assert bool(long[order[:k]].all()) and not bool(long[order[k:]].any())       # outliers first
    rest = order[k:]
    sec = (rest // num_m) >> shift
    assert bool((sec[1:] >= sec[:-1]).all())                                      # sections in turn
    for s in sec.unique():                                                         # longest first inside one
        cs = c[rest[sec == s]]
        assert bool((cs[1:] <= cs[:-1]).all())


def test_a_causal_section_goes_block_by_block_heads_minor():
    """Dense causal counts (block m sees m + 1 KV tiles): with 4 heads a section, the last query block of
    heads 0..3, then the one before, ..., then heads 4..7 (tiles.cuh's TILE_SECTIONS order)."""
    bh, num_m = 8, 5
    counts = (torch.arange(num_m) + 1).repeat(bh, 1)
    order = lpt_order(counts, ctas=132, shift=2).tolist()
    want = [h * num_m + m for sec in (0, 1) for m in reversed(range(num_m)) for h in range(4 * sec, 4 * sec + 4)]
    assert order == want


def test_section_shift_matches_the_kernels_sizing():
    """tiles.cuh section_heads: the largest power of two of heads whose K and V fit in 50 MB."""
    for nk, d in ((8192, 256), (8192, 128), (4096, 64), (16384, 128), (2000, 96), (30000, 256)):
        per_head = nk * 2 * d * 2
        want = max(1, 1 << int(52428800 // per_head).bit_length() - 1) if 52428800 >= 2 * per_head else 1
        assert 1 << section_shift(nk, d, 1 << 20) == want
    assert section_shift(8192, 128, 1) == 0 and section_shift(8192, 128, 5) == 3 and section_shift(10 ** 6, 256, 64) == 0


def test_bad_shifts_are_refused():
    with pytest.raises(LaunchError, match="shift 25"):
        lpt_order(torch.ones(2, 2, dtype=torch.int32), 2, 25)
    with pytest.raises(LaunchError, match="shift -1"):
        lpt_order(torch.ones(2, 2, dtype=torch.int32), 2, -1)


def test_the_switch_is_read_when_a_launch_is_packed(monkeypatch):
    from cubridge.lower import Launchable
    monkeypatch.delenv(lpt.SECTIONS_ENV, raising=False)
    assert Launchable("", None, []).lpt_sections                     # on by default since session 17
    monkeypatch.setenv(lpt.SECTIONS_ENV, "1")
    assert Launchable("", None, []).lpt_sections
    monkeypatch.setenv(lpt.SECTIONS_ENV, "0")
    assert not Launchable("", None, []).lpt_sections
    monkeypatch.setenv(lpt.SECTIONS_ENV, "yes")
    with pytest.raises(LaunchError, match="CUBRIDGE_LPT_SECTIONS"):
        Launchable("", None, [])


@pytest.mark.parametrize("on", [False, True])
def test_tile_order_takes_the_shift_from_the_launch(on, monkeypatch):
    """fa3_sm90.tile_order with the GPU stubbed (the counts kernel's result given): the variant's
    lpt_sections picks lpt_order's shift (section_shift at Nk, D, B x Hq) and is part of the cache key."""
    b, hq, hkv, nq, nk, ctas = 2, 16, 8, 8192, 8192, 132
    cfg = fa3_sm90.default_config(128, False, True, nq, variant=True)
    num_m = -(-nq // cfg.block_m)
    counts = _counts(b * hq, num_m, 3, outliers=False).reshape(-1).contiguous()
    monkeypatch.setattr(fa3_sm90, "scratch_tensor", lambda scratch, name, shape, dtype, device: counts)
    monkeypatch.setattr(fa3_sm90, "current_stream", lambda index: 0)
    monkeypatch.setattr(fa3_sm90, "driver", lambda: types.SimpleNamespace(launch=lambda *a: None))
    variant = types.SimpleNamespace(tile_orders={}, per_call=False, args=ctypes.c_int32(0), lpt_sections=on)
    got = fa3_sm90.tile_order(None, cfg, variant, torch.device("cpu"), b, hq, hkv, nq, nk, ctas)
    shift = section_shift(nk, 128, b * hq) if on else 0
    assert shift == (3 if on else 0)              # 4 MB a head at 8k: 8 heads of 32 a section
    assert torch.equal(got, lpt_order(counts.view(b * hq, num_m), ctas, shift))
    assert [key[-1] for key in variant.tile_orders] == [shift]
    if on:
        assert not torch.equal(got, lpt_order(counts.view(b * hq, num_m), ctas))


@pytest.fixture(scope="module")
def host_keys(tmp_path_factory):
    """runtime.lpt's lpt_key (the C text in lpt.SOURCE) compiled for the host: keys(counts, n, num_m, total,
    ctas, shift, out)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the key kernel's lpt_key for the host")
    body = re.search(r"__device__ __forceinline__ long long lpt_key\(.*?\n}\n", lpt.SOURCE, re.S).group(0)
    src = ("#include <algorithm>\nusing std::min; using std::max;\n#define __device__\n#define __forceinline__ inline\n"
           "#define __restrict__ __restrict\n" + body +
           'extern "C" void keys(const int* counts, int n, int num_m, long long total, long long ctas, int shift,'
           " long long* out) { for (int i = 0; i < n; ++i) out[i] = lpt_key(counts, i, n, num_m, total, ctas, shift); }\n")
    d = tmp_path_factory.mktemp("lptkey")
    (d / "k.cpp").write_text(src)
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")], check=True)
    return ctypes.CDLL(str(d / "k.so")).keys


@pytest.mark.parametrize("bh,num_m,ctas", SHAPES)
@pytest.mark.parametrize("shift", [0, 1, 3, 5])
def test_the_key_kernels_key_gives_lpt_orders_order(host_keys, bh, num_m, ctas, shift):
    """The GPU order (gpu_lpt_order) is a stable sort of these keys (the argsort path, or the in-kernel
    bitonic sort, stable by index): sorted here, they give lpt_order's permutation."""
    counts = _counts(bh, num_m, 11 * bh + num_m + shift).reshape(-1).contiguous()
    n = counts.numel()
    total = int(counts.long().clamp(0, 65535).sum())
    out = torch.empty(n, dtype=torch.int64)
    host_keys(ctypes.c_void_p(counts.data_ptr()), n, num_m, ctypes.c_longlong(total), ctypes.c_longlong(max(1, ctas)),
              shift, ctypes.c_void_p(out.data_ptr()))
    got = torch.argsort(out, stable=True).to(torch.int32)
    assert torch.equal(got, lpt_order(counts.view(bh, num_m), ctas, shift))
