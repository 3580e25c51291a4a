"""The OpenAI-compatible proposer against a real HTTP server process on 127.0.0.1 that replays
scripted completions (tests/support/scripted_openai_server.py): every candidate ends in the right
state, nothing raises out of ask() / tell(), repairs carry the error, and everything is logged."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from cubridge.errors import CubridgeError
from cubridge.vocab import TrialState
from cubridge.registry import available, make_proposer
from cubridge.search.screen import ScreenContext, screen
from cubridge.transfer.proposer import RulesProposer
from cubridge.verify import Case

SUPPORT = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(SUPPORT))
from scripted import ScriptedServer, closed_port, completion, envelope, inline_scalars  # noqa: E402

S = TrialState
# Small shapes keep each interpreter run well under a second; still ragged, GQA and MHA.
CASES = [Case(1, 2, 1, 70, 70, 32, 0), Case(1, 4, 4, 33, 50, 32, 1)]


def _ctx(spec: str) -> ScreenContext:
    return dataclasses.replace(ScreenContext.build("fa2_sm80", spec), cases=CASES)


@pytest.fixture(scope="module")
def ctx():
    return _ctx("causal")


@pytest.fixture(scope="module")
def good(ctx):
    """The rules proposer's transfer of causal: a valid candidate, as an LLM would write it."""
    [p] = RulesProposer(ctx).ask(1)
    return p.text


MUTATIONS = {   # name: (edit of the valid text, expected state, words of the reason)
    "syntax": (lambda t: t.replace("with role('compute', warps=WARPS):", "with role('compute', warps=WARPS)"),
               S.REJECTED_PARSE, "syntax error"),
    "import": (lambda t: "import os\n" + t, S.REJECTED_PARSE, "forbidden construct: Import"),
    "attribute": (lambda t: t.replace("s = s * sm_scale", "s = s.mul(sm_scale)"), S.REJECTED_PARSE, "method call"),
    "check": (lambda t: t.replace("row_max(s))", "row_max(s2))"), S.REJECTED_CHECK, "'s2' is not defined"),
    "structure": (lambda t: t.replace("wait_group(STAGES - 2)", "wait_group(0)"), S.REJECTED_STRUCTURE,
                  "outside the regions the taxonomy lets a transfer rewrite"),
    "mask_flipped": (lambda t: t.replace("ik <= iq", "ik > iq"), S.WRONG_ANSWER, "exceeds bound"),
}


def _options(tmp_path, base_url, **kw) -> dict:
    return {"base_url": base_url, "out_dir": str(tmp_path / "out"), "samples": 1, "max_retries": 0,
            "timeout_s": 20.0, "retries": 2, "backoff_s": 0.01, **kw}


def drive(proposer, ctx, n: int = 4, rounds: int = 6) -> list:
    """The tuner's side of ask / tell: screen every proposal on CPU and tell the outcome."""
    told = []
    for _ in range(rounds):
        props = proposer.ask(n)
        if not props:
            break
        for p in props:
            outcome = screen(p, ctx, proposer.binder(p))
            proposer.tell(p, outcome)
            told.append((p, outcome))
    return told


def _states(proposer) -> list:
    return [r.state for r in proposer.records]


def _events(proposer, kind: str) -> list:
    return [e for e in proposer.log.events() if e["event"] == kind]


# ------------------------------------------------------------------ accepted candidates
def test_registered_kinds():
    assert {"rules", "openai", "vllm"} <= set(available())


def test_valid_candidate_is_verified_and_request_is_explicit(tmp_path, ctx, good):
    with ScriptedServer(tmp_path, [{"choices": [completion(envelope(good))]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, temperature=0.3, seed=11, max_tokens=3000))
        told = drive(p, ctx)
        [body] = srv.requests()
        assert srv.requests("/v1/models")            # the model id was discovered
    [(prop, outcome)] = told
    assert outcome.state is S.VERIFIED and _states(p) == [S.VERIFIED]
    assert prop.origin == "openai" and prop.attempt == 0 and "model=scripted" in prop.notes
    assert (body["n"], body["temperature"], body["seed"], body["max_tokens"], body["top_p"]) == (1, 0.3, 11, 3000, 1.0)
    assert body["model"] == "scripted"
    schema = body["response_format"]["json_schema"]["schema"]
    assert body["response_format"]["type"] == "json_schema" and schema["required"] == ["cuir", "notes"]
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    user = body["messages"][1]["content"]
    assert "mask_predicate" in user and "def mask_mod" in user and "kernel('fa2_sm80'" in user
    assert "prefixlm" in user                          # the worked example


def test_fenced_block_without_json_is_read(tmp_path, ctx, good):
    answer = f"Here is the transferred program.\n```cuir\n{good}```\nIt adds causal skipping."
    with ScriptedServer(tmp_path, [{"choices": [completion(answer)]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, structured=False))
        told = drive(p, ctx)
        [body] = srv.requests()
    assert [o.state for _, o in told] == [S.VERIFIED]
    assert "response_format" not in body


def test_reference_only_spec_the_rules_cannot_trace(tmp_path, good):
    """The LLM's case: a spec with only reference(); the answer writes P = NK // 2 directly."""
    ctx = _ctx(str(SUPPORT / "specs" / "prefixlm_reference_only.py"))
    rules = RulesProposer(ctx)
    assert rules.ask(1) == [] and "only reference()" in rules.error
    prefixlm = RulesProposer(_ctx("prefixlm")).ask(1)[0].text
    answer = inline_scalars(prefixlm, {"C0": "NK // 2"})
    assert "scalar_input" not in answer
    with ScriptedServer(tmp_path, [{"choices": [completion(envelope(answer))]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url))
        told = drive(p, ctx)
        user = srv.requests()[0]["messages"][1]["content"]
    assert [o.state for _, o in told] == [S.VERIFIED]
    assert "kv_idx < k.shape[2] // 2" in user          # the spec's PyTorch source is in the prompt


def test_population_one_request_with_n_and_duplicates_dropped(tmp_path, ctx, good):
    wrong = MUTATIONS["mask_flipped"][0](good)
    choices = [completion(envelope(good)), completion(envelope(wrong)), completion(envelope(good, "again"))]
    with ScriptedServer(tmp_path, [{"choices": choices}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, samples=3))
        props = p.ask(3)
        [body] = srv.requests()
    assert body["n"] == 3 and len(props) == 2 and len({x.id for x in props}) == 2
    assert [e["event"] for e in p.log.events()].count("duplicate") == 1
    for x in props:
        p.tell(x, screen(x, ctx, p.binder(x)))
    assert sorted(s.value for s in _states(p)) == ["verified", "wrong_answer"]
    assert p.ask(3) == []                               # budget spent, no repairs allowed (max_retries 0)


# ------------------------------------------------------------------ rejected candidates
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_bad_candidates_end_in_their_state(tmp_path, ctx, good, name):
    edit, state, words = MUTATIONS[name]
    bad = edit(good)
    assert bad != good
    with ScriptedServer(tmp_path, [{"choices": [completion(envelope(bad))]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url))
        told = drive(p, ctx)
    assert [o.state for _, o in told] == [state] and _states(p) == [state]
    assert words in p.records[0].reason
    [rej] = _events(p, "rejected")
    assert rej["state"] == state.value and words in rej["reason"]
    [said] = _events(p, "completion")
    assert json.loads(said["text"])["cuir"] == bad   # what the model said is logged verbatim


def test_truncated_answer_is_rejected_unparsed(tmp_path, ctx, good):
    cut = envelope(good)[:700]
    with ScriptedServer(tmp_path, [{"choices": [completion(cut, "length")]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, max_tokens=200))
        assert p.ask(4) == []
    [rec] = p.records
    assert rec.state is S.REJECTED_PARSE and "cut off at max_tokens=200" in rec.reason


@pytest.mark.parametrize("answer, words", [
    ("I am sorry, I cannot help with that.", "no answer envelope found"),
    ('{"program": "kernel(1)"}', "no 'cuir' field"),
    ('{"cuir": 42, "notes": ""}', "not a string"),
])
def test_unreadable_answers(tmp_path, ctx, answer, words):
    with ScriptedServer(tmp_path, [{"choices": [completion(answer)]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url))
        assert p.ask(2) == []
    assert _states(p) == [S.REJECTED_PARSE] and words in p.records[0].reason


# ------------------------------------------------------------------ the endpoint failing
def test_body_that_is_not_json(tmp_path, ctx):
    with ScriptedServer(tmp_path, [{"raw": "<html><body>502 Bad Gateway</body></html>"}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, model="scripted"))
        assert p.ask(2) == []
    assert _states(p) == [S.PROPOSER_ERROR]
    assert "not JSON" in p.records[0].reason and "Bad Gateway" in p.records[0].reason
    assert _events(p, "backend_error")


def test_slow_response_times_out(tmp_path, ctx, good):
    with ScriptedServer(tmp_path, [{"delay_s": 4, "choices": [completion(envelope(good))]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, model="scripted", timeout_s=0.5))
        assert p.ask(2) == []
        assert len(srv.requests()) == 1                # not resent (the reason below: not waited out)
    assert _states(p) == [S.PROPOSER_ERROR] and "timed out after 0.5 s" in p.records[0].reason


def test_refused_connection_says_how_to_start_a_server(tmp_path, ctx):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    p = make_proposer("openai", ctx, _options(tmp_path, url, retries=2))
    for _ in range(3):                                 # nothing raises; the samples go back each time
        assert p.ask(4) == []
    assert p.sampler.exhausted and p.ask(4) == []      # until it gives up after 3 failures in a row
    assert len(p.records) == 3 and any(e["event"] == "give_up" for e in p.log.events())
    reason = p.records[0].reason
    assert p.records[0].state is S.PROPOSER_ERROR
    assert url in reason and "3 tries" in reason and "vllm serve" in reason
    assert "refused" in reason.lower()
    assert p.last_error == p.records[-1].reason


def test_server_coming_up_later_costs_no_samples(tmp_path, ctx, good):
    with ScriptedServer(tmp_path, [{"status": 503, "message": "loading"},
                                   {"choices": [completion(envelope(good))]}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, model="scripted", retries=0))
        assert p.ask(1) == []                          # 503, not resent (retries 0): sample given back
        told = drive(p, ctx)
    assert [o.state for _, o in told] == [S.VERIFIED] and _states(p) == [S.PROPOSER_ERROR, S.VERIFIED]


def test_server_errors_are_retried_with_backoff(tmp_path, ctx, good):
    script = [{"status": 503, "message": "loading"}, {"status": 429, "headers": {"Retry-After": "0"}},
              {"choices": [completion(envelope(good))]}]
    with ScriptedServer(tmp_path, script) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, model="scripted"))
        told = drive(p, ctx)
        assert len(srv.requests()) == 3
    assert [o.state for _, o in told] == [S.VERIFIED]


def test_client_error_is_not_retried(tmp_path, ctx):
    with ScriptedServer(tmp_path, [{"status": 400, "message": "maximum context length is 2048 tokens"}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, model="scripted"))
        assert p.ask(1) == []
        assert len(srv.requests()) == 1
    assert _states(p) == [S.PROPOSER_ERROR] and "HTTP 400" in p.records[0].reason
    assert "maximum context length" in p.records[0].reason


# ------------------------------------------------------------------ repairs
def test_wrong_answer_then_repaired(tmp_path, ctx, good):
    wrong = MUTATIONS["mask_flipped"][0](good)
    script = [{"choices": [completion(envelope(wrong))]}, {"choices": [completion(envelope(good))]}]
    with ScriptedServer(tmp_path, script) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, max_retries=2))
        told = drive(p, ctx)
        first, second = srv.requests()
    (p1, o1), (p2, o2) = told
    assert o1.state is S.WRONG_ANSWER and o2.state is S.VERIFIED
    assert (p2.attempt, p2.parent) == (1, p1.id)
    roles = [m["role"] for m in second["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert second["messages"][:2] == first["messages"]
    assert json.loads(second["messages"][2]["content"])["cuir"] == wrong     # the previous candidate
    assert o1.reason in second["messages"][3]["content"]                      # and its error
    assert "verification (wrong_answer)" in second["messages"][3]["content"]
    assert second["seed"] != first["seed"]
    assert [e["event"] for e in p.log.events() if e["event"] in ("rejected", "retry", "accepted")] == \
        ["rejected", "retry", "accepted"]


def test_repairs_are_bounded(tmp_path, ctx, good):
    wrong = MUTATIONS["mask_flipped"][0](good)
    script = [{"choices": [completion(envelope(wrong.replace("k0 = j * BLOCK_N", f"k0 = j * BLOCK_N + {i} * 0")))]}
              for i in range(4)]
    with ScriptedServer(tmp_path, script) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, max_retries=1))
        told = drive(p, ctx)
        assert len(srv.requests()) == 2                # one sample, one repair, then nothing
    assert [x.attempt for x, _ in told] == [0, 1]
    assert all(o.state.failed for _, o in told) and p.ask(4) == []


def test_unreadable_answer_is_repaired_too(tmp_path, ctx, good):
    script = [{"choices": [completion(envelope(good)[:500], "length")]}, {"choices": [completion(envelope(good))]}]
    with ScriptedServer(tmp_path, script) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, max_retries=1))
        told = drive(p, ctx)
        retry = srv.requests()[1]["messages"][-1]["content"]
    assert [o.state for _, o in told] == [S.VERIFIED]
    assert _states(p) == [S.REJECTED_PARSE, S.VERIFIED] and "cut off" in retry


# ------------------------------------------------------------------ configuration
def test_prompt_too_long_for_the_context_is_a_clear_error(tmp_path, ctx):
    with pytest.raises(CubridgeError, match=r"max_model_len=4000") as e:
        make_proposer("openai", ctx, _options(tmp_path, "http://127.0.0.1:1/v1", max_model_len=4000))
    assert "worked_example" in str(e.value)


def test_context_length_learned_from_the_server(tmp_path, ctx):
    with ScriptedServer(tmp_path, [], models=[{"id": "tiny", "max_model_len": 2048}]) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url))
        assert p.ask(1) == []
        assert srv.requests() == []                    # never sent
    assert _states(p) == [S.PROPOSER_ERROR] and "max_model_len=2048" in p.records[0].reason


def test_unknown_option_lists_the_allowed_ones(ctx):
    with pytest.raises(CubridgeError, match="temprature: unknown option") as e:
        make_proposer("openai", ctx, {"temprature": 0.5})
    assert "temperature" in str(e.value.hint)


def test_everything_is_logged_as_json_lines(tmp_path, ctx, good):
    wrong = MUTATIONS["mask_flipped"][0](good)
    script = [{"choices": [completion(envelope(wrong))]}, {"choices": [completion(envelope(good))]}]
    with ScriptedServer(tmp_path, script) as srv:
        p = make_proposer("openai", ctx, _options(tmp_path, srv.base_url, max_retries=1))
        drive(p, ctx)
    assert p.log.path == tmp_path / "out" / "llm-openai.jsonl"
    events = p.log.events()
    kinds = {e["event"] for e in events}
    assert {"start", "prompt", "completion", "candidate", "rejected", "retry", "accepted"} <= kinds
    prompts = [e for e in events if e["event"] == "prompt"]
    assert len(prompts) == 2 and prompts[1]["messages"][2]["role"] == "assistant"
