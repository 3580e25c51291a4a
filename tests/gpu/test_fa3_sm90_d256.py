"""Head dim 256 on the Hopper reference kernel (issue 19 item 3) under the verification rule:
dense causal / full at both D = 256 tiles (128 x 80, 24 / 240 registers; 128 x 64, 40 / 232), ragged
and separate lengths, MHA / GQA (Gemma-2's 16 q / 8 kv heads) / MQA, few CTAs over many tiles; and
the Gemma-2 local layer (softcap 50 + sliding window, causal, 16 / 8 heads) transferred from
tests/corpus/gemma2_local.py, lowered and run at both tiles, with lengths past the window.
golden = float64, ref = the kernel dtype, pass iff max|out - golden| <= 2 max|ref - golden| + 1e-5;
outputs poisoned first, inputs unchanged, a second run bitwise equal (test_fa3_sm90.run_case)."""
from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest
import torch

from test_fa3_sm90 import run_case   # tests/gpu is on sys.path (no __init__.py): the same checks

from cubridge import rule

_HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not _HAS_SM90, reason="needs a CUDA GPU of compute capability 9.0 (H100/H200) for wgmma and TMA")]

D = 256
TILES = [dict(block_m=128, block_n=80, stages=2), dict(block_m=128, block_n=64, stages=2)]
GEMMA2 = Path(__file__).resolve().parents[1] / "corpus" / "gemma2_local.py"


# Without the consumers' GEMM turns (Fa3Config.wg_turns=False, off by default; FA4's D 256 schedule),
# and with it O rescaled before the P V issue (rescale_before_pv, FA4's rescale_O_before_gemm)
FREE = [dict(t, wg_turns=False) for t in TILES] + [dict(TILES[0], wg_turns=False, rescale_before_pv=True),
                                                   dict(TILES[0], wg_turns=False, rescale_before_pv=True,
                                                        softmax_first=True)]


def _tile_id(t: dict) -> str:
    return (f"{t['block_m']}x{t['block_n']}" + ("_free" if t.get("wg_turns") is False else "")
            + ("_rescale_before_pv" if t.get("rescale_before_pv") else "")
            + ("_softmax_first" if t.get("softmax_first") else "") + ("_k_before_v" if t.get("k_before_v") else "")
            + ("_pv_wait_early" if t.get("pv_wait_early") else "") + ("_mbar_sleep" if t.get("mbar_sleep") else "")
            + ("_uniform_q" if t.get("uniform_q") else "") + ("_tile_sections" if t.get("tile_sections") else "")
            + ("_v_wait_first" if t.get("v_wait_first") else ""))


@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 8), (8, 1)], ids=["mha", "gqa16_8", "mqa"])
@pytest.mark.parametrize("n", [1, 17, 1000, 2500], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("tiles", TILES, ids=_tile_id)
def test_d256_square(tiles, n, heads, causal, persistent):
    hq, hkv = heads
    run_case(2 if n < 1000 else 1, hq, hkv, n, n, D, torch.bfloat16, causal, persistent=persistent, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(17, 1000), (1000, 17), (300, 129), (1, 4096)])
@pytest.mark.parametrize("tiles", TILES, ids=_tile_id)
def test_d256_ragged(tiles, nq, nk, causal):
    run_case(2, 16, 8, nq, nk, D, torch.bfloat16, causal, persistent=True, max_ctas=7, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d256_default_config_fp16(causal):
    run_case(1, 8, 2, 1000, 1000, D, torch.float16, causal)


def _gemma2(n: int, window: int, tiles: dict, hq=16, hkv=8):
    """Gemma-2 local: transferred by the rules, lowered onto fa3_sm90 at `tiles`, run at n."""
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.paths import ref_kernel_dir
    from cubridge.runtime.fa3_sm90 import Fa3Config, fa3_forward
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    params = {"window": window, "softcap": 50.0}
    spec = load_spec(GEMMA2)
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec, spec_params=params)
    kern = lower(cand.program, "fa3_sm90")
    cfg = Fa3Config(head_dim=D, causal=False, bf16=True, persistent=True, **tiles)
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"gemma2{n}{window}".encode()))
    q, k, v = (torch.randn(s, device="cuda", generator=g).to(torch.bfloat16)
               for s in ((1, hq, n, D), (1, hkv, n, D), (1, hkv, n, D)))
    before = [t.clone() for t in (q, k, v)]

    def run():
        out = torch.full_like(q, math.nan)
        inputs = cand.bind(Nq=n, Nk=n, Hq=hq, Hkv=hkv, B=1,
                           params={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}, device=q.device)
        fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=kern.args(inputs, q.device))
        torch.cuda.synchronize()
        return out
    out = run()
    assert not torch.isnan(out).any(), "some output element was never written"
    golden = spec.run_reference(q.double(), k.double(), v.double(), **params)
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v, **params))
    assert verdict.passed, f"gemma2_local n={n} window={window} {cfg}: {verdict}"
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs changed"
    assert torch.equal(out, run()), "second run differs"


@pytest.mark.parametrize("n, window", [(1000, 64), (2500, 1000), (4500, 4096)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("tiles", TILES, ids=_tile_id)
def test_gemma2_local_softcap_window(tiles, n, window):
    """Lengths past the window, so its lower edge cuts KV tiles (4096 is Gemma-2's own). Past 4096
    rows, 4 / 2 heads: the dense float64 reference of 16 heads ran out of memory beside 11 other
    test workers (session 10 mid call)."""
    _gemma2(n, window, tiles, *((4, 2) if n > 4096 else (16, 8)))


@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 8)], ids=["mha", "gqa16_8"])
@pytest.mark.parametrize("n", [17, 2500], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("tiles", FREE, ids=_tile_id)
def test_d256_free_square(tiles, n, heads, causal, persistent):
    """The kernel without GEMM turns: the same checks as test_d256_square."""
    hq, hkv = heads
    run_case(2 if n < 1000 else 1, hq, hkv, n, n, D, torch.bfloat16, causal, persistent=persistent, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(17, 1000), (1000, 17), (300, 129), (1, 4096)])
@pytest.mark.parametrize("tiles", [FREE[0], FREE[3]], ids=_tile_id)
def test_d256_free_ragged(tiles, nq, nk, causal):
    """Few CTAs over many tiles, rows before key 0: without turns each consumer runs ahead alone."""
    run_case(2, 16, 8, nq, nk, D, torch.bfloat16, causal, persistent=True, max_ctas=7, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d256_rescale_before_pv_bitwise_equal(causal):
    """Moving O's rescale before the P V issue, or the exponentials before the P V wait, changes no
    arithmetic: the output is bitwise the kernel's without them (all without turns, which change no
    arithmetic either)."""
    from cubridge.runtime.fa3_sm90 import Fa3Config, fa3_forward
    g = torch.Generator(device="cuda").manual_seed(2561)
    q, k, v = (torch.randn(1, 8, 2500, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    outs = [fa3_forward(q, k, v, causal=causal, config=Fa3Config(head_dim=D, causal=causal, persistent=True, **t))[0]
            for t in (TILES[0], FREE[0], FREE[2], FREE[3])]
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1]), "without turns the output changed"
    assert torch.equal(outs[1], outs[2]), "rescale_before_pv changed the output"
    assert torch.equal(outs[2], outs[3]), "softmax_first changed the output"


@pytest.mark.parametrize("n, window", [(2500, 1000), (4500, 4096)], ids=lambda x: str(x))
@pytest.mark.parametrize("tiles", FREE, ids=_tile_id)
def test_gemma2_local_free(tiles, n, window):
    _gemma2(n, window, tiles, *((4, 2) if n > 4096 else (16, 8)))


# Session 14's options (off by default), in FA4's D 256 schedule (no turns, O rescaled before the P V issue):
# the producer's K_i before V_{i-1} (Fa3Config.k_before_v, FA4's load order); the P V waited for before the
# softmax (pv_wait_early: the V slot freed earlier); both; mbarrier waits that sleep (mbar_sleep)
FR = dict(TILES[0], wg_turns=False, rescale_before_pv=True)
S14 = [dict(FR, k_before_v=True), dict(FR, pv_wait_early=True), dict(FR, k_before_v=True, pv_wait_early=True),
       dict(FR, mbar_sleep=True), dict(FR, k_before_v=True, mbar_sleep=True)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 8)], ids=["mha", "gqa16_8"])
@pytest.mark.parametrize("n", [17, 2500], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("tiles", S14, ids=_tile_id)
def test_d256_s14_square(tiles, n, heads, causal):
    hq, hkv = heads
    run_case(2 if n < 1000 else 1, hq, hkv, n, n, D, torch.bfloat16, causal, persistent=True, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(17, 1000), (1000, 17), (300, 129), (1, 4096)])
@pytest.mark.parametrize("tiles", S14, ids=_tile_id)
def test_d256_s14_ragged(tiles, nq, nk, causal):
    """Few CTAs over many tiles (the lagged V crosses into the next tile's loads), one KV tile per
    query tile, rows before key 0 (tiles with no KV tile)."""
    run_case(2, 16, 8, nq, nk, D, torch.bfloat16, causal, persistent=True, max_ctas=7, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d256_s14_bitwise_equal(causal):
    """The load order and the wait's place change no arithmetic: bitwise the output without them."""
    from cubridge.runtime.fa3_sm90 import Fa3Config, fa3_forward
    g = torch.Generator(device="cuda").manual_seed(2562)
    q, k, v = (torch.randn(1, 8, 2500, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    outs = [fa3_forward(q, k, v, causal=causal, config=Fa3Config(head_dim=D, causal=causal, persistent=True, **t))[0]
            for t in (FR, *S14)]
    assert not torch.isnan(outs[0]).any()
    for name, out in zip(("k_before_v", "pv_wait_early", "both", "mbar_sleep", "k_before_v + mbar_sleep"), outs[1:]):
        assert torch.equal(outs[0], out), f"{name} changed the output (free, rescale_before_pv)"


# Session 15's option (off by default): the consumer index warp-uniform in the consumers (uniform_q: the Q
# descriptors in uniform registers), over fr, with the turns (the product before fr), and over frkz (session 14's
# best row)
S15 = [dict(FR, uniform_q=True), dict(TILES[0], uniform_q=True), dict(FR, k_before_v=True, mbar_sleep=True, uniform_q=True)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 8), (8, 1)], ids=["mha", "gqa16_8", "mqa"])
@pytest.mark.parametrize("n", [17, 2500], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("tiles", S15, ids=_tile_id)
def test_d256_s15_square(tiles, n, heads, causal):
    """The persistent grid at n 2500, one tile per CTA at n 17."""
    hq, hkv = heads
    run_case(2 if n < 1000 else 1, hq, hkv, n, n, D, torch.bfloat16, causal, persistent=n > 1000, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(17, 1000), (1000, 17), (300, 129), (1, 4096)])
@pytest.mark.parametrize("tiles", S15, ids=_tile_id)
def test_d256_s15_ragged(tiles, nq, nk, causal):
    """Few CTAs over many tiles (the tile counts the consumers recompute), rows before key 0, one KV tile, one row."""
    run_case(2, 16, 8, nq, nk, D, torch.bfloat16, causal, persistent=True, max_ctas=7, **tiles)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d256_s15_bitwise_equal(causal):
    """uniform_q changes no arithmetic (only where the Q descriptor lives): bitwise the output without it."""
    from cubridge.runtime.fa3_sm90 import Fa3Config, fa3_forward
    g = torch.Generator(device="cuda").manual_seed(2563)
    q, k, v = (torch.randn(2, 8, 2500, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    pairs = [(FR, S15[0]), (TILES[0], S15[1]), (dict(FR, k_before_v=True, mbar_sleep=True), S15[2])]
    for base, opt in pairs:
        a, b = (fa3_forward(q, k, v, causal=causal, config=Fa3Config(head_dim=D, causal=causal, persistent=True, **t))[0]
                for t in (base, opt))
        assert not torch.isnan(a).any()
        assert torch.equal(a, b), f"uniform_q changed the output of {_tile_id(base)}"


# Session 16: frku (k_before_v over the causal default, fr + uniform_q: the candidate default), tile_sections
# (Fa3Config.tile_sections, off by default: the dense kernel's tile order in L2-sized sections of heads, longest
# first inside a section), alone and with k_before_v, and v_wait_first (V_{i-1} waited for before the QK issue)
FRU = dict(FR, uniform_q=True)
S16 = [dict(FRU, k_before_v=True), dict(FRU, tile_sections=1), dict(FRU, k_before_v=True, tile_sections=1),
       dict(FRU, v_wait_first=True)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 8), (8, 1)], ids=["mha", "gqa16_8", "mqa"])
@pytest.mark.parametrize("n", [17, 2500], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("tiles", S16, ids=_tile_id)
def test_d256_s16_square(tiles, n, heads, causal):
    """The persistent grid at n 2500, one tile per CTA at n 17 (session 15's cases)."""
    test_d256_s15_square(tiles, n, heads, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(17, 1000), (1000, 17), (300, 129), (1, 4096)])
@pytest.mark.parametrize("tiles", S16, ids=_tile_id)
def test_d256_s16_ragged(tiles, nq, nk, causal):
    """Few CTAs over many tiles, rows before key 0 (tiles with no KV tile), one KV tile, one row (session 15's cases)."""
    test_d256_s15_ragged(tiles, nq, nk, causal)


# (B, Hq, Hkv, Nq, Nk): sections of 4 heads at Nk 6600 (6.8 MB of K and V a head in 50 MB) with a short last one
# (5 = 4 + 1), one short section of 15 at 3000 (3 MB: 16 a section), 4 sections of 4 at Nk 9000 (GQA), queries
# past the keys (rows before key 0) in one section of 32. (The mid call's 1 x 6 x 8192 and 2 x 16 x 1000 x 9000 ran
# the float64 golden out of memory beside 7 other workers.)
SECTION_SHAPES = [(1, 5, 5, 6600, 6600), (3, 5, 1, 3000, 3000), (1, 16, 8, 1000, 9000), (2, 16, 8, 3000, 1000)]


@pytest.mark.parametrize("sections, persistent", [(1, False), (1, True), (3, True)], ids=["l2_grid", "l2", "three"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SECTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_d256_s16_tile_sections(shape, causal, persistent, sections):
    """Every tile once in the sectioned order: full and short sections (sized to L2, or 3 heads each: 6 = 3 + 3,
    15 = 5 x 3, 32 = 10 x 3 + 2), one tile per CTA and persistent (7 CTAs)."""
    b, hq, hkv, nq, nk = shape
    run_case(b, hq, hkv, nq, nk, D, torch.bfloat16, causal, persistent=persistent,
             max_ctas=7 if persistent else None, **dict(S16[2], tile_sections=sections))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d256_s16_bitwise_equal(causal):
    """The tile order, the load order and the V wait's place change no arithmetic: bitwise the output of fr +
    uniform_q without them."""
    from cubridge.runtime.fa3_sm90 import Fa3Config, fa3_forward
    g = torch.Generator(device="cuda").manual_seed(2564)
    q, k, v = (torch.randn(1, 6, 8192, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    outs = [fa3_forward(q, k, v, causal=causal, config=Fa3Config(head_dim=D, causal=causal, persistent=True, **t))[0]
            for t in (FRU, *S16, dict(FRU, v_wait_first=True, tile_sections=1))]
    assert not torch.isnan(outs[0]).any()
    for t, out in zip((*S16, dict(FRU, v_wait_first=True, tile_sections=1)), outs[1:]):
        assert torch.equal(outs[0], out), f"{_tile_id(t)} changed the output of fr + uniform_q"
