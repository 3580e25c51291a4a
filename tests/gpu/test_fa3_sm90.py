"""GPU checks of the Hopper reference kernel (ref_kernels/fa3_sm90) under the verification rule.

golden = attention in float64, ref = the same math in the kernel dtype; pass iff
max|out - golden| <= 2 max|ref - golden| + 1e-5 (cubridge.rule.compare). Also: outputs poisoned
with NaN are fully written, inputs are unchanged, a second run is bitwise identical.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cubridge.errors import LaunchError
from cubridge.rule import compare

_HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not _HAS_SM90, reason="needs a CUDA GPU of compute capability 9.0 (H100/H200) for wgmma and TMA")]

if _HAS_SM90:
    from cubridge.runtime.fa3_sm90 import Fa3Config, default_config, fa3_forward

HEADS_Q = 8
LENGTHS = [1, 17, 128, 1000, 4096]
GROUPS = [1, 4, 8]                      # Hq / Hkv: MHA, GQA, MQA (Hkv = 1)
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128]


def attention(q, k, v, causal: bool):
    """Plain attention in the dtype of its inputs; k/v heads repeated for GQA; (out, lse)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        # queries aligned to the end of the keys: row i sits at position i + Nk - Nq
        keep = torch.arange(nk, device=s.device)[None, :] <= torch.arange(nk - nq, nk, device=s.device)[:, None]
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s.to(torch.float64), dim=-1)
    # a row with no attended key (causal, Nq > Nk: positions below 0) gives O = 0, LSE = -inf
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v, lse


def run_case(b, hq, hkv, nq, nk, d, dtype, causal, seed=0, persistent=False, max_ctas=None,
             memory="bhnd", **tiles):
    """tiles: Fa3Config overrides (block_m, block_n, stages); default_config otherwise. memory:
    "bnhd" lays q, k, v out as [B, N, H, D] and passes their [B, H, N, D] views (transformers'
    projections), "padded" gives every row 8 spare elements; the kernel reads both in place and
    writes O in q's memory order."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
               for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))
    if memory == "bnhd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif memory == "padded":
        q, k, v = (torch.nn.functional.pad(t, (0, 8))[..., :d] for t in (q, k, v))
    saved = [t.clone() for t in (q, k, v)]
    bf16 = dtype == torch.bfloat16
    config = (Fa3Config(head_dim=d, causal=causal, bf16=bf16, persistent=persistent, **tiles) if tiles
              else dataclasses.replace(default_config(d, causal, bf16, nq), persistent=persistent))
    out = torch.full_like(q, math.nan)
    lse = torch.full((b, hq, nq), math.nan, device="cuda", dtype=torch.float32)
    fa3_forward(q, k, v, causal=causal, config=config, out=out, lse=lse, max_ctas=max_ctas)
    out2, lse2 = fa3_forward(q, k, v, causal=causal, config=config, max_ctas=max_ctas)
    torch.cuda.synchronize()
    assert out.stride() == q.stride() or memory == "padded", "full_like keeps q's memory order"
    if memory == "bnhd":
        assert out2.transpose(1, 2).is_contiguous(), "the default O is not in q's [B, N, H, D] order"
    for t, s in zip((q, k, v), saved):
        assert torch.equal(t, s), "kernel modified an input"
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "second run differs (not deterministic)"
    golden, golden_lse = attention(q.double(), k.double(), v.double(), causal)
    ref, _ = attention(q, k, v, causal)
    verdict = compare(out, golden, ref)
    assert verdict.passed, f"out: {verdict}"
    finite = torch.isfinite(golden_lse)
    assert torch.equal(lse.double()[~finite], golden_lse[~finite]), "LSE of rows without keys is not -inf"
    lse_err = (lse.double() - golden_lse)[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err <= 1e-3, f"lse max err {lse_err:.3e}"
    return verdict


@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"g{g}")
@pytest.mark.parametrize("n", LENGTHS, ids=lambda n: f"n{n}")
def test_square(n, group, dtype, d, causal, persistent):
    run_case(1 if n >= 1000 else 2, HEADS_Q, HEADS_Q // group, n, n, d, dtype, causal,
             persistent=persistent)


# Tile configurations the tuner may pick: 3 consumers (BLOCK_M 192), O staged in the Q buffer
# (BLOCK_N 176 at D 128 leaves no room for a separate O buffer), deeper rings. Persistent, so one
# CTA runs several tiles and the Q / ring hand-over between tiles is exercised.
TILE_CONFIGS = [dict(d=128, block_m=128, block_n=176, stages=2),
                dict(d=128, block_m=128, block_n=128, stages=3),
                dict(d=64, block_m=192, block_n=128, stages=2),
                dict(d=64, block_m=128, block_n=192, stages=2),
                dict(d=128, block_m=128, block_n=64, stages=4),
                # one Q slot beside a separate O stage (tiles still overlap)
                dict(d=64, block_m=128, block_n=128, stages=2, q_slots=1),
                # the widest D 128 tile that keeps a separate O stage (fa3_sm90 NOTES, session 9)
                dict(d=128, block_m=128, block_n=160, stages=2),
                # three consumers at D 128 (narrow KV tiles). The serial tile order (O staged in
                # the only Q slot) runs in 128 x 176 above and at D 256.
                dict(d=128, block_m=192, block_n=80, stages=2),
                dict(d=128, block_m=192, block_n=64, stages=2),
                # three consumers, three stages: a ring index that is not a power of 2
                dict(d=64, block_m=192, block_n=80, stages=3)]


# Fa3Config's full-attention options (off by default; causal compiles them out): ragged lengths,
# Nq > Nk (query blocks past Nk's count: the rotation wraps), Nq < Nk, several tiles per CTA.
OPTIONS = [dict(kv_rotate=True), dict(l2_hints=True), dict(kv_rotate=True, l2_hints=True)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", [(1000, 1000), (4096, 4096), (1000, 17), (300, 1000), (2500, 129)])
@pytest.mark.parametrize("tile", [(128, 128, 176), (128, 128, 128), (64, 192, 128)], ids=lambda t: "d%d_%dx%d" % t)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "+".join(o))
def test_full_attention_options(opts, tile, nq, nk, causal):
    d, block_m, block_n = tile
    run_case(1 if max(nq, nk) >= 1000 else 2, 8, 2, nq, nk, d, torch.bfloat16, causal, persistent=True,
             max_ctas=7, block_m=block_m, block_n=block_n, **opts)   # B = 1 at long rows: the float64 golden


# tail_split (off by default): capped grids that leave R = #tiles mod #CTAs tail tiles, each split into
# 2-11 chunks (tail_chunks), at the full-attention default tiles; Nq != Nk; a case with one KV tile
# (no split) and causal (compiled out) run the same option.
TAIL_CASES = [(1, 8, 2, 1000, 1000, 128, 128, 128, 7, 7), (2, 8, 2, 2500, 2531, 128, 128, 176, 11, 11),
              (1, 8, 2, 2500, 2500, 64, 192, 128, 9, 2), (1, 8, 1, 1000, 1000, 64, 128, 128, 10, 2),
              (1, 8, 2, 300, 1000, 128, 128, 176, 10, 2), (1, 8, 2, 1000, 17, 128, 128, 128, 11, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda c: "b%d_h%d/%d_%dx%d_d%d_%dx%d_g%d_s%d" % c)
def test_tail_split(case, causal):
    from cubridge.runtime.fa3_sm90 import tail_chunks
    b, hq, hkv, nq, nk, d, block_m, block_n, grid, chunks = case
    assert tail_chunks(math.ceil(nq / block_m) * hq * b, grid, math.ceil(nk / block_n)) == chunks
    run_case(b, hq, hkv, nq, nk, d, torch.bfloat16, causal, persistent=True, max_ctas=grid,
             block_m=block_m, block_n=block_n, tail_split=True)


# o_half (off by default, session 14): D 128 128 x 176 with O staged in a 64-row buffer the two
# consumers use in turn, Q freed after a tile's last QK, tiles overlapped. One CTA running every tile
# (the stage's uses alternate over many tiles), capped and full grids, one KV tile per tile, Nq > Nk
# causal (tiles with no key: their zero O through the shared stage), GQA / MQA, ragged lengths.
O_HALF_CASES = [(2, 8, 2, 1000, 1031, 1), (2, 8, 2, 2500, 2500, 7), (1, 8, 8, 4096, 4096, None),
                (2, 4, 2, 1000, 17, 3), (1, 8, 1, 300, 1000, 5), (1, 2, 1, 1, 17, None), (2, 8, 2, 8192, 8192, None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", O_HALF_CASES, ids=lambda c: "b%d_h%d/%d_%dx%d_g%s" % c)
def test_o_half(case, causal, dtype):
    b, hq, hkv, nq, nk, grid = case
    if nq >= 8192:
        b = 1   # (the float64 golden's memory)
    run_case(b, hq, hkv, nq, nk, 128, dtype, causal, persistent=True, max_ctas=grid,
             block_m=128, block_n=176, o_half=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("grid", [1, 7, None], ids=lambda g: f"g{g}")
def test_o_half_is_bitwise_the_default_176(grid, causal):
    """o_half changes where O is staged and when tiles start, not one operation on the scores or O:
    its output and lse equal the 128 x 176 kernel's bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, h, 2500, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (8, 2, 2))
    outs = []
    for o_half in (False, True):
        config = Fa3Config(128, 128, 176, 2, causal, True, persistent=True, o_half=o_half)
        outs.append(fa3_forward(q, k, v, causal=causal, config=config, max_ctas=grid))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("case", [c for c in TAIL_CASES if c[7] == 176], ids=lambda c: "b%d_h%d/%d_%dx%d_d%d_%dx%d_g%d_s%d" % c)
def test_tail_split_with_o_half(case):
    """tail_split's chunks take and give o_half's shared O stage like an epilogue (full attention)."""
    b, hq, hkv, nq, nk, d, block_m, block_n, grid, chunks = case
    run_case(b, hq, hkv, nq, nk, d, torch.bfloat16, False, persistent=True, max_ctas=grid,
             block_m=block_m, block_n=block_n, tail_split=True, o_half=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,grid", [(1000, 1031, 7), (2500, 2500, None), (300, 1000, 3)])
def test_softmax_first_three_consumers(nq, nk, grid, causal):
    """softmax_first at D 64 192 x 128 (three consumers; session 14): the pinned P V wait after the
    whole softmax. By the rule, and bitwise equal to the default (the same operations in another order
    of issue)."""
    run_case(2, 8, 2, nq, nk, 64, torch.bfloat16, causal, persistent=True, max_ctas=grid,
             block_m=192, block_n=128, softmax_first=True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, h, n, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h, n in ((8, nq), (2, nk), (2, nk)))
    outs = [fa3_forward(q, k, v, causal=causal, max_ctas=grid, config=Fa3Config(
        64, 192, 128, 2, causal, True, persistent=True, softmax_first=first)) for first in (False, True)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# Session 15 options (off by default): mbar_sleep (mbarrier waits sleep in the barrier, every head dim
# now) on the D 128 / 64 default configs at 8k (full 128 x 176 + tail_split, causal 128 x 128, D 64
# 192 x 128), desc_once (three consumers: wgmma descriptors built once per GEMM) on D 64's 192 x 128.
# By the rule at a capped and a full grid, and bitwise equal to the default (the same operations).
S15_OPTIONS = [(128, dict(mbar_sleep=True)), (64, dict(mbar_sleep=True)), (64, dict(desc_once=True)),
               (64, dict(mbar_sleep=True, desc_once=True))]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,grid", [(1000, 1031, 7), (2500, 2500, None), (300, 1000, 3)])
@pytest.mark.parametrize("opt", S15_OPTIONS, ids=lambda o: f"d{o[0]}_" + "+".join(o[1]))
def test_s15_options(opt, nq, nk, grid, causal):
    d, options = opt
    base = default_config(d, causal, True, 8192)
    tiles = dict(block_m=base.block_m, block_n=base.block_n, tail_split=base.tail_split)
    run_case(2, 8, 2, nq, nk, d, torch.bfloat16, causal, persistent=True, max_ctas=grid, **tiles, **options)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h, n in ((8, nq), (2, nk), (2, nk)))
    outs = [fa3_forward(q, k, v, causal=causal, max_ctas=grid, config=dataclasses.replace(
        base, persistent=True, **(options if on else {}))) for on in (False, True)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# Session 16 options (off by default at D 128 / 64) on the D 128 / 64 defaults, as test_s15_options: producer_sleep
# (the producer's slot waits sleep in the barrier, the consumers' do not) and tile_sections (the dense kernel's
# tiles in L2-sized sections of heads, longest query blocks first: D 256 causal's default since session 16).
S16_OPTIONS = [(128, dict(producer_sleep=True)), (64, dict(producer_sleep=True)),
               (128, dict(tile_sections=1)), (64, dict(tile_sections=1))]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,grid", [(1000, 1031, 7), (2500, 2500, None), (300, 1000, 3)])
@pytest.mark.parametrize("opt", S16_OPTIONS, ids=lambda o: f"d{o[0]}_" + "+".join(o[1]))
def test_s16_options(opt, nq, nk, grid, causal):
    test_s15_options(opt, nq, nk, grid, causal)


# Session 17 option (off by default): exp2_emu (kernel exp2_emu.cuh EXP2_EMU), m of every 8 column groups'
# exponentials by a degree-3 polynomial on the FMA pipe, on the D 64 defaults (192 x 128 at 8k, 128 x 128 causal at
# 1k), D 64 full 1k at 128 x 128, and D 128's 8k default (a control: 128 x 176 + tail_split full, 128 x 128 causal).
# Not bitwise the MUFU path (another approximation): by the rule at a capped and a full grid, causal rows before
# key 0 (Nq > Nk) included (O = 0 and LSE = -inf exactly: the polynomial gives +0 for -inf), fp16 at one of them.
S17_EXP2 = [(64, 8192, 2, None), (64, 8192, 4, None), (64, 8192, 7, None), (64, 1024, 2, None), (64, 1024, 3, (128, 128)),
            (128, 8192, 2, None)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,grid", [(1000, 1031, 7), (2500, 2500, None), (1000, 300, 3)])
@pytest.mark.parametrize("opt", S17_EXP2, ids=lambda o: f"d{o[0]}_n{o[1]}_e{o[2]}" + (f"_{o[3][0]}x{o[3][1]}" if o[3] else ""))
def test_s17_exp2_emu(opt, nq, nk, grid, causal):
    d, n, m, tile = opt
    base = default_config(d, causal, True, n)
    bm, bn = tile or (base.block_m, base.block_n)
    dtype = torch.float16 if (m == 4 and grid == 7) else torch.bfloat16
    run_case(2, 8, 2, nq, nk, d, dtype, causal, persistent=True, max_ctas=grid, block_m=bm, block_n=bn,
             tail_split=base.tail_split, tile_sections=base.tile_sections, exp2_emu=m)


# align_end (kernel ALIGN_END, dense causal): block 0 covers rows [0, BLOCK_M), every later block ends at Nq, so no block
# is partial and the first two overlap by the pad rows (both write the same values). By the rule (poisoned O / LSE) and
# bitwise equal to the default (a row visits the same attended KV tiles in the same order; an extra fully masked tile
# leaves its state as it was), at D 64 192 x 128 / 128 x 128, D 128 128 x 128 / 128 x 176, D 256 128 x 80; with exp2_emu.
S17_ALIGN = [(64, 8192, {}), (64, 1024, {}), (128, 8192, {}), (128, 16384, {}), (256, 8192, {}),
             (64, 8192, dict(exp2_emu=2))]


@pytest.mark.parametrize("nq,nk,grid", [(1000, 1031, 7), (2500, 2500, None), (1000, 300, 3), (300, 1000, 5)])
@pytest.mark.parametrize("opt", S17_ALIGN, ids=lambda o: f"d{o[0]}_n{o[1]}" + "".join(f"_{k}{v}" for k, v in o[2].items()))
def test_s17_align_end(opt, nq, nk, grid):
    d, n, extra = opt
    base = dataclasses.replace(default_config(d, True, True, n), persistent=True, **extra)
    run_case(2, 8, 2, nq, nk, d, torch.bfloat16, True, persistent=True, max_ctas=grid, block_m=base.block_m,
             block_n=base.block_n, tile_sections=base.tile_sections, k_before_v=base.k_before_v, uniform_q=base.uniform_q,
             wg_turns=base.wg_turns, rescale_before_pv=base.rescale_before_pv, align_end=True, **extra)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, h, m, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h, m in ((8, nq), (2, nk), (2, nk)))
    outs = [fa3_forward(q, k, v, causal=True, max_ctas=grid, config=dataclasses.replace(base, align_end=on))
            for on in (False, True)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_s17_exp2_emu_range_is_checked():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="exp2_emu"):
        fa3_forward(q, q, q, config=dataclasses.replace(default_config(64, False, True, 64), exp2_emu=8))


def _cfg_id(cfg: dict) -> str:
    return "_".join(f"{k}{'+'.join(v) if isinstance(v, tuple) else v}" for k, v in cfg.items())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", [17, 1000, 2500], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_cfg_id)
def test_tile_configs(cfg, n, causal):
    cfg = dict(cfg)
    d = cfg.pop("d")
    run_case(2, 8, 2, n, n + 31, d, torch.bfloat16, causal, persistent=True, max_ctas=7, **cfg)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", [4096, 8192, 16384], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
def test_default_config_at_long_lengths(d, n, causal):
    """default_config's long-sequence choices (session 14: causal D 128 128 x 128 below 16k and
    128 x 176 from 16k; full 128 x 176 with the options it sets; causal's tile_sections from 4k, session 17) on the
    full persistent grid (256
    tiles on the SMs: a last wave), by the rule. Two heads: the float64 golden of 16k rows is 4 GB."""
    run_case(1, 2, 1, n, n, d, torch.bfloat16, causal, persistent=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("max_ctas", [1, 3, 64])
def test_few_ctas_many_tiles(max_ctas, causal):
    """A CTA runs many tiles back to back: Q slot and K/V ring phases carry across tiles."""
    run_case(2, 4, 1, 700, 650, 128, torch.float16, causal, persistent=True, max_ctas=max_ctas)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", [(17, 1000), (1000, 17), (128, 300), (300, 129), (1, 4096)])
def test_separate_lengths(nq, nk, causal):
    """Nq != Nk; queries aligned to the end of the keys (causal: row i sees keys <= i + Nk - Nq;
    with Nq > Nk the first rows see none: O = 0, LSE = -inf)."""
    run_case(2, 4, 2, nq, nk, 128, torch.bfloat16, causal)


@pytest.mark.parametrize("nq,nk", [(1000, 17), (300, 129)])
def test_rows_before_key_zero_with_o_in_the_q_slot(nq, nk):
    """Nq > Nk causal at 128 x 176 (one Q slot, O staged in it): the tiles of the first Nq - Nk
    rows attend no key and write their zero O through the Q slot, which they must take from the
    producer like any tile (before the fix, the next tile's Q landed under it: reruns differed,
    as test_fa3_sm90_d256.py::test_d256_ragged did at D 256). Few CTAs: one CTA runs both."""
    run_case(2, 16, 8, nq, nk, 128, torch.bfloat16, True, persistent=True, max_ctas=7,
             block_m=128, block_n=176, stages=2)


@pytest.mark.parametrize("memory", ["bnhd", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", [(777, 777), (1000, 17), (300, 1000)])
@pytest.mark.parametrize("d", HEAD_DIMS + [256], ids=lambda d: f"d{d}")
def test_strided_memory_read_in_place(d, nq, nk, causal, memory):
    """The 4-D TMA maps (D, N, H, B): [B, N, H, D] memory (B > 1, GQA) and padded rows are read,
    and O written, in place; few CTAs, so tiles of several heads and batches share a CTA."""
    run_case(3, 8, 2, nq, nk, d, torch.bfloat16, causal, persistent=True, max_ctas=11, memory=memory)


def test_strides_the_maps_cannot_express_are_refused():
    q = torch.randn(1, 2, 64, 130, device="cuda", dtype=torch.bfloat16)[..., :128]   # 260-byte rows
    k = v = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match=r"q: the kernel's TMA maps cannot read it in place: the N stride 130"):
        fa3_forward(q, k, v)
    with pytest.raises(LaunchError, match=r"out must be .* 16-byte multiples"):
        fa3_forward(k, k, v, out=torch.empty(1, 2, 64, 130, device="cuda", dtype=torch.bfloat16)[..., :128])


def test_tile_counter_is_zero_after_every_launch():
    """The kernel's last producer resets the per-stream scheduler counter; grids of different
    sizes back to back on one stream then all see a zero counter (else tiles would be skipped and
    their outputs left NaN, which run_case catches)."""
    from cubridge.runtime.fa3_sm90 import tile_counter
    for max_ctas in (1, 5, None, 2):
        run_case(1, 4, 2, 900, 900, 128, torch.bfloat16, True, persistent=True, max_ctas=max_ctas)
        stream = torch.cuda.current_stream().cuda_stream
        assert tile_counter(torch.device("cuda", torch.cuda.current_device()), stream).tolist() == [0, 0]


def test_streams_have_their_own_counters():
    """Launches on two streams at once use separate counters and both finish correctly."""
    from cubridge.runtime.fa3_sm90 import tile_counter
    side = torch.cuda.Stream()
    q, k, v = (torch.randn(2, 8, 1500, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    outs = [torch.full_like(q, math.nan) for _ in range(2)]
    torch.cuda.synchronize()
    fa3_forward(q, k, v, causal=True, out=outs[0], max_ctas=3)
    with torch.cuda.stream(side):
        fa3_forward(q, k, v, causal=True, out=outs[1], max_ctas=5)
    torch.cuda.synchronize()
    dev = torch.device("cuda", torch.cuda.current_device())
    assert tile_counter(dev, side.cuda_stream).data_ptr() != tile_counter(dev, torch.cuda.current_stream().cuda_stream).data_ptr()
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1])


def test_cached_tensor_maps_follow_new_data():
    """Tensor maps are cached by address and shape: new values at a reused address, and a new
    tensor at a new address, must both be read afresh."""
    q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    first = fa3_forward(q, k, v)[0].clone()
    q.mul_(0.5)
    k2 = torch.randn_like(k)
    second = fa3_forward(q, k2, v)[0]
    golden, _ = attention(q.double(), k2.double(), v.double(), False)
    ref, _ = attention(q, k2, v, False)
    assert compare(second, golden, ref).passed and not torch.equal(first, second)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("factor", [0.25, 3.0])
def test_softmax_scale(factor, causal):
    """A non-default softmax_scale (folded into the exp2 FFMA, the max taken on raw scores)."""
    q, k, v = (torch.randn(1, 4, 700, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fa3_forward(q, k, v, causal=causal, softmax_scale=factor / math.sqrt(128))
    golden, golden_lse = attention(q.double() * factor, k.double(), v.double(), causal)
    ref, _ = attention((q.float() * factor).to(q.dtype), k, v, causal)
    assert compare(out, golden, ref).passed
    assert (lse.double() - golden_lse).abs().max().item() <= 1e-3 * max(1.0, factor)


@pytest.mark.parametrize("scale", [0.0, -0.1, float("inf"), float("nan")])
def test_softmax_scale_must_be_positive(scale):
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="softmax_scale"):
        fa3_forward(q, q, q, softmax_scale=scale)


def test_nvcc_and_nvrtc_agree():
    """The two build paths give the same kernel: bitwise-equal outputs for the dense kernel and a
    lowered variant (a machine without the toolkit builds with NVRTC)."""
    from cubridge.runtime.build import BuildError, _nvrtc
    import shutil
    try:
        _nvrtc()
    except BuildError as e:
        pytest.skip(f"NVRTC not available: {e}")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.paths import ref_kernel_dir
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    q = torch.randn(2, 8, 777, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 777, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outs = {c: fa3_forward(q, k, v, causal=True, compiler=c)[0] for c in ("nvcc", "nvrtc")}
    assert torch.equal(outs["nvcc"], outs["nvrtc"]) and not torch.isnan(outs["nvcc"]).any()
    spec = load_spec("share_question")
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec)
    kern = lower(cand.program, "fa3_sm90")
    cfg = default_config(128, False, True, 777, variant=True)
    launch = kern.args(cand.bind(Nq=777, Nk=777, Hq=8, Hkv=2, B=2,
                                 params={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}, device=q.device), q.device)
    outs = {c: fa3_forward(q, k, v, config=cfg, variant=launch, compiler=c)[0] for c in ("nvcc", "nvrtc")}
    assert torch.equal(outs["nvcc"], outs["nvrtc"]) and not torch.isnan(outs["nvcc"]).any()


def test_llama_heads_bf16():
    run_case(1, 32, 32, 2048, 2048, 128, torch.bfloat16, True, seed=3)


def test_no_keys_gives_zero_and_minus_inf():
    q = torch.randn(1, 2, 5, 64, device="cuda", dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = fa3_forward(q, k, v)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())


@pytest.mark.parametrize("bad", ["noncontig", "dtype", "heads", "headdim", "cpu"])
def test_launch_checks(bad):
    q = torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    v = k.clone()
    if bad == "noncontig":   # D not contiguous: no TMA map reads it ([B, N, H, D] memory is read in place)
        q = q.transpose(2, 3).contiguous().transpose(2, 3)
    elif bad == "dtype":
        q = q.float()
    elif bad == "heads":
        k = v = torch.randn(1, 3, 64, 128, device="cuda", dtype=torch.bfloat16)
    elif bad == "headdim":
        q, k, v = q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous()
    elif bad == "cpu":
        q = q.cpu()
    with pytest.raises(LaunchError):
        fa3_forward(q, k, v)


# Session 17b options (off by default): tree_max (kernel tree_max.cuh TREE_MAX), each row half's max as a pairwise tree,
# both halves side by side; split_exps (consumer.cuh SPLIT_EXPS, three consumers): half 0's exponentials, the pinned
# P V wait, O's rescale and half 1's exponentials. By the rule (poisoned O / LSE, float64 golden, bitwise rerun) and
# bitwise equal to the default (the same operations; max is exact in any order), on the D 64 defaults (192 x 128 at 8k
# full / causal; 128 x 128 causal at 1k, where split_exps has no effect), D 128's 8k defaults (two consumers: the split
# P V wait's softmax_args; 128 x 176 full: an odd fold of 22 groups), D 64 with exp2_emu (tree_max only) and with
# rescale_before_pv; causal rows before key 0 (Nq > Nk) included.
S17B = [(64, 8192, dict(tree_max=True)), (64, 8192, dict(split_exps=True)), (64, 8192, dict(tree_max=True, split_exps=True)),
        (64, 1024, dict(tree_max=True, split_exps=True)), (128, 8192, dict(tree_max=True)),
        (64, 8192, dict(tree_max=True, split_exps=True, exp2_emu=2)), (64, 8192, dict(tree_max=True, rescale_before_pv=True))]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,grid", [(1000, 1031, 7), (2500, 2500, None), (1000, 300, 3)])
@pytest.mark.parametrize("opt", S17B, ids=lambda o: f"d{o[0]}_n{o[1]}" + "".join(f"_{k}{int(v)}" for k, v in o[2].items()))
def test_s17b_softmax_options(opt, nq, nk, grid, causal):
    d, n, extra = opt
    ours = {k: v for k, v in extra.items() if k in ("tree_max", "split_exps")}
    base = dataclasses.replace(default_config(d, causal, True, n), persistent=True,
                               **{k: v for k, v in extra.items() if k not in ours})
    fields = ("block_m", "block_n", "tail_split", "tile_sections", "k_before_v", "uniform_q", "wg_turns",
              "rescale_before_pv", "align_end", "exp2_emu")
    run_case(2, 8, 2, nq, nk, d, torch.bfloat16, causal, persistent=True, max_ctas=grid,
             **{f: getattr(base, f) for f in fields}, **ours)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, h, m, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h, m in ((8, nq), (2, nk), (2, nk)))
    outs = [fa3_forward(q, k, v, causal=causal, max_ctas=grid, config=dataclasses.replace(base, **(ours if on else {})))
            for on in (False, True)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
