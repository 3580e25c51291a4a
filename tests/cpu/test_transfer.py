"""Transfer (rules proposer): tracing, interval analysis, block tables, taxonomy, and all ten
variants verified in the interpreter on both reference programs."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from cubridge.cuir import nodes as N
from cubridge.cuir.parser import parse, parse_file
from cubridge.cuir.printer import expr, to_text
from cubridge.paths import ref_kernel_dir
from cubridge.spec import builtin_specs, load_spec
from cubridge.transfer.intervals import classify
from cubridge.transfer.rules import block_classes, transfer
from cubridge.transfer.taxonomy import StructureError, check_structure
from cubridge.transfer.trace import TraceError, trace_mask, trace_score
from cubridge.verify import Case, verify_transfer

REFS = ("fa2_sm80", "fa3_sm90")
# Smaller windows and blocks than the benchmark defaults, so that they bite at test sizes.
SMALL = {"global_sliding_window": {"window": 40, "global_tokens": 16}, "causal_blockwise": {"block": 48}}
CASES = [Case(2, 4, 2, 300, 300, 32, 0), Case(1, 4, 1, 77, 200, 32, 1), Case(1, 2, 2, 130, 301, 32, 2)]


@pytest.fixture(scope="module")
def refs():
    return {n: parse_file(ref_kernel_dir(n) / "kernel.cuir") for n in REFS}


# ------------------------------------------------------------------ tracing
def test_traces_every_builtin():
    expected = {"causal": "ik <= iq", "prefixlm": "(ik <= iq) | (ik < 50)",
                "causal_blockwise": "iq // 256 >= ik // 256"}
    for name in builtin_specs():
        h = load_spec(name).hooks_for(100, 100, 4, 2)
        if h.mask_mod is not None:
            t = trace_mask(h.mask_mod)
            if name in expected:
                assert expr(t.expr) == expected[name]
        if h.score_mod is not None:
            assert "s" in trace_score(h.score_mod).uses


def test_captured_tensors_become_inputs():
    h = load_spec("share_question").hooks_for(100, 100, 4, 2)
    t = trace_mask(h.mask_mod)
    assert set(t.captures) == {"SEGMENT"}
    h = load_spec("relative_pos").hooks_for(100, 100, 4, 2)
    assert set(trace_score(h.score_mod).captures) == {"SLOPES"}


def test_python_control_flow_is_an_error_with_the_line():
    def bad(b, h, q_idx, kv_idx):
        if kv_idx <= q_idx:          # data-dependent Python `if`
            return True
        return False

    with pytest.raises(TraceError) as e:
        trace_mask(bad)
    assert "control flow" in str(e.value) and "test_transfer.py:" in str(e.value)
    assert "torch.where" in str(e.value)


def test_unsupported_torch_function_is_named():
    def bad(score, b, h, q_idx, kv_idx):
        return torch.cosh(score)

    with pytest.raises(TraceError, match="cosh"):
        trace_score(bad)


# ------------------------------------------------------------------ interval analysis (soundness)
def _eval(e, env):
    if isinstance(e, N.Const):
        return e.value
    if isinstance(e, N.Name):
        return env[e.id]
    if isinstance(e, N.BinOp):
        a, b = _eval(e.left, env), _eval(e.right, env)
        return {"+": a + b, "-": a - b, "*": a * b, "//": a // b if b else 0, "%": a % b if b else 0,
                "&": a & b, "|": a | b}[e.op]
    if isinstance(e, N.Compare):
        a, b = _eval(e.left, env), _eval(e.right, env)
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[e.op]
    if isinstance(e, N.BoolOp):
        vals = [_eval(v, env) for v in e.values]
        return all(vals) if e.op == "and" else any(vals)
    if isinstance(e, N.UnaryOp):
        v = _eval(e.operand, env)
        return (not v) if e.op == "not" else -v
    if isinstance(e, N.Call) and e.op in ("min", "max"):
        return (min if e.op == "min" else max)(_eval(e.args[0], env), _eval(e.args[1], env))
    raise AssertionError(f"unexpected node {e}")


@pytest.mark.parametrize("name", ["causal", "prefixlm", "global_sliding_window", "causal_blockwise",
                                  "relative_pos", "composite", "share_question"])
def test_interval_classification_is_sound(name):
    spec = load_spec(name)
    N_ = 160
    params = SMALL.get(name, {})
    hooks = spec.hooks_for(N_, N_, 2, 2, **params)
    must, may = classify(trace_mask(hooks.mask_mod).expr)
    q = torch.arange(N_).view(-1, 1)
    kv = torch.arange(N_).view(1, -1)
    full = hooks.mask_mod(torch.tensor(0), torch.tensor(1), q, kv).expand(N_, N_)
    _assert_sound(must, may, full, random.Random(0), 300, h=1)


def _assert_sound(must, may, full, rng, tiles: int, h: int = 0):
    """On `tiles` random tiles of the [N, N] pair grid `full`: `must` only where every pair is
    attended, `may` false only where none is."""
    n = full.shape[0]
    for _ in range(tiles):
        q_lo, k_lo = rng.randrange(n), rng.randrange(n)
        q_hi, k_hi = rng.randrange(q_lo, n), rng.randrange(k_lo, n)
        env = {"q_lo": q_lo, "q_hi": q_hi, "k_lo": k_lo, "k_hi": k_hi, "b": 0, "h": h}
        tile = full[q_lo:q_hi + 1, k_lo:k_hi + 1]
        if _eval(must, env):
            assert bool(tile.all()), env
        if not _eval(may, env):
            assert not bool(tile.any()), env


@pytest.mark.parametrize("pred", [lambda b, h, q, kv: (q - kv).abs() <= 9,
                                  lambda b, h, q, kv: torch.abs(kv - q) < 17,
                                  lambda b, h, q, kv: ((q - kv).abs() <= 5) | (kv < 3)],
                         ids=["local_window", "torch_abs", "window_or_sinks"])
def test_abs_ranges_are_sound_and_skip_far_tiles(pred):
    """|q - kv| <= w (ModernBERT / Longformer local windows): tiles far from the diagonal are empty,
    tiles inside the band full, and the classification never contradicts the pairs."""
    must, may = classify(trace_mask(pred).expr)
    n = 96
    full = pred(0, 0, torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1))
    _assert_sound(must, may, full, random.Random(1), 400)
    far = {"q_lo": 64, "q_hi": 79, "k_lo": 16, "k_hi": 31, "b": 0, "h": 0}
    near = {"q_lo": 40, "q_hi": 41, "k_lo": 40, "k_hi": 41, "b": 0, "h": 0}
    assert not _eval(may, far) and _eval(must, near)      # the analysis now skips and unmasks tiles


def test_interval_analysis_is_exact_for_causal_tiles():
    must, may = classify(trace_mask(lambda b, h, q, kv: kv <= q).expr)
    assert (expr(must), expr(may)) == ("k_hi <= q_lo", "k_lo <= q_hi")


def test_block_classes_match_brute_force():
    hooks = load_spec("share_question").hooks_for(150, 150, 2, 2)
    cls = block_classes(hooks, 1, 2, 150, 150, 32, 16, per_bh=False)
    m = hooks.mask_mod(0, 0, torch.arange(150).view(-1, 1), torch.arange(150).view(1, -1))
    for i, j in itertools.product(range(cls.shape[0]), range(cls.shape[1])):
        t = m[i * 32:(i + 1) * 32, j * 16:(j + 1) * 16]
        want = 2 if bool(t.all()) else (1 if bool(t.any()) else 0)
        assert int(cls[i, j]) == want


# ------------------------------------------------------------------ taxonomy
def test_rules_candidates_keep_the_structure(refs):
    checked = 0
    for ref in refs.values():
        for name in builtin_specs():
            cand = transfer(ref, load_spec(name))
            assert check_structure(ref, cand.program) is None      # raises StructureError on a change
            checked += 1
    assert checked == len(refs) * len(builtin_specs())


def test_structural_change_outside_regions_is_rejected(refs):
    ref = refs["fa2_sm80"]
    text = to_text(ref)
    assert "wait_group(STAGES - 2)" in text
    bad = parse(text.replace("wait_group(STAGES - 2)", "wait_group(0)"), source="bad.cuir")
    with pytest.raises(StructureError) as e:
        check_structure(ref, bad)
    assert "bad.cuir:" in str(e.value) and "structure" in str(e.value)


def test_forbidden_op_inside_a_rewritable_region_is_rejected(refs):
    ref = refs["fa3_sm90"]
    text = to_text(ref)
    anchor = "\n                s = s * sm_scale\n"      # the score region, inside `if visit:`
    assert text.count(anchor) == 1
    bad = parse(text.replace(anchor, anchor + "                arrive(kv_empty[st])\n"), source="bad.cuir")
    with pytest.raises(StructureError, match="rule score_transform: op arrive"):
        check_structure(ref, bad)


# ------------------------------------------------------------------ end to end in the interpreter
@pytest.mark.parametrize("ref_name", REFS)
@pytest.mark.parametrize("name", builtin_specs())
def test_every_variant_verifies(refs, ref_name, name):
    report = verify_transfer(refs[ref_name], load_spec(name), cases=CASES, spec_params=SMALL.get(name))
    assert report.passed, report.table()


def test_hooks_that_disagree_with_the_reference_are_caught(refs, tmp_path):
    path = tmp_path / "liar.py"
    path.write_text(
        "import math, torch\n"
        "from cubridge.spec import Hooks\n"
        "def mask_mod(b, h, q_idx, kv_idx):\n"
        "    return kv_idx <= q_idx + 1          # off by one: not what reference computes\n"
        "def reference(q, k, v):\n"
        "    g = q.shape[1] // k.shape[1]\n"
        "    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)\n"
        "    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
        "    m = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()\n"
        "    return torch.softmax(s.masked_fill(~m, float('-inf')), -1) @ v\n")
    report = verify_transfer(refs["fa3_sm90"], load_spec(str(path)), cases=CASES[:2])
    assert not report.passed
    first = report.first_failure
    assert first.case == CASES[0] and "exceeds bound" in first.verdict.reason


def test_an_unknown_keyword_is_an_error_not_ignored(refs):
    with pytest.raises(TypeError, match="params"):
        transfer(refs["fa2_sm80"], load_spec("causal"), params={"BLOCK_M": 64})


def test_the_binding_travels_as_data(refs):
    """What a worker gets (Binding JSON) binds the same inputs as the driver's candidate."""
    import json

    from cubridge.transfer.rules import Binding, bind_inputs
    for name in ("prefixlm", "share_question", "relative_pos"):
        cand = transfer(refs["fa3_sm90"], load_spec(name))
        binding = Binding.from_json(json.loads(json.dumps(cand.binding.to_json())))
        shape = dict(Nq=300, Nk=300, Hq=4, Hkv=2, B=2, params={"BLOCK_M": 128, "BLOCK_N": 128})
        a, b = cand.bind(**shape), bind_inputs(binding, cand.spec, cand.spec_params, **shape)
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
