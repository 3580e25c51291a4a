"""The tracer takes what real mod code uses (issue 19 item 1). Each traced expression is evaluated
by the CuIR interpreter's own expression evaluator and typed by the static checker, and compared
element by element with the mod run eagerly by torch, on index ranges that include negatives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cubridge.cuir import nodes as N
from cubridge.cuir.absval import DT, Glob, Scalar, Tile
from cubridge.cuir.checker import _Checker
from cubridge.cuir.interp import Interpreter
from cubridge.cuir.printer import expr
from cubridge.cuir.values import DType, GTensor
from cubridge.lower.cexpr import to_c
from cubridge.evalmod import vmapped
from cubridge.transfer.trace import TraceError, trace_mask, trace_score

Q, K = 24, 20
QI = torch.arange(Q).view(Q, 1) - 9            # negatives too: // and % of negatives as torch
KI = torch.arange(K).view(1, K) - 7
S = torch.linspace(-6.0, 6.0, Q * K).view(Q, K)
TABLE_I = torch.tensor([[3, -5, 7, 0, 11], [2, 9, -4, 6, 1]])
TABLE_B = torch.tensor([[True, False, True, True, False], [False, True, True, False, True]])
TABLE_F = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))


def _interp_eval(traced, b=1, h=1):
    it = Interpreter(N.Program([], source="<test>"), {}, None, "in_order", False)
    env = {"iq": QI, "ik": KI, "s": S, "b": b, "h": h, **{d: DType(d) for d in ("i32", "f32")}}
    for name, cap in traced.captures.items():
        t = cap.tensor
        env[name] = GTensor(name, "f32" if t.is_floating_point() else "i32",
                            t.to(torch.float32) if t.is_floating_point() else t.to(torch.int64), False, 0)
    return it.eval(traced.expr, env, None)


def _check_kind(traced):
    ck = _Checker(N.Program([], source="<test>"), {}, {}, None, "bf16")
    env = {"iq": Tile("i32", (Q, 1)), "ik": Tile("i32", (1, K)), "s": Tile("f32", (Q, K)),
           "b": Scalar("int", None), "h": Scalar("int", None), **{d: DT(d) for d in ("i32", "f32")}}
    for name, cap in traced.captures.items():
        env[name] = Glob(name, "f32" if cap.tensor.is_floating_point() else "i32", cap.tensor.dim(), False,
                         tuple(cap.tensor.shape))
    return ck.value(traced.expr, env, 0)


def _agree(mod, score=False, b=1, h=1):
    traced = (trace_score if score else trace_mask)(mod)
    got = _interp_eval(traced, b, h)
    bt, ht = torch.tensor(b), torch.tensor(h)
    want = mod(S, bt, ht, QI, KI) if score else mod(bt, ht, QI, KI)
    want = torch.as_tensor(want).expand(Q, K)
    got = torch.as_tensor(got).expand(Q, K)
    if want.dtype == torch.bool:
        assert torch.equal(got.bool(), want), expr(traced.expr)
    elif not want.is_floating_point():
        assert torch.equal(got.to(torch.int64), want.to(torch.int64)), expr(traced.expr)
    else:
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5), expr(traced.expr)
    kind = _check_kind(traced)
    want_dt = {torch.bool: "bool"}.get(want.dtype, "f32" if want.is_floating_point() else "i32")
    assert kind.dtype == want_dt, (expr(traced.expr), kind)
    return traced


# ------------------------------------------------------------------ masks
MASKS = {
    "floor_div_mod_negative": lambda b, h, q, k: (q // 4 == k // 4) | ((q - k) % 5 == 3),
    "abs_clamp_int": lambda b, h, q, k: torch.clamp((q - k).abs(), max=6) % 2 == 0,
    "clamp_min_max_methods": lambda b, h, q, k: (q - k).clamp_min(-3).clamp_max(4) == k % 3,
    "sign": lambda b, h, q, k: torch.sign(q - k) >= 0,
    "shift_const": lambda b, h, q, k: (q >> 2) == (k << 1) // 4,
    "shift_symbolic": lambda b, h, q, k: ((q.abs() >> (k.abs() % 4)) & 1) == 1,
    "bit_mask_xor": lambda b, h, q, k: ((q & 6) ^ (k | 1)) > 2,
    "invert_int": lambda b, h, q, k: ~q < k,
    "cast_truncates": lambda b, h, q, k: (q * 0.7).to(torch.long) == k,
    "cast_methods": lambda b, h, q, k: ((q - 0.5).long() + (k * 1.5).int()) > 0,
    "bool_arith": lambda b, h, q, k: ((q > 0).to(torch.int64) + (k > 0).long() * 2) == 3,
    "where_int": lambda b, h, q, k: torch.where(q > k, q - k, k - q) < 5,
    "where_int_const": lambda b, h, q, k: torch.where(q > 3, 2, -1) * k > 0,
    "where_bool": lambda b, h, q, k: torch.where(q > k, (q - k) < 4, k == q),
    "minimum_int": lambda b, h, q, k: torch.minimum(q, k) == torch.maximum(q - 3, k - 5),
    "div_trunc": lambda b, h, q, k: torch.div(q, 3, rounding_mode="trunc") == k // 3,
    "div_floor": lambda b, h, q, k: torch.div(q, 4, rounding_mode="floor") == k,
    "fmod": lambda b, h, q, k: torch.fmod(q, 4) == torch.remainder(k, 4) - 2,
    "floor_ceil_trunc": lambda b, h, q, k: torch.floor(q / 3) + torch.ceil(k / 3) > torch.trunc((q - k) / 2),
    "zeros_like_ones_like": lambda b, h, q, k: torch.zeros_like(q) + torch.ones_like(k) * 3 < q,
    "full_like_bool": lambda b, h, q, k: torch.full_like(q, True, dtype=torch.bool) & (q > k),
    "new_ones_new_zeros": lambda b, h, q, k: b.new_ones((), dtype=torch.bool) & ~b.new_zeros(()).bool() & (q < k),
    "logical_ops": lambda b, h, q, k: torch.logical_xor(q > 0, k > 0) | torch.logical_not(q != k),
    "captured_int_table_stepwise": lambda b, h, q, k: TABLE_I[b][k % 5] < q,
    "captured_bool_table_direct": lambda b, h, q, k: TABLE_B[b, q % 5],
    "captured_bool_table_stepwise": lambda b, h, q, k: TABLE_B[h][k.abs() % 5] & (q >= k),
    "table_indexed_by_where_and_clamp": lambda b, h, q, k: TABLE_I[b, torch.where(q > 0, q, 0).clamp(max=4)] > k,
    "table_indexed_by_cast": lambda b, h, q, k: TABLE_I[1, ((q.abs() * 0.5).long()).clamp(0, 4)] >= 3,
    "nested_gather": lambda b, h, q, k: TABLE_I[0, TABLE_I[1, k % 5] % 5] > q,
    "pow_square": lambda b, h, q, k: (q - k) ** 2 < 30,
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_traced_mask_agrees_with_torch(name):
    _agree(MASKS[name])


def test_flex_attention_combinators():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    causal = lambda b, h, q, k: q >= k          # noqa: E731
    window = lambda b, h, q, k: q - k <= 4      # noqa: E731
    prefix = lambda b, h, q, k: k < 3           # noqa: E731
    t = _agree(fa.and_masks(causal, window))
    assert expr(t.expr) == "(iq >= ik) & (iq - ik <= 4)"       # the bool seeds fold away
    t = _agree(fa.or_masks(prefix, causal))
    assert expr(t.expr) == "(ik < 3) | (iq >= ik)"
    assert expr(trace_mask(fa.noop_mask).expr) == "True"
    _agree(fa.and_masks(fa.or_masks(prefix, causal), fa.noop_mask))


# ------------------------------------------------------------------ score mods
SCORES = {
    "log_log1p_expm1": lambda s, b, h, q, k: torch.log(s.abs() + 1) + torch.log1p(s.abs()) - torch.expm1(s / 8),
    "gelu_exact": lambda s, b, h, q, k: F.gelu(s),
    "gelu_tanh": lambda s, b, h, q, k: F.gelu(s, approximate="tanh"),
    "silu_sigmoid_tanh": lambda s, b, h, q, k: F.silu(s) + torch.sigmoid(s) - torch.tanh(s / 2),
    "softplus_leaky": lambda s, b, h, q, k: F.softplus(s) + F.leaky_relu(s, 0.1),
    "relu_methods": lambda s, b, h, q, k: s.relu() + s.abs() * s.sign(),
    "floor_of_float": lambda s, b, h, q, k: torch.floor(s) + s.floor() * 0.5,
    "float_table_stepwise": lambda s, b, h, q, k: s + TABLE_F[h][(q - k).abs().clamp(max=4)],
    "int_to_float": lambda s, b, h, q, k: s + (q - k).float() / 3,
    "clamp_float": lambda s, b, h, q, k: s.clamp(min=-2.0, max=3.5),
    "softcap": lambda s, b, h, q, k: 30 * torch.tanh(s / 30),
}


@pytest.mark.parametrize("name", sorted(SCORES))
def test_traced_score_agrees_with_torch(name):
    _agree(SCORES[name], score=True)


def test_approximate_tanh_custom_op_is_traced_as_exact_and_says_so():
    ns = "cubridge_test_approx"
    if not hasattr(getattr(torch.ops, ns), "tanh"):
        @torch.library.custom_op(f"{ns}::tanh", mutates_args=())
        def _tanh(inp: torch.Tensor) -> torch.Tensor:
            return torch.tanh(inp)
    op = getattr(torch.ops, ns).tanh
    t = _agree(lambda s, b, h, q, k: 20 * op(s / 20), score=True)
    assert len(t.notes) == 1 and "traced as exact tanh" in t.notes[0] and "test_trace.py:" in t.notes[0]
    assert not trace_score(lambda s, b, h, q, k: torch.tanh(s)).notes


def test_t5_bucket_traces_with_integer_types():
    import math

    def bucket(rel, num_buckets=32, max_distance=128):
        out = 0
        num_buckets //= 2
        out += (rel > 0).to(torch.long) * num_buckets
        rel = torch.abs(rel)
        max_exact = num_buckets // 2
        is_small = rel < max_exact
        large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                             * (num_buckets - max_exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, num_buckets - 1))
        return out + torch.where(is_small, rel, large)

    t = trace_mask(lambda b, h, q, k: bucket(k - q) < 20)
    idx = trace_score(lambda s, b, h, q, k: s + TABLE_F[0, bucket(k - q) % 5])
    assert _check_kind(idx).dtype == "f32"
    assert "cast(" in expr(t.expr)
    # Under the cast to an integer the CUDA text uses the accurate log and IEEE division.
    c = to_c(t.expr, {"iq": ("q", "int"), "ik": ("k", "int")})
    assert "logf(" in c and "__logf" not in c and "__fdividef" not in c


def test_step_by_step_indexing_evaluates_eagerly_too():
    mod = MASKS["captured_bool_table_stepwise"]
    m = vmapped(mod, torch.arange(2), torch.arange(2), torch.arange(6), torch.arange(5))
    assert m.shape == (2, 2, 6, 5) and m[1, 0, 3, 2] == (TABLE_B[0][2] & (3 >= 2))


# ------------------------------------------------------------------ refusals: line, construct, nearest form
@pytest.mark.parametrize("mod, construct, hint", [
    (lambda s, b, h, q, k: torch.round(s), "torch function round", "torch.floor(x + 0.5)"),
    (lambda s, b, h, q, k: torch.cosh(s), "torch function cosh", "supported functions"),
    (lambda s, b, h, q, k: s.sigmod(), "'.sigmod'", "nearest supported: sigmoid"),
    (lambda s, b, h, q, k: s ** 3.5, "power x ** 3.5", "torch.exp(y * torch.log(x))"),
    (lambda s, b, h, q, k: s << 2, "shift '<<' of a float", ".long()"),
    (lambda s, b, h, q, k: s + TABLE_F[b], "2-D captured tensor used after 1 of its 2 indices", "table[b][h][q_idx]"),
    (lambda s, b, h, q, k: s + TABLE_F[0, s], "index 1 of a captured tensor is a float", "idx.long()"),
    (lambda s, b, h, q, k: s + TABLE_F[0, 1:3], "a (2,) tensor mixed with symbolic", "index captured tensors"),
    (lambda s, b, h, q, k: s + q.to(torch.uint8), "cast to torch.uint8", "torch.int32"),
    (lambda s, b, h, q, k: torch.max(s), "torch.max of one value", "torch.maximum"),
    (lambda s, b, h, q, k: s if q > k else -s, "Python control flow", "torch.where"),
])
def test_refusals_name_line_construct_and_nearest_form(mod, construct, hint):
    with pytest.raises(TraceError) as e:
        trace_score(mod)
    text = str(e.value)
    assert construct in text and hint in text and "test_trace.py:" in text, text


def test_mask_must_return_a_boolean():
    with pytest.raises(TraceError, match="mask_mod returned an int"):
        trace_mask(lambda b, h, q, k: q - k)


def test_grid_indexing_is_bounds_checked_on_the_host():
    """The grid call of mask_values / score_values runs index-checked on a GPU: an index past a
    table's size raises IndexError (then the vmapped fallback), never a CUDA device-side assert,
    which would poison the process (session 10 H100: ag_head_mask's `local[b][h]` at B=1, H=4)."""
    import pytest as _pytest

    from cubridge.evalmod import _IndexBoundsChecked, grids, mask_values
    local = torch.tensor([[True, False, True, False]] * 8)

    def head_mask(b, h, q, kv):
        return torch.where(local[b][h], q >= kv, q - kv <= 3)
    g = grids(1, 4, torch.arange(5), 6)
    with _pytest.raises(IndexError, match="size 1"), _IndexBoundsChecked():
        head_mask(*g)                       # local[b] is [1,1,1,1,4]: [h] indexes its size-1 dim
    with _IndexBoundsChecked():
        assert local[torch.tensor([7, -8])].shape == (2, 4)
        assert torch.index_select(local, 1, torch.tensor([0, 3])).shape == (8, 2)
        with _pytest.raises(IndexError, match="size 4"):
            torch.index_select(local, 1, torch.tensor([4]))
    m = mask_values(head_mask, *g)
    want = torch.stack([torch.where(local[0][h], torch.arange(5)[:, None] >= torch.arange(6),
                                    torch.arange(5)[:, None] - torch.arange(6) <= 3) for h in range(4)])
    assert torch.equal(m[0], want)
