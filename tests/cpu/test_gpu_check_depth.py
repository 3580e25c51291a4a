"""The tuner's GPU check (search.measure.run_checks / gpu_check over search.gpu_cases.check_cases)
with stand-in kernels on CPU tensors: the rule and the cases, not the GPU, are under test. Each
stand-in is right at the three cases the first GPU check had (Nq == Nk, the targets' heads, N <=
1000) and wrong somewhere else; the check must find it (issue 20, Deliver 1)."""
from __future__ import annotations

import torch

from cubridge.search.gpu_cases import STRUCTURE_LENGTHS, check_cases, structure_length, tile_kinds
from cubridge.search.measure import gpu_check, run_checks
from cubridge.spec import load_spec
from cubridge.verify import lse_of

CAUSAL = load_spec("causal")
TILE = {"BLOCK_M": 64, "BLOCK_N": 32, "STAGES": 2}
D = 32


def kernel(spec, params=None, *, lse_shift=0.0, truncate_keys=False, tile_heads=False, no_lse=False):
    """A stand-in kernel call(q, k, v, out, lse=None) computing `spec` in float32, with one fault."""
    params = params or {}

    def call(q, k, v, out, lse=None):
        if truncate_keys:                       # queries start-aligned: the keys past Nq are dropped
            k, v = k[:, :, :q.shape[2]], v[:, :, :q.shape[2]]
        if tile_heads:                          # query head h reads KV head h % Hkv, not h // group
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        out.copy_(spec.run_reference(q.float(), k.float(), v.float(), **params).to(out.dtype))
        if no_lse:
            return None
        value = lse_of(spec, q.float(), k.float(), params) + lse_shift
        if lse is None:
            return out, value
        lse.copy_(value)
        return out, lse
    return call


def check(call, shape=(1, 4, 2, 77, D, 0), spec=CAUSAL):
    return gpu_check(call, spec, {}, shape, torch.bfloat16, device="cpu")


def run_all(call, hq, hkv, spec=CAUSAL, params=None, structure=None):
    checks: list = []
    failed = run_checks(lambda c: call, spec, params or {}, check_cases(hq, hkv, TILE, [], structure), D,
                        torch.bfloat16, checks, device="cpu")
    return failed, checks


def test_the_right_kernel_passes_every_case():
    failed, checks = run_all(kernel(CAUSAL), 4, 4)
    assert failed is None and len(checks) == 6 and {c["result"] for c in checks} == {"pass"}


def test_lse_is_compared_as_an_output():
    assert check(kernel(CAUSAL)) is None
    assert check(kernel(CAUSAL, lse_shift=5.0)).startswith("LSE: max err")
    assert check(kernel(CAUSAL, lse_shift=float("-inf"))).startswith("LSE: ")
    assert "LSE: 308 NaN/Inf" in check(kernel(CAUSAL, no_lse=True))    # the poisoned slot left as it was


def test_an_lse_never_written_is_caught_by_the_poison():
    def skips_a_row(q, k, v, out, lse=None):
        kernel(CAUSAL)(q, k, v, out, lse)
        lse[:, :, -1] = float("nan")           # what the poison looks like where a row was never written
        return out, lse
    assert "NaN/Inf" in check(skips_a_row)


def test_an_lse_returned_instead_of_the_slot_is_compared_too():
    def own_lse(q, k, v, out, lse=None):       # a kernel call that ignores the slot and allocates its own LSE
        return kernel(CAUSAL, lse_shift=1.0)(q, k, v, out)
    assert check(own_lse).startswith("LSE: ")


def test_a_kernel_wrong_only_with_fewer_queries_than_keys_is_rejected():
    call = kernel(CAUSAL, truncate_keys=True)
    assert check(call) is None                 # right at Nq == Nk, as the first three cases were
    failed, checks = run_all(call, 4, 4)
    assert failed is not None and checks[-1]["result"] != "pass"
    nq, nk = (int(checks[-1]["shape"].split(f"{x}=")[1].split()[0]) for x in ("Nq", "Nk"))
    assert nq < nk


def test_a_kernel_wrong_only_under_gqa_is_rejected_for_mha_targets():
    call = kernel(CAUSAL, tile_heads=True)
    assert check(call, (1, 4, 4, 77, D, 0)) is None and check(call, (1, 4, 1, 77, D, 0)) is None
    failed, checks = run_all(call, 4, 4)
    assert failed is not None and "Hq=4 Hkv=2" in checks[-1]["shape"]


def test_every_tile_config_gets_cases_past_its_kv_ring():
    from cubridge.runtime.kernels import reference_kernel
    for name in ("fa3_sm90", "fa2_sm80"):
        space = reference_kernel(name).space
        for point in space.points(128, reference_kernel(name).arch):
            cuir = space.to_cuir(point)
            cases = check_cases(32, 8, cuir, [])
            ring = 2 * cuir["BLOCK_N"] * cuir.get("STAGES", 2)
            assert max(c.Nk for c in cases) > ring, (name, point)
            assert any(c.Nq and c.Nq < c.Nk and c.Nq > cuir["BLOCK_M"] for c in cases), (name, point)
            assert {c.Hkv for c in cases} >= {1, 8}


SHORT = (261, 521, 1061)        # the structure lengths at CPU scale (the GPU tries 1k to 8k)


def test_the_structure_length_shows_a_window_past_its_width():
    spec, params = load_spec("tests/corpus/mistral_sliding_window.py"), {"window": 300}
    assert STRUCTURE_LENGTHS[-1] > 8192 and structure_length(CAUSAL, {}, TILE, 4, 4, "cpu", SHORT) == SHORT[0]
    n = structure_length(spec, params, TILE, 4, 4, "cpu", SHORT)
    assert n == SHORT[1] and n > 300
    assert (0, -1) in tile_kinds(spec, params, n, 64, 32, (2, 1))          # empty tiles below the diagonal
    assert (0, -1) not in tile_kinds(spec, params, SHORT[0], 64, 32, (2, 1))


def test_a_kernel_that_ignores_the_window_fails_at_the_structure_length():
    spec, params = load_spec("tests/corpus/mistral_sliding_window.py"), {"window": 1100}
    call = kernel(CAUSAL)                      # plain causal: equals the window below N = 1100
    structure = structure_length(spec, params, TILE, 2, 1, "cpu", (1061, 1301))
    assert structure == 1301
    failed, checks = run_all(call, 2, 1, spec, params, structure)
    assert failed is not None and f"Nk={structure}" in checks[-1]["shape"]
    assert all(c["result"] == "pass" for c in checks[:-1])   # every other case passed it
