"""The softcap + sigmoid fusion (cubridge/lower/fusion.py): which score_mods it takes, and its error
bound checked numerically with the kernel's float32 operations emulated (fmaf rounded once)."""
import math

import numpy as np
import pytest

from cubridge.cuir.parser import parse
from cubridge.lower import fusion
from cubridge.lower.variant import VariantIR


def expr(text):
    return parse(f"x = {text}\n").body[0].value


@pytest.mark.parametrize("text, form", [
    ("50.0 * tanh(s / 50.0)", (50.0, 0.02)),
    ("tanh(s * 0.02) * 50.0", (50.0, 0.02)),
    ("(tanh(0.05 * s) * 60.0) / 2.0", (30.0, 0.05)),
    ("tanh(s)", (1.0, 1.0)),
    ("tanh(s / 50.0) + 1.0", None),
    ("50.0 * tanh(s * s)", None),
    ("50.0 * tanh(s / 50.0) + ik", None),
    ("-50.0 * tanh(s / 50.0)", None),
    ("50.0 * sigmoid(s / 50.0)", None),
])
def test_softcap_form(text, form):
    got = fusion.softcap_form(expr(text))
    if form is None:
        assert got is None
    else:
        assert got == pytest.approx(form)


def ir(score, norm="sigmoid"):
    return VariantIR(score=expr(score), norm=norm, norm_arg=expr("C1"))


def test_applies_to_composite_only_where_the_bound_leaves_room():
    f = fusion.softcap_sigmoid(ir("50.0 * tanh(s / 50.0)"))
    assert f is not None and f.amp == 50.0 and f.bias_max == pytest.approx(14.788, abs=1e-3)
    assert fusion.softcap_sigmoid(ir("50.0 * tanh(s / 50.0)", norm="softmax")) is None
    assert fusion.softcap_sigmoid(ir("50.0 * tanh(s / 50.0)", norm="relu")) is None
    assert fusion.softcap_sigmoid(ir("5.0 * tanh(s / 5.0)")) is None        # no bias would be covered
    assert fusion.softcap_sigmoid(ir("1000.0 * tanh(s / 1000.0)")) is None  # A * EPS / 4 > 2^-12
    assert fusion.softcap_sigmoid(VariantIR(score=None, norm="sigmoid", norm_arg=expr("C1"))) is None


def test_polynomial_is_increasing_and_its_quadratic_positive():
    a0, a1, a2 = fusion.COEFFS
    assert 9 * a1 * a1 < 20 * a0 * a2      # P'(u) = a0 + 3 a1 u^2 + 5 a2 u^4 > 0
    assert a1 * a1 < 4 * a0 * a2 and a0 > 0 and a2 > 0
    u = np.linspace(0.0, fusion.U, 200001)
    err = np.abs(u * (a0 + a1 * u * u + a2 * u ** 4) - np.tanh(u)).max()
    assert err <= 5.4e-6 < fusion.EPS


def _f32(x):
    return np.float32(x)


def _fmaf(a, b, c):
    with np.errstate(over="ignore", invalid="ignore"):
        return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def fused_p(x, scale, f, bias):
    """The kernel's fast path in float32, the final 0.5 tanh(h) + 0.5 exact (its tanh.approx is
    the same in both forms, so this isolates the fusion's own error)."""
    x = x.astype(np.float32)
    k = _f32(_f32(scale) * _f32(f.rate))
    k2 = _f32(k * k)
    c0, c1, c2 = (np.float32(c) for c in f.coeffs())
    c0, c1, c2 = _f32(c0 * k), _f32(c1 * _f32(k * k2)), _f32(c2 * _f32(_f32(k * k2) * k2))
    with np.errstate(over="ignore"):
        w = _f32(x * x)
    ones = np.ones_like(x)
    q = _fmaf(w, c2 * ones, c1 * ones)
    q = _fmaf(w, q, c0 * ones)
    with np.errstate(invalid="ignore"):
        h = _fmaf(x, q, np.float32(0.5 * bias) * ones)
    return 0.5 * np.tanh(h.astype(np.float64)) + 0.5


def exact_p(x, scale, f, bias):
    y = f.amp * np.tanh(x.astype(np.float64) * scale * f.rate)
    return 1.0 / (1.0 + np.exp(-(y + bias)))


@pytest.mark.parametrize("scale", [1 / math.sqrt(64), 1 / math.sqrt(128), 1.0])
def test_fused_p_within_tolerance_for_every_covered_bias(scale):
    f = fusion.softcap_sigmoid(ir("50.0 * tanh(s / 50.0)"))
    x = np.concatenate([np.linspace(-3000, 3000, 600001), np.geomspace(1e-6, 1e30, 2000),
                        -np.geomspace(1e-6, 1e30, 2000), [0.0]]).astype(np.float32)
    worst = 0.0
    for bias in np.linspace(-f.bias_max, f.bias_max, 41):
        worst = max(worst, np.abs(fused_p(x, scale, f, bias) - exact_p(x, scale, f, bias)).max())
    assert worst <= fusion.TOL
    # ... and the check can fail: well past the covered bias (where the kernel takes the tanh) it does
    past = f.bias_max + 15.0
    assert np.abs(fused_p(x, scale, f, past) - exact_p(x, scale, f, past)).max() > fusion.TOL


def test_masked_score_gives_exactly_zero_and_huge_scores_saturate():
    f = fusion.softcap_sigmoid(ir("50.0 * tanh(s / 50.0)"))
    x = np.array([-np.inf, -3e38, 3e38, np.inf], dtype=np.float32)
    assert list(fused_p(x, 0.125, f, -9.0)) == [0.0, 0.0, 1.0, 1.0]


def test_other_amplitudes_keep_the_bound():
    for amp in (20.0, 30.0, 120.0):
        f = fusion.softcap_sigmoid(ir(f"{amp} * tanh(s / {amp})"))
        assert f is not None
        x = np.linspace(-20 * amp, 20 * amp, 400001).astype(np.float32)
        for bias in (-f.bias_max, 0.0, f.bias_max):
            assert np.abs(fused_p(x, 0.0884, f, bias) - exact_p(x, 0.0884, f, bias)).max() <= fusion.TOL
