"""CuIR interpreter: the reference programs verify against the built-in specs; runs are
deterministic across role schedules and lane vectorisation; faults are CuIRRuntimeError at the
statement's line (never wrong numbers); the counters are exact."""
from __future__ import annotations

import math

import pytest
import torch

from cubridge.analysis import analyze
from cubridge.cuir.interp import SCHEDULES, interpret
from cubridge.cuir.parser import parse
from cubridge.errors import CuIRRuntimeError
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.verify import Case, make_inputs, verify_program

FA2 = (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text()
FA3 = (ref_kernel_dir("fa3_sm90") / "kernel.cuir").read_text()
TEXTS = {"fa2": FA2, "fa3": FA3}
PROGS = {k: parse(v, source=f"{k}.cuir") for k, v in TEXTS.items()}
TILES = {"fa2": (128, 64), "fa3": (128, 128)}     # (BLOCK_M, BLOCK_N) defaults


# ------------------------------------------------------------------ text surgery helpers
def _one_line(text, snippet):
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if snippet in ln]
    assert len(hits) == 1, f"expected exactly one line with {snippet!r}"
    return lines, hits[0]


def mutate(text, old, new):
    assert text.count(old) == 1, f"expected exactly one {old!r} in the program"
    return text.replace(old, new)


def drop_line(text, snippet):
    lines, i = _one_line(text, snippet)
    del lines[i]
    return "".join(lines)


def drop_line_after(text, snippet, expect):
    """Delete the line right after the one containing snippet; it must contain expect."""
    lines, i = _one_line(text, snippet)
    assert expect in lines[i + 1], (expect, lines[i + 1])
    del lines[i + 1]
    return "".join(lines)


def line_of(text, snippet):
    return _one_line(text, snippet)[1] + 1


def inputs(case: Case, dtype=torch.bfloat16):
    q, k, v = make_inputs(case, dtype)
    return {"Q": q, "K": k, "V": v}


def run_fails(text, case, *, line, words, params=None, **kw):
    with pytest.raises(CuIRRuntimeError) as ei:
        interpret(parse(text, source="bad.cuir"), inputs(case), params=params, **kw)
    err = ei.value
    assert err.line == line, str(err)
    assert str(err).startswith(f"bad.cuir:{line}: ")
    for w in words:
        assert w in str(err), (w, str(err))
    return err


# ------------------------------------------------------------------ verification against the specs
CASES = [
    Case(1, 2, 2, 1, 1, 16, 0),          # MHA, a single token
    Case(1, 4, 2, 17, 17, 32, 1),        # GQA
    Case(2, 4, 1, 130, 130, 16, 2),      # MQA, ragged
    Case(1, 2, 1, 300, 300, 16, 3),      # several KV tiles, ring wraps around
    Case(1, 4, 2, 17, 300, 16, 4),       # Nq < Nk
    Case(1, 2, 2, 130, 300, 32, 5),      # Nq < Nk, queries end-aligned (Nq > Nk is refused)
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("causal, spec", [(1, "causal"), (0, "full")])
@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_reference_programs_verify(name, causal, spec, dtype):
    rep = verify_program(PROGS[name], load_spec(spec), params={"CAUSAL": causal}, cases=CASES, dtype=dtype)
    assert len(rep.results) == len(CASES)
    assert rep.passed, rep.table()
    assert all(r.verdict.max_err <= r.verdict.bound for r in rep.results)


@pytest.mark.parametrize("causal, wrong_spec", [(1, "full"), (0, "causal")])
@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_verification_is_not_vacuous(name, causal, wrong_spec):
    rep = verify_program(PROGS[name], load_spec(wrong_spec), params={"CAUSAL": causal},
                         cases=[Case(1, 2, 1, 130, 130, 16, 0)])
    assert not rep.passed
    assert "exceeds bound" in rep.first_failure.verdict.reason


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_lse_matches_reference(name, causal):
    case = Case(1, 4, 2, 130, 300, 16, 7)
    x = inputs(case)
    out = interpret(PROGS[name], x, params={"CAUSAL": causal}).outputs
    q, k = x["Q"].double(), x["K"].double().repeat_interleave(2, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(case.D)
    if causal:
        q_pos = torch.arange(case.Nq) + case.Nk - case.Nq      # queries aligned to the end of the keys
        s = s.masked_fill(torch.arange(case.Nk)[None, :] > q_pos[:, None], float("-inf"))
    assert out["LSE"].dtype == torch.float32 and out["O"].dtype == torch.bfloat16
    assert (out["LSE"].double() - torch.logsumexp(s, -1)).abs().max() < 1e-4


def test_programs_agree_with_each_other():
    # Same math, different schedules of work: the two programs give the same numbers here.
    x = inputs(Case(1, 2, 1, 130, 130, 16, 8))
    a = interpret(PROGS["fa2"], x).outputs["O"].float()
    b = interpret(PROGS["fa3"], x).outputs["O"].float()
    assert (a - b).abs().max() < 2e-2


# ------------------------------------------------------------------ determinism
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_schedules_and_vectorisation_are_bitwise_identical(name, causal):
    x = inputs(Case(2, 4, 2, 130, 300, 16, 9), torch.float16)
    runs = {(s, vec): interpret(PROGS[name], x, params={"CAUSAL": causal}, schedule=s, vectorise=vec).outputs
            for s in SCHEDULES for vec in (True, False)}
    assert set(SCHEDULES) == {"in_order", "reverse", "round_robin"}
    base = runs[("in_order", True)]
    assert set(base) == {"O", "LSE"}
    for key, out in runs.items():
        for n in base:
            assert torch.equal(out[n], base[n]), (key, n)


def test_inputs_are_not_modified_and_sequence_inputs_work():
    case = Case(1, 2, 1, 70, 70, 16, 10)
    x = inputs(case)
    before = {k: v.clone() for k, v in x.items()}
    a = interpret(PROGS["fa3"], x).outputs
    b = interpret(PROGS["fa3"], [x["Q"], x["K"], x["V"]]).outputs
    assert all(torch.equal(x[k], before[k]) for k in x)
    assert torch.equal(a["O"], b["O"])


def test_bad_schedule_and_unknown_param():
    x = inputs(Case(1, 1, 1, 8, 8, 16))
    with pytest.raises(ValueError):
        interpret(PROGS["fa2"], x, schedule="random")
    with pytest.raises(CuIRRuntimeError, match="unknown parameter"):
        interpret(PROGS["fa2"], x, params={"BLOCK_Q": 64})


def test_mixed_dtypes_rejected():
    x = inputs(Case(1, 1, 1, 8, 8, 16))
    x["K"] = x["K"].half()
    with pytest.raises(CuIRRuntimeError, match="disagree"):
        interpret(PROGS["fa2"], x)


# ------------------------------------------------------------------ runtime faults
FA3_QK = "s = mma_async(Qs[wg * ROWS:wg * ROWS + ROWS, :], transpose(Ks[st]))"


@pytest.mark.parametrize("schedule", ["in_order", "round_robin"])
def test_fa3_missing_empty_wait_overwrites_a_slot(schedule):
    # Three KV tiles through a two-slot ring: without the producer's empty-barrier wait it
    # refills slot 0 before the consumers have read it. The schedules where the producer runs
    # ahead show it; "reverse" makes it lag (the next test), and verification runs both.
    text = drop_line(drop_line(FA3, "wait(k_empty[st]"), "wait(v_empty[st]")
    err = run_fails(text, Case(1, 2, 1, 300, 300, 16), schedule=schedule, params={"CAUSAL": 0},
                    line=line_of(text, "wait(k_full[st], phase)"),
                    words=["k_full[0]", "overwritten", "missing empty-barrier wait"])
    assert "consumer[0]" in str(err) and "consumer[1]" in str(err)


def test_fa3_consumer_releasing_the_wrong_stage_hangs_when_the_producer_lags():
    # The consumer arrives on k_empty of the next stage: with the producer ahead every read is
    # still ordered (the program verified, fuzz_cuir.json of session 7), but a producer that lags
    # finds k_empty[1] a phase ahead of its parity wait and hangs (mbarrier parity cannot tell
    # phase 0 from phase 2). "reverse" gives way after each arrival, so the producer lags.
    text = mutate(FA3, "                arrive(k_empty[st])", "                arrive(k_empty[(st + 1) % STAGES])")
    err = run_fails(text, Case(1, 2, 1, 300, 300, 16), schedule="reverse", params={"CAUSAL": 0},
                    line=line_of(text, "wait(k_empty[st]"), words=["deadlock", "k_empty[1]"])
    assert f"the latest from line {line_of(text, 'arrive(k_empty[(st + 1)')}" in str(err)


def test_fa3_missing_empty_wait_is_harmless_when_the_ring_never_wraps():
    # Two KV tiles, two slots: no slot is refilled, the run is correct. The interpreter judges the
    # execution, the checker the text (it rejects the program; see test_cuir_check).
    text = drop_line(drop_line(FA3, "wait(k_empty[st]"), "wait(v_empty[st]")
    x = inputs(Case(1, 2, 1, 200, 200, 16))
    got = interpret(parse(text), x, params={"CAUSAL": 0}).outputs["O"]
    assert torch.equal(got, interpret(PROGS["fa3"], x, params={"CAUSAL": 0}).outputs["O"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fa3_missing_arrive_deadlocks(schedule):
    text = drop_line(FA3, "arrive(k_empty[st])")
    err = run_fails(text, Case(1, 2, 1, 300, 300, 16), schedule=schedule, params={"CAUSAL": 0},
                    line=line_of(text, "wait(k_empty[st]"), words=["deadlock", "k_empty[0]"])
    for role in ("producer[0]", "consumer[0]", "consumer[1]"):
        assert f"{role} at line" in str(err)
    assert "arrive" in err.hint


def test_fa3_barrier_count_too_large_deadlocks_with_current_state():
    text = mutate(FA3, "k_empty = mbarrier(count=CONSUMERS, n=STAGES)", "k_empty = mbarrier(count=3, n=STAGES)")
    err = run_fails(text, Case(1, 2, 1, 300, 300, 16), params={"CAUSAL": 0},
                    line=line_of(text, "wait(k_empty[st]"), words=["deadlock"])
    # The barrier state is reported as it is at the deadlock, after both consumers arrived.
    assert "k_empty[0] parity 0 (0 phases done, 2/3 arrivals" in str(err)


def test_fa3_missing_full_wait_reads_before_wait():
    text = drop_line(FA3, "wait(k_full[st], phase)")
    run_fails(text, Case(1, 2, 1, 130, 130, 16), line=line_of(text, FA3_QK),
              words=["reads Ks[0] before waiting on k_full[0]", "tma_load at line"])


GRID = "m_blk, h, b = grid(cdiv(NQ, BLOCK_M), HQ, B)"


@pytest.mark.parametrize("name, new, missing, first", [
    # Nq = 130, two heads, D = 16: the last query tile (rows 128, 129) or the last head is missing.
    ("fa2", "m_blk, h, b = grid(cdiv(NQ, BLOCK_M) - 1, HQ, B)", 2 * 2 * 16, [0, 0, 128, 0]),
    ("fa3", "m_blk, h, b = grid(cdiv(NQ, BLOCK_M) - 1, HQ, B)", 2 * 2 * 16, [0, 0, 128, 0]),
    ("fa3", "m_blk, h, b = grid(cdiv(NQ, BLOCK_M), HQ - 1, B)", 130 * 16, [0, 1, 0, 0]),
])
def test_grid_not_covering_output(name, new, missing, first):
    text = mutate(TEXTS[name], GRID, new)
    store = "store(O[b, h, q0:q0 + BLOCK_M, :]" if name == "fa2" else "store(O[b, h, r0:r0 + ROWS, :]"
    run_fails(text, Case(1, 2, 1, 130, 130, 16), line=line_of(text, store),
              words=[f"output O: {missing} of {2 * 130 * 16} elements never written, first at {first}",
                     "grid extent"])


def test_fa2_wait_group_too_weak():
    text = mutate(FA2, "wait_group(STAGES - 2)", "wait_group(STAGES - 1)")
    run_fails(text, Case(1, 2, 1, 130, 130, 16), line=line_of(text, "s = mma(Qs, transpose(Ks[st]))"),
              words=["read of Ks[0] before its cp.async",
                     f"(line {line_of(text, 'copy_async(Ks[t]')})", "wait_group(n)"])


def test_fa2_missing_wait_group():
    text = drop_line(FA2, "wait_group(STAGES - 2)")
    run_fails(text, Case(1, 1, 1, 70, 70, 16), line=line_of(text, "s = mma(Qs, transpose(Ks[st]))"),
              words=["before its cp.async"])


def test_mma_async_result_used_before_mma_wait():
    retire = ("                if it > 0:\n                    mma_wait(1)\n"
              "                else:\n                    mma_wait(0)\n")
    assert FA3.count(retire) == 1
    text = FA3.replace(retire, "")
    run_fails(text, Case(1, 2, 1, 130, 130, 16), line=line_of(text, "s = s * sm_scale"),
              words=["read of 's', the result of mma_async at line", "before an mma_wait", "mma_wait(0)"])


def test_mma_async_never_retired():
    # The last mma_async of the role is never waited on.
    # the drain after the loop: its P V is the last mma_async of the role
    drain = "    with region(\"pv\"):\n        if it > 0:\n            mma_wait(0)\n"
    assert FA3.count(drain) == 1
    text = FA3.replace(drain, "    with region(\"pv\"):\n        if it > 0:\n            sync()\n")
    with pytest.raises(CuIRRuntimeError) as ei:
        interpret(parse(text), inputs(Case(1, 2, 1, 130, 130, 16)), params={"CAUSAL": 0})
    # The next iteration's mma_wait(0) after S = Q K^T retires every pending mma_async, the
    # accumulator of the last tile included; the last one is then read, unretired, by the epilogue.
    assert ei.value.line == line_of(text, "out = acc / where(l_i == 0.0, 1.0, l_i)")
    assert "read of 'acc', the result of mma_async" in str(ei.value)


def test_verify_reports_faults_instead_of_raising():
    text = drop_line(FA2, "wait_group(STAGES - 2)")
    rep = verify_program(parse(text, source="bad.cuir"), load_spec("causal"), cases=[Case(1, 1, 1, 70, 70, 16)],
                         static_check=False)
    assert not rep.passed
    assert rep.first_failure.error.startswith(f"bad.cuir:{line_of(text, 's = mma(Qs, transpose(Ks[st]))')}: ")
    rep = verify_program(parse(text, source="bad.cuir"), load_spec("causal"), cases=[Case(1, 1, 1, 70, 70, 16)])
    assert rep.first_failure.error.startswith("static check: ")


# ------------------------------------------------------------------ counters
def _padded(n, tile):
    return math.ceil(n / tile) * tile


@pytest.mark.parametrize("name", ["fa2", "fa3"])
@pytest.mark.parametrize("B, Hq, Hkv, Nq, Nk, D", [(1, 1, 1, 256, 256, 16), (2, 3, 1, 130, 130, 32),
                                                  (1, 2, 2, 17, 300, 16)])
def test_non_causal_counters_are_exact(name, B, Hq, Hkv, Nq, Nk, D):
    BM, BN = TILES[name]
    case = Case(B, Hq, Hkv, Nq, Nk, D)
    c = interpret(PROGS[name], inputs(case), params={"CAUSAL": 0}).counters
    # S = Q K^T and O += P V over whole tiles: 2 * 2 * BM * BN * D per (query tile, KV tile).
    assert c.mma_flops == 4 * B * Hq * _padded(Nq, BM) * _padded(Nk, BN) * D
    blocks = B * Hq * math.ceil(Nq / BM)
    assert c.blocks == blocks
    assert c.kv_tiles == blocks * math.ceil(Nk / BN)
    assert c.masked_tiles == (blocks if Nk % BN else 0)          # only the ragged last tile is masked
    assert c.bytes["reg->gmem"] == B * Hq * Nq * (D * 2 + 4)      # O in 16 bits, LSE in f32, cropped
    assert c.bytes["gmem->smem"] == blocks * (BM * D * 2 + 2 * math.ceil(Nk / BN) * BN * D * 2)


def test_fa2_flops_at_256():
    c = interpret(PROGS["fa2"], inputs(Case(1, 1, 1, 256, 256, 32)), params={"CAUSAL": 0}).counters
    assert c.mma_flops == 4 * 256 * 256 * 32


@pytest.mark.parametrize("name", ["fa2", "fa3"])
@pytest.mark.parametrize("Nq, Nk", [(256, 256), (300, 300), (130, 300), (17, 300)])
def test_causal_visits_fewer_tiles(name, Nq, Nk):
    BM, BN = TILES[name]
    x = inputs(Case(1, 2, 1, Nq, Nk, 16))
    full = interpret(PROGS[name], x, params={"CAUSAL": 0}).counters
    causal = interpret(PROGS[name], x, params={"CAUSAL": 1}).counters
    # Query tile m (positions from m * BM + Nk - Nq on) sees keys [0, min(Nk, (m + 1) * BM + Nk - Nq)).
    per_head = sum(math.ceil(min(Nk, (m + 1) * BM + Nk - Nq) / BN) for m in range(math.ceil(Nq / BM)))
    assert causal.kv_tiles == 2 * per_head
    assert causal.mma_flops == 4 * BM * BN * 16 * causal.kv_tiles
    assert causal.kv_tiles <= full.kv_tiles and causal.mma_flops <= full.mma_flops
    if per_head < math.ceil(Nq / BM) * math.ceil(Nk / BN):
        assert causal.kv_tiles < full.kv_tiles


def test_analyze_reports_skipped_tiles():
    a = analyze(PROGS["fa2"], Case(1, 1, 1, 256, 256, 16), params={"CAUSAL": 1}, spec=load_spec("causal"))
    assert (a.kv_tiles_visited, a.kv_tiles_total, a.kv_tiles_skipped) == (6, 8, 2)
    assert a.useful_flops == 4 * 16 * (256 * 257 // 2)
    assert a.mma_flops == 4 * 128 * 64 * 16 * 6
    assert a.smem_bytes == 128 * 16 * 2 + 2 * 2 * 64 * 16 * 2
    assert "KV tiles skipped" in a.table()


def test_fa3_ping_pong_without_the_turn_pass_deadlocks():
    # Consumer c passes the GEMM turn to c + 1 after issuing; without the pass the other consumer
    # waits at its bar_sync forever, and the interpreter says where.
    passing = "            arrive(wg_turn[(wg + 1) % CONSUMERS])\n"
    assert FA3.count(passing) == 1
    text = FA3.replace(passing, "")
    # The error sits at the first stuck role (the producer, waiting for a slot the stuck
    # consumers never free); the consumers' bar_sync waits are named in it.
    err = run_fails(text, Case(1, 2, 1, 300, 300, 16), params={"CAUSAL": 0},
                    line=line_of(text, "wait(k_empty[st]"), words=["deadlock", "bar_sync", "wg_turn"])
    bar_line = line_of(text, "            bar_sync(wg_turn[wg])")
    assert f"consumer[0] at line {bar_line} waits on wg_turn" in str(err)


def test_bar_sync_releases_when_every_party_arrived():
    prog = parse(
        'kernel("pair")\n'
        "X = global_input(f32, [N])\n"
        "Y = global_output(f32, [N])\n"
        "i, = grid(1)\n"
        "turn = mbarrier(count=2)\n"
        'with role("a", warps=1):\n'
        "    bar_sync(turn)\n"
        "    store(Y[0:0 + 1], load(X[0:0 + 1]) * 2.0)\n"
        'with role("b", warps=1):\n'
        "    arrive(turn)\n"
        "    store(Y[1:1 + 1], load(X[1:1 + 1]) * 3.0)\n")
    x = torch.tensor([1.0, 2.0])
    for schedule in SCHEDULES:
        assert interpret(prog, {"X": x}, schedule=schedule).outputs["Y"].tolist() == [2.0, 6.0]
