"""Verification as deep as the search (issue 20, item 1): mutants that the fixed small cases at the
default tile config let through are rejected by LSE comparison, by cases past several KV tiles
(verify.deep_cases) and by the interpreter check at each tuned config (jobs.verify_at_config)."""
from __future__ import annotations

from cubridge.cuir.parser import parse
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.verify import Case, deep_cases, verify_program

FA2 = (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text()
FA3 = (ref_kernel_dir("fa3_sm90") / "kernel.cuir").read_text()
CAUSAL = load_spec("causal")
LSE_STORE = "store(LSE[b, h, q0:q0 + BLOCK_M], where(l_i == 0.0, -inf, m_i + log(l_i)))"


def mutate(text, old, new):
    assert text.count(old) == 1, old
    return text.replace(old, new)


def failure(rep):
    bad = rep.first_failure
    return None if bad is None else (bad.error or bad.verdict.reason)


def test_lse_is_compared_as_an_output():
    small = [Case(1, 2, 1, 70, 70, 16, 0)]
    assert verify_program(parse(FA2), CAUSAL, cases=small).passed
    plus5 = mutate(FA2, LSE_STORE, LSE_STORE.replace("m_i + log(l_i)", "m_i + log(l_i) + 5.0"))
    assert "LSE: max err 5.000e+00 exceeds bound" in failure(verify_program(parse(plus5), CAUSAL, cases=small))
    neg_inf = mutate(FA2, LSE_STORE, LSE_STORE.replace("where(l_i == 0.0, -inf, m_i + log(l_i))", "m_i * 0.0 - inf"))
    assert "LSE: " in failure(verify_program(parse(neg_inf), CAUSAL, cases=small))


def test_deep_cases_follow_the_tile_config():
    cases = deep_cases({"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2}, D=32)
    long, mqa, tall = cases
    assert long.Nk > 2 * 2 * 128 and long.Nk % 128 and long.Hq != long.Hkv       # two ring turns, ragged, GQA
    assert mqa.Hkv == 1 and mqa.Nq < mqa.Nk and tall.Nq > tall.Nk
    assert deep_cases({"BLOCK_M": 64, "BLOCK_N": 32, "STAGES": 4})[0].Nk == 32 * 9 + 13


def test_barrier_parity_that_breaks_past_four_kv_tiles():
    # Right while it // STAGES < 2, i.e. for the first 2 * STAGES = 4 KV tiles; wrong from the fifth.
    text = mutate(FA3, "phase = it // STAGES % 2", "phase = min(it // STAGES, 1) % 2")
    assert verify_program(parse(text), CAUSAL, cases=[Case(1, 2, 1, 300, 300, 16, 0)]).passed   # 3 tiles
    rep = verify_program(parse(text), CAUSAL, cases=deep_cases(parse(FA3).params(), D=16)[:1])
    assert not rep.passed, rep.table()


def test_a_program_wrong_at_one_block_n_only_is_caught_at_that_config():
    from cubridge.search.jobs import verify_at_config
    qk = "s = mma(Qs, transpose(Ks[st]))"
    text = mutate(FA2, qk, qk + "\n                s = s * (1.5 if BLOCK_N == 32 else 1.0)")
    assert verify_program(parse(text), CAUSAL, cases=[Case(1, 2, 1, 130, 130, 16, 0)]).passed   # default BLOCK_N 64
    payload = {"reference": "fa2_sm80", "text": text, "candidate": "mutant", "origin": "test", "spec": "causal",
               "spec_params": {}}
    assert verify_at_config({**payload, "config": {"block_m": 128, "block_n": 64, "stages": 2, "warps": 4}}) is None
    outcome, _ = verify_at_config({**payload, "config": {"block_m": 64, "block_n": 32, "stages": 2, "warps": 4}})
    assert outcome.state.value == "wrong_answer" and "'BLOCK_N': 32" in outcome.reason, outcome.reason
    assert "exceeds bound" in outcome.reason
