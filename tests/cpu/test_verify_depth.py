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


def kernel_job_of(text, reference, spec):
    from cubridge.search.messages import KernelJob
    return KernelJob(candidate="mutant", reference=reference, origin="test", text=text, spec=spec, spec_params={},
                     head_dim=64, heads_q=2, heads_kv=1, dtype="bf16", arch="sm_80")


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
    assert mqa.Hkv == 1 and mqa.Nq < mqa.Nk and 2 * 128 < tall.Nq < tall.Nk and (tall.Nk - tall.Nq) % 128
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
    from dataclasses import replace
    job = kernel_job_of(text, "fa2_sm80", "causal")
    assert verify_at_config(replace(job, config={"block_m": 128, "block_n": 64, "stages": 2, "warps": 4})) is None
    outcome, _ = verify_at_config(replace(job, config={"block_m": 64, "block_n": 32, "stages": 2, "warps": 4}))
    assert outcome.state.value == "wrong_answer" and "'BLOCK_N': 32" in outcome.reason, outcome.reason
    assert "exceeds bound" in outcome.reason


LATE_LIE = '''\
"""Causal in its hooks; its reference also hides keys 1000.. from rows past 1000 (a late disagreement)."""
import math
import torch
PARAMS = {}
def mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx
def reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    mask = (j <= i) & ~((i > 1000) & (j >= 1000) & (j < i))
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
'''


def test_every_builtin_spec_agrees_with_its_hooks_at_a_long_length():
    from cubridge.spec import builtin_specs
    from cubridge.verify import spec_mask_problem
    for name in builtin_specs():
        assert spec_mask_problem(load_spec(name), [1100], heads=(2, 1)) is None, name


def test_a_mask_that_disagrees_only_past_index_1000_is_caught(tmp_path):
    from cubridge.search.jobs import screen_job
    from cubridge.verify import spec_mask_problem
    path = tmp_path / "late_lie.py"
    path.write_text(LATE_LIE)
    spec = load_spec(str(path))
    small = [Case(1, 2, 1, 300, 300, 16, 0), Case(1, 2, 1, 77, 200, 16, 1)]
    assert verify_program(parse(FA2), spec, cases=small).passed          # what used to be all
    why = spec_mask_problem(spec, [512, 1100], heads=(2, 1))
    assert why.startswith("the spec's hooks (mask_mod / score_mod) disagree with its reference() at N=1100, "
                          "first at query row 1001"), why
    from dataclasses import replace
    from cubridge.search.messages import TargetShape
    job = replace(kernel_job_of(FA2, "fa2_sm80", str(path)), quick=True, shapes=(TargetShape("N=1100", 1, 1100),))
    outcome, _ = screen_job(job.to_json())
    assert outcome.state.value == "wrong_answer" and "query row 1001" in outcome.reason
