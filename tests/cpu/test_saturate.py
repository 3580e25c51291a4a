"""Relative-distance saturation (cubridge/lower/saturate.py) and fa3_sm90's use of it: the bounds
of T5's clamped buckets, checked exhaustively against the spec's own float32 bucket code for every
distance up to 2^20 and, compiled with g++, against the generated score_mod itself; expressions
that do not saturate (linear biases, knife-edge boundaries) are left alone or bounded soundly."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cubridge.cuir.parser import parse, parse_file
from cubridge.lower import lower, regions
from cubridge.lower.saturate import D_MAX, constant_over, saturation
from cubridge.lower.variant import extract
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
# spec -> (lo, hi): T5's buckets reach their last value at |d| = 91 (bidirectional, 8 + 7) and at
# -113 (decoder: 16 + 15); the decoder's bucket is 0 for every d >= 0.
T5 = {"t5_encoder_bias": (-91, 91), "t5_decoder_bias": (-113, 0), "longt5_local": (-91, 91)}


def _e(text: str):
    return parse(f"x = {text}\n").body[0].value


def _score(name: str):
    spec = load_spec(str(CORPUS / f"{name}.py"))
    return extract(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program).score


@pytest.mark.parametrize("name", sorted(T5))
def test_t5_bounds(name):
    assert saturation(_score(name)) == T5[name]


@pytest.mark.parametrize("bidirectional, bounds", [(True, T5["t5_encoder_bias"]), (False, T5["t5_decoder_bias"])])
def test_t5_bounds_hold_for_every_distance_of_the_reference_bucket(bidirectional, bounds):
    """The spec's relative_position_bucket (float32 log path, as the reference runs it) at every d
    in [-2^20, 2^20]: one bucket past each bound, and the bounds are tight."""
    sys.path.insert(0, str(CORPUS))
    try:
        from _t5 import relative_position_bucket
    finally:
        sys.path.remove(str(CORPUS))
    d = torch.arange(-(1 << 20), (1 << 20) + 1)
    bucket = relative_position_bucket(d, bidirectional, 32, 128)
    at = {int(x): int(bucket[int(x) + (1 << 20)]) for x in (bounds[0], bounds[0] + 1, bounds[1], bounds[1] - 1)}
    lo, hi = bounds
    assert (bucket[d >= hi] == at[hi]).all() and (bucket[d <= lo] == at[lo]).all()
    assert at[lo + 1] != at[lo] and (hi == 0 or at[hi - 1] != at[hi])


def test_expressions_that_do_not_saturate():
    assert saturation(_e("s + (iq - ik) * 0.01")) is None                  # linear in d
    assert saturation(_e("s + ik * 0.5")) is None                           # reads kv alone
    assert saturation(_e("s * 2.0")) is None                                # no d at all
    assert saturation(_e("s + gather(T, minimum(abs(ik - iq) + iq, 7), h)")) is None


def test_one_sided_and_knife_edge_bounds():
    # clamped at 7 for d >= 7 only: the other side is +-D_MAX
    assert saturation(_e("s + gather(T, minimum(ik - iq, 7), h)")) == (-D_MAX, 7)
    # log2(|d| / 8) reaches 4 exactly at |d| = 128, where float32 may round either way: the bound is
    # left one step out (129), never guessed
    knife = _e("s + gather(T, minimum(cast(log(cast(abs(ik - iq), f32) / 8) / 0.6931471805599453, i32), 4), h)")
    assert saturation(knife) == (-129, 129)
    assert not constant_over(knife.right.args[1], 128, D_MAX)


HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#define __device__
#define __forceinline__ inline
using std::abs;
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __logf(float x) { return std::log(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
%(regions)s
int main() {
  float table[32 * 4];
  for (int i = 0; i < 32 * 4; ++i) table[i] = 0.37f * i - 11.f;
  VariantArgs va{table, 32, 4};
  long bad = 0;
  for (int q : {0, 700, 123456})
    for (int h = 0; h < 4; ++h) {
      const float lo = score_mod(va, 0.5f, 0.125f, 0, h, q, q + CUIR_SAT_LO);
      const float hi = score_mod(va, 0.5f, 0.125f, 0, h, q, q + CUIR_SAT_HI);
      for (int d = -(1 << 20); d <= (1 << 20); ++d) {
        const float x = score_mod(va, 0.5f, 0.125f, 0, h, q, q + d);
        if ((d <= CUIR_SAT_LO && x != lo) || (d >= CUIR_SAT_HI && x != hi)) {
          if (bad++ < 5) printf("d %%d: %%g\n", d, x);
        }
      }
    }
  printf(bad ? "bad %%ld\n" : "ok\n", bad);
  return bad ? 1 : 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (host C++ compiler)")
@pytest.mark.parametrize("name", ["t5_encoder_bias", "t5_decoder_bias"])
def test_generated_score_mod_is_constant_past_the_bounds(name, tmp_path):
    """The lowered score region (extra_io + score, with its CUIR_SAT defines) compiled for the host:
    score_mod at every d in [-2^20, 2^20] past a bound equals score_mod at the bound, bitwise."""
    spec = load_spec(str(CORPUS / f"{name}.py"))
    kernel = lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), spec).program, "fa3_sm90")
    lo, hi = T5[name]
    assert f"#define CUIR_SAT_LO ({lo})\n#define CUIR_SAT_HI ({hi})" in kernel.source
    text = "\n".join(regions.body(kernel.source, n) for n in ("extra_io", "score"))
    text = text.replace('asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;', "return std::tanh(x);")
    cpp, exe = tmp_path / "h.cpp", tmp_path / "h"
    cpp.write_text(HARNESS % {"regions": text})
    proc = subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:]


def test_variants_without_saturation_keep_one_score_path():
    for name in ("relative_pos", "composite", "causal"):
        kernel = lower(transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), load_spec(name)).program,
                       "fa3_sm90")
        assert "CUIR_SAT" not in regions.body(kernel.source, "score"), name
