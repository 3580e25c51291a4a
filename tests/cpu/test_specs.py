"""The spec format and the ten built-in specs: loading, hooks == reference, the verification rule's
sanity on each reference, FlexAttention compatibility, exact attended-pair counts, and the errors a
user sees for a broken spec."""
from __future__ import annotations

import doctest
import itertools
import warnings
from pathlib import Path

import pytest
import torch

import cubridge.spec
import cubridge.specs
from cubridge.errors import SpecError
from cubridge.specs import EXAMPLES
from cubridge.rule import compare
from cubridge.spec import Hooks, Normalization, attention_from_hooks, builtin_specs, load_spec
from cubridge.transfer.pairs import count_attended

NAMES = ["full", "causal", "prefixlm", "global_sliding_window", "causal_blockwise",
         "share_question", "relative_pos", "relu", "sigmoid", "composite"]
SPEC_DIR = Path(cubridge.specs.__file__).parent
REPO = SPEC_DIR.parent.parent
# The benchmark defaults (window 256, block 256) are no-ops at N <= 70: shrink them so the tests
# reach the masked regions too.
SMALL = {"global_sliding_window": {"window": 16, "global_tokens": 5},
         "causal_blockwise": {"block": 16},
         "share_question": {"question": 7, "answers": 3}}
CASES = [(name, {}) for name in NAMES] + [(name, p) for name, p in SMALL.items()]
CASE_IDS = [f"{n}-small" if p else n for n, p in CASES]
SQUARE = [(n, n, hkv) for n in (1, 17, 70) for hkv in (4, 2, 1)]
RAGGED = [(17, 70, 2), (69, 70, 1), (1, 70, 4), (5, 17, 4)]    # Nq <= Nk: queries end-aligned
B, HQ, D = 2, 4, 16


def make_inputs(Nq, Nk, Hkv, seed, dtype=torch.float64):
    """Fresh random q, k, v (never zeros); scaled up so relu and the softcap see large scores."""
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(B, HQ, Nq, D, generator=g, dtype=torch.float64)
    k = 2 * torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v))


# ---- loading ---------------------------------------------------------------------------------

def test_builtin_names_in_design_order():
    assert builtin_specs() == NAMES
    assert sorted(p.stem for p in SPEC_DIR.glob("*.py") if p.stem != "__init__") == sorted(NAMES + list(EXAMPLES))


@pytest.mark.parametrize("name", NAMES)
def test_builtin_loads_by_name_and_path(name):
    by_name = load_spec(name)
    by_path = load_spec(SPEC_DIR / f"{name}.py")
    by_str = load_spec(str(SPEC_DIR / f"{name}.py"))
    for spec in (by_name, by_path, by_str):
        assert spec.name == name and spec.has_hooks
        assert spec.params == by_name.params
        assert spec.doc and "def reference" in spec.source
        assert name in repr(spec)
    assert by_name.flex_expressible == (name not in ("relu", "sigmoid", "composite"))


def test_relative_path_and_dotted_module(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "myspec.py").write_text((SPEC_DIR / "causal.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert load_spec("mypkg.myspec").name == "myspec"
    assert load_spec("mypkg/myspec.py").name == "myspec"
    with pytest.raises(SpecError, match="mypkg.nothere"):
        load_spec("mypkg.nothere")


def test_flexattention_style_user_spec(tmp_path):
    """A user brings FlexAttention mods unchanged, without importing cubridge."""
    path = tmp_path / "alibi_window.py"
    path.write_text('''"""Causal window of 5 with a distance penalty."""
import math, torch
PARAMS = {}
def mask_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 5)
def score_mod(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (q_idx - kv_idx)
def reference(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2])[:, None]; j = torch.arange(k.shape[2])[None, :]
    s = s - 0.1 * (i - j)
    return torch.softmax(s.masked_fill(~((j <= i) & (i - j < 5)), float("-inf")), -1) @ v
''')
    spec = load_spec(path)
    assert spec.name == "alibi_window" and spec.flex_expressible
    q, k, v = make_inputs(12, 12, HQ, seed=0)
    hooks = spec.hooks_for(12, 12, HQ, HQ)
    torch.testing.assert_close(attention_from_hooks(q, k, v, hooks), spec.run_reference(q, k, v),
                               rtol=0, atol=1e-10)


def test_docstring_examples(monkeypatch):
    monkeypatch.chdir(REPO)  # the repr example prints the path relative to the repository
    assert doctest.testmod(cubridge.spec).failed == 0


# ---- hooks agree with the reference; the rule accepts each reference's own rounding -----------

@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("Nq,Nk,Hkv", SQUARE + RAGGED)
def test_hooks_match_reference_float64(name, params, Nq, Nk, Hkv):
    spec = load_spec(name)
    q, k, v = make_inputs(Nq, Nk, Hkv, seed=Nq * 100 + Nk + Hkv)
    golden = spec.run_reference(q, k, v, **params)
    assert golden.shape == q.shape and golden.dtype == torch.float64
    assert torch.isfinite(golden).all()
    out = attention_from_hooks(q, k, v, spec.hooks_for(Nq, Nk, HQ, Hkv, **params))
    torch.testing.assert_close(out, golden, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name,params", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("Nq,Nk,Hkv", [(17, 17, 2), (70, 70, 1), (17, 70, 4), (41, 70, 2)])
def test_bf16_reference_passes_rule(name, params, Nq, Nk, Hkv):
    spec = load_spec(name)
    low = make_inputs(Nq, Nk, Hkv, seed=7 + Nq + Nk, dtype=torch.bfloat16)
    golden = spec.run_reference(*(t.double() for t in low), **params)  # same rounded inputs
    ref = spec.run_reference(*low, **params)
    assert ref.dtype == torch.bfloat16  # the reference computes in its inputs' dtype
    assert compare(ref, golden, ref).passed
    out = attention_from_hooks(*low, spec.hooks_for(Nq, Nk, HQ, Hkv, **params))
    verdict = compare(out, golden, ref)
    assert verdict.passed, str(verdict)


def test_queries_are_aligned_to_the_end_of_the_keys():
    spec = load_spec("causal")
    q, k, v = make_inputs(3, 8, HQ, seed=1)
    out = spec.run_reference(q, k, v)
    # Query 2 sits at position 7 and sees every key; query 0 (position 5) sees keys 0..5.
    kk, vv = (t.repeat_interleave(HQ // t.shape[1], dim=1) for t in (k, v))
    w = torch.softmax(q[:, :, :1] @ kk[:, :, :6].transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
    torch.testing.assert_close(out[:, :, :1], w @ vv[:, :, :6], rtol=0, atol=1e-12)
    assert spec.picture(4).splitlines()[0] == "#..."
    hooks = spec.hooks_for(3, 8, HQ, HQ)
    assert count_attended(hooks, 1, 1, 3, 8) == 6 + 7 + 8
    with pytest.raises(SpecError, match="Nq=8 > Nk=3"):
        spec.run_reference(*make_inputs(8, 3, HQ, seed=1))
    picture = load_spec("prefixlm").picture(6)
    assert picture.splitlines() == ["###...", "###...", "###...", "####..", "#####.", "######"]


@pytest.mark.parametrize("kind", ["softmax", "sigmoid", "relu"])
def test_row_without_keys_gives_zero(kind):
    norm = Normalization(kind)
    hooks = Hooks(mask_mod=lambda b, h, q_idx, kv_idx: kv_idx > q_idx, normalization=norm)
    q, k, v = make_inputs(5, 5, HQ, seed=3)
    out = attention_from_hooks(q, k, v, hooks)
    assert torch.isfinite(out).all()
    assert (out[:, :, -1] == 0).all()  # the last query has no key after it


# ---- FlexAttention runs the same mods --------------------------------------------------------

def _flex_or_skip():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
        mask = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 4, 4, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex_attention(q, q, q, block_mask=mask)
    except Exception as exc:  # old torch, no eager CPU path: nothing to compare against
        pytest.skip(f"flex_attention does not run eagerly on CPU here: {type(exc).__name__}: {exc}")
    return create_block_mask, flex_attention


NOT_SOFTMAX = ("relu", "sigmoid", "composite")


@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] not in NOT_SOFTMAX],
                         ids=[i for i in CASE_IDS if i not in NOT_SOFTMAX])
@pytest.mark.parametrize("Nq,Nk,Hkv", [(17, 17, 4), (70, 70, 2), (17, 70, 1), (41, 70, 4)])
def test_softmax_specs_through_flex_attention(name, params, Nq, Nk, Hkv):
    create_block_mask, flex_attention = _flex_or_skip()
    spec = load_spec(name)
    hooks = spec.hooks_for(Nq, Nk, HQ, Hkv, **params).for_flex(Nq, Nk)
    assert hooks.flex_expressible
    q, k, v = make_inputs(Nq, Nk, Hkv, seed=11)
    block_mask = None
    if hooks.mask_mod is not None:
        block_mask = create_block_mask(hooks.mask_mod, B, HQ, Nq, Nk, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": eager is what we want
        out = flex_attention(q, k, v, score_mod=hooks.score_mod, block_mask=block_mask,
                             enable_gqa=Hkv != HQ)
    torch.testing.assert_close(out, spec.run_reference(q, k, v, **params), rtol=0, atol=1e-10)


# ---- exact attended-pair counts --------------------------------------------------------------

def test_count_causal_and_full():
    N = 70
    causal = load_spec("causal").hooks_for(N, N, 3, 1)
    assert count_attended(causal, 2, 3, N, N) == 2 * 3 * N * (N + 1) // 2
    assert count_attended(causal, 2, 3, N, N, chunk_elems=100) == 2 * 3 * N * (N + 1) // 2
    assert count_attended(load_spec("full").hooks_for(N, 50, 3, 3), 2, 3, N, 50) == 2 * 3 * N * 50
    big = 4096  # chunked: 2^20 elements per chunk, 16 chunks
    assert count_attended(causal, 1, 1, big, big, chunk_elems=1 << 20) == big * (big + 1) // 2


def brute_force_count(hooks, Bn, Hq, Nq, Nk):
    """One mask_mod call per (b, h, q, kv) with scalar tensors: no broadcasting involved."""
    if hooks.mask_mod is None:
        return Bn * Hq * Nq * Nk
    t = torch.tensor
    return sum(bool(hooks.mask_mod(t(b), t(h), t(i), t(j)))
               for b, h, i, j in itertools.product(range(Bn), range(Hq), range(Nk - Nq, Nk), range(Nk)))


# At N <= 11 even SMALL's params are no-ops: shrink further for the brute-force count.
TINY = {"global_sliding_window": {"window": 3, "global_tokens": 2},
        "causal_blockwise": {"block": 4}, "share_question": {"question": 2}}


@pytest.mark.parametrize("name,params", [(n, {}) for n in NAMES] + list(TINY.items()),
                         ids=NAMES + [f"{n}-tiny" for n in TINY])
@pytest.mark.parametrize("Nq,Nk", [(9, 9), (5, 11), (1, 11)])
def test_count_matches_brute_force(name, params, Nq, Nk):
    hooks = load_spec(name).hooks_for(Nq, Nk, 2, 1, **params)
    expected = brute_force_count(hooks, 1, 2, Nq, Nk)
    assert count_attended(hooks, 1, 2, Nq, Nk) == expected
    assert count_attended(hooks, 1, 2, Nq, Nk, chunk_elems=1) == expected


def test_count_head_dependent_mask():
    hooks = Hooks(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (kv_idx % 3 != h + b))
    expected = brute_force_count(hooks, 2, 3, 8, 10)
    assert count_attended(hooks, 2, 3, 8, 10, chunk_elems=50) == expected


# ---- errors a user sees ----------------------------------------------------------------------

def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_spec_raising_on_import(tmp_path):
    path = write(tmp_path, "broken.py", 'import torch\nPARAMS = {}\nscale = 1 / 0\n')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert "broken.py:3" in text and "ZeroDivisionError" in text and "scale = 1 / 0" in text
    path = write(tmp_path, "syntax.py", "def reference(q, k, v)\n    return q\n")
    with pytest.raises(SpecError, match=r"syntax.py:1.*SyntaxError"):
        load_spec(path)


def test_spec_without_reference(tmp_path):
    path = write(tmp_path, "noref.py",
                 "def mask_mod(b, h, q_idx, kv_idx):\n    return kv_idx <= q_idx\n")
    with pytest.raises(SpecError, match=r"noref.py: the spec has no reference\(\)") as info:
        load_spec(path)
    assert "def reference(q, k, v, **params)" in str(info.value)
    path = write(tmp_path, "notcallable.py", "reference = 3\n")
    with pytest.raises(SpecError, match=r"notcallable.py.*not a function"):
        load_spec(path)


def test_missing_path_and_unknown_name(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "nothere.py")
    assert "nothere.py" in str(info.value) and "prefixlm" in str(info.value)
    with pytest.raises(SpecError, match="did you mean 'prefixlm'"):
        load_spec("prefixllm")


def test_hooks_factory_returning_wrong_type(tmp_path):
    path = write(tmp_path, "badhooks.py", "def reference(q, k, v):\n    return q\n"
                                          "def hooks(Nq, Nk, Hq, Hkv, device):\n    return {}\n")
    spec = load_spec(path)
    with pytest.raises(SpecError) as info:
        spec.hooks_for(8, 8, 1, 1)
    text = str(info.value)
    assert "badhooks.py:3" in text and "not a Hooks" in text and "Hooks(mask_mod=" in text


def test_unknown_param():
    spec = load_spec("global_sliding_window")
    for call in (lambda: spec.hooks_for(8, 8, 1, 1, windw=3), lambda: spec.resolved_params(windw=3),
                 lambda: spec.run_reference(*make_inputs(2, 2, HQ, seed=0), windw=3)):
        with pytest.raises(SpecError) as info:
            call()
        text = str(info.value)
        assert "global_sliding_window.py" in text and "windw" in text
        assert "window (default 256)" in text
    assert spec.resolved_params(window=8) == {"window": 8, "global_tokens": 64}


def test_mask_mod_with_wrong_arity(tmp_path):
    path = write(tmp_path, "arity.py", "def reference(q, k, v):\n    return q\n"
                                       "def mask_mod(q_idx, kv_idx):\n    return kv_idx <= q_idx\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert "arity.py:3" in str(info.value) and "mask_mod(b, h, q_idx, kv_idx)" in str(info.value)


def test_unknown_normalization_kind(tmp_path):
    path = write(tmp_path, "softplus.py",
                 "from cubridge.spec import Hooks, Normalization\n"
                 "def reference(q, k, v):\n    return q\n"
                 "def hooks(Nq, Nk, Hq, Hkv, device):\n"
                 "    return Hooks(normalization=Normalization('softplus'))\n")
    with pytest.raises(SpecError) as info:
        load_spec(path).hooks_for(4, 4, 1, 1)
    text = str(info.value)
    assert "softplus.py:5" in text and "'softplus'" in text and "sigmoid" in text
    with pytest.raises(SpecError, match="bias is for 'sigmoid' only"):
        Normalization("softmax", bias=1.0)


def test_params_must_reach_reference(tmp_path):
    path = write(tmp_path, "noparam.py",
                 "PARAMS = {'window': 4}\ndef reference(q, k, v):\n    return q\n")
    with pytest.raises(SpecError, match=r"noparam.py:2.*window"):
        load_spec(path)


def test_reference_only_spec(tmp_path):
    path = write(tmp_path, "plain.py",
                 '"""Reference only."""\ndef reference(q, k, v):\n    return q\n')
    spec = load_spec(path)
    assert not spec.has_hooks and not spec.flex_expressible
    assert "reference only" in repr(spec)
    with pytest.raises(SpecError, match=r"plain.py: .*only reference\(\)") as info:
        spec.hooks_for(4, 4, 1, 1)
    assert "LLM proposer" in str(info.value)


def test_gqa_heads_checked():
    with pytest.raises(SpecError, match="Hq=4 is not a multiple of Hkv=3"):
        load_spec("causal").hooks_for(4, 4, 4, 3)
