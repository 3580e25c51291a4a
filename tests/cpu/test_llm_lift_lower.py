"""Lift and lower through the scripted OpenAI-compatible server: the CPU checks of each candidate,
the injected acceptance callables (the GPU checks the tuner's runners perform; stand-ins here),
repairs fed with the acceptance errors, and patches confined to the marked regions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cubridge.cuir.parser import parse_file
from cubridge.errors import CubridgeError
from cubridge.llm.backend import Sampling
from cubridge.llm.engine import run_task
from cubridge.llm.lift import LiftTask
from cubridge.llm.lower import LowerCandidate, LowerTask, changed_regions, lower
from cubridge.llm.openai_http import OpenAIHTTPBackend
from cubridge.llm.regions import find_regions, region_text, strip_markers
from cubridge.paths import ref_kernel_dir
from cubridge.vocab import Outcome, TrialState
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer
from cubridge.verify import Case

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from scripted import ScriptedServer, completion, lifting_map  # noqa: E402

S = TrialState
REF = "fa2_sm80"
KERNEL_CU = (ref_kernel_dir(REF) / "kernel.cu").read_text()
KERNEL_CUIR = (ref_kernel_dir(REF) / "kernel.cuir").read_text()
CASES = [Case(1, 2, 1, 70, 70, 32, 0)]


class Acceptor:
    """Stands in for the runner's GPU check: answers the scripted outcomes in turn, records calls."""

    def __init__(self, *outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def __call__(self, candidate):
        self.calls.append(candidate)
        return self.outcomes.pop(0)


def _backend(srv) -> OpenAIHTTPBackend:
    return OpenAIHTTPBackend(srv.base_url, model="scripted", timeout_s=20, retries=0)


def _run(task, srv, accept, tmp_path, **kw):
    return run_task(task, _backend(srv), accept, out_dir=tmp_path / "out", samples=1, sampling=Sampling(seed=1),
                    batch=1, **kw)


# ------------------------------------------------------------------ lower
@pytest.fixture(scope="module")
def programs():
    ref = parse_file(ref_kernel_dir(REF) / "kernel.cuir")
    target = transfer(ref, load_spec("global_sliding_window")).program
    return ref, target


def test_changed_regions(programs):
    ref, target = programs
    assert changed_regions(ref, target) == ["kv_range", "mask"]
    assert changed_regions(ref, ref) == []


def test_lower_task_refuses_what_it_cannot_patch(programs):
    ref, target = programs
    with pytest.raises(CubridgeError, match="changes no region"):
        LowerTask(KERNEL_CU, ref, ref)
    with pytest.raises(CubridgeError, match="marks no region 'warp_tile'"):
        LowerTask(KERNEL_CU, ref, target, regions=["warp_tile"])


def test_lower_compile_error_then_accepted(tmp_path, programs):
    ref, target = programs
    first = "__device__ __forceinline__ bool mask_pred(int b, int h, int q_idx, int kv_idx) { return windw; }"
    second = ("// global tokens, or a causal window of WINDOW keys\n"
              "__device__ __forceinline__ bool mask_pred(int b, int h, int q_idx, int kv_idx) {\n"
              "  return (kv_idx <= q_idx && q_idx - kv_idx < 256) || kv_idx < 64 || q_idx < 64;\n}")
    fenced = f"Here you go:\n```cuda\n// @cuir-region mask\n{second}\n// @cuir-end mask\n```\n"
    script = [{"choices": [completion(json.dumps({"regions": {"mask": first}, "notes": "window"}))]},
              {"choices": [completion(fenced)]}]
    compile_log = 'kernel.cu(301): error: identifier "windw" is undefined'
    accept = Acceptor(Outcome(S.COMPILE_ERROR, compile_log), Outcome(S.OK, "checked on GPU"))
    with ScriptedServer(tmp_path, script) as srv:
        sol = lower(KERNEL_CU, ref, target, _backend(srv), accept, out_dir=tmp_path / "out", reference_name=REF,
                    samples=1, sampling=Sampling(seed=1), batch=1)
        first_req, second_req = srv.requests()
    assert sol.accepted and sol.outcome.state is S.OK
    assert [r.state for r in sol.records] == [S.COMPILE_ERROR, S.OK]
    assert isinstance(sol.candidate, LowerCandidate) and sol.candidate.patch == {"mask": second}
    assert region_text(sol.candidate.source, "mask") == second
    assert list(find_regions(sol.candidate.source)) == list(find_regions(KERNEL_CU))
    assert [type(c) for c in accept.calls] == [LowerCandidate, LowerCandidate]
    prompt = first_req["messages"][1]["content"]
    assert "### mask" in prompt and "### kv_range" in prompt and region_text(KERNEL_CU, "mask") in prompt
    assert "ik <= iq" in prompt or "iq" in prompt                    # the CuIR before / after
    assert first_req["response_format"]["json_schema"]["schema"]["required"] == ["regions", "notes"]
    retry = second_req["messages"][-1]["content"]
    assert compile_log in retry and "compiler (compile_error)" in retry
    events = [e["event"] for e in json.loads("[" + ",".join(sol.log_path.read_text().splitlines()) + "]")]
    assert events.count("completion") == 2 and "accepted" in events


@pytest.mark.parametrize("patch, words", [
    ({"qk": "int x;"}, "did not change in the CuIR"),
    ({"warp_tile": "int x;"}, "does not mark"),
    ({"mask": "int x;\n// @cuir-end mask\nint y;"}, "marker line"),
    ({}, "rewrites no region"),
])
def test_lower_patch_rejections_never_reach_the_gpu(tmp_path, programs, patch, words):
    ref, target = programs
    accept = Acceptor()
    script = [{"choices": [completion(json.dumps({"regions": patch, "notes": ""}))]}]
    with ScriptedServer(tmp_path, script) as srv:
        sol = _run(LowerTask(KERNEL_CU, ref, target), srv, accept, tmp_path, max_retries=0)
    assert not sol.accepted and accept.calls == []
    [rec] = sol.records
    assert rec.state is S.REJECTED_STRUCTURE and words in rec.reason


# ------------------------------------------------------------------ lift


def _lift_answer(cuir: str, ranges: dict) -> str:
    return json.dumps({"cuir": cuir, "regions": ranges, "notes": "lifted"})


def test_lift_map_error_gpu_mismatch_then_accepted(tmp_path):
    cuda = strip_markers(KERNEL_CU)
    ranges = lifting_map(KERNEL_CU)
    partial = {k: v for k, v in ranges.items() if k != "pv"}
    second = KERNEL_CUIR.replace("as CuIR.", "as CuIR (lifted).")
    script = [{"choices": [completion(_lift_answer(KERNEL_CUIR, partial))]},
              {"choices": [completion(_lift_answer(KERNEL_CUIR, ranges))]},
              {"choices": [completion(_lift_answer(second, ranges))]}]
    gpu_error = "GPU lift check: CUDA vs CuIR max err 3.1e-01 at B=2 Hq=4 N=4096"
    accept = Acceptor(Outcome(S.WRONG_ANSWER, gpu_error), Outcome(S.OK, "CUDA and CuIR agree"))
    task = LiftTask(cuda, name="my_fa2", spec="causal", cases=CASES)
    with ScriptedServer(tmp_path, script) as srv:
        sol = _run(task, srv, accept, tmp_path, max_retries=3)
        reqs = srv.requests()
    assert [r.state for r in sol.records] == [S.REJECTED_CHECK, S.WRONG_ANSWER, S.OK]
    assert "region 'pv' is used in the program but not in the lifting map" in sol.records[0].reason
    assert sol.accepted and sol.candidate.annotated == KERNEL_CU      # the markers come back where they were
    assert sol.candidate.regions == {k: tuple(v) for k, v in ranges.items()}
    assert len(accept.calls) == 2
    assert gpu_error in reqs[2]["messages"][-1]["content"]
    prompt = reqs[0]["messages"][1]["content"]
    assert "`my_fa2`" in prompt and "causal" in prompt and f"1| {cuda.splitlines()[0]}" in prompt
    assert "- mask: lines" in prompt                                   # the example's lifting map


def test_lift_verified_in_the_interpreter_before_the_gpu(tmp_path):
    """A lift that computes causal attention for a kernel said to compute full attention is caught on CPU."""
    accept = Acceptor()
    script = [{"choices": [completion(_lift_answer(KERNEL_CUIR, lifting_map(KERNEL_CU)))]}]
    with ScriptedServer(tmp_path, script) as srv:
        sol = _run(LiftTask(strip_markers(KERNEL_CU), spec="full", cases=CASES), srv, accept, tmp_path,
                   max_retries=0)
    assert not sol.accepted and accept.calls == []
    assert [r.state for r in sol.records] == [S.WRONG_ANSWER]


@pytest.mark.parametrize("edit, state, words", [
    (lambda c, r: (c.replace("kernel(", "import os\nkernel(", 1), r), S.REJECTED_PARSE, "Import"),
    (lambda c, r: (c, {**r, "mask": [r["score"][0], r["mask"][1]]}), S.REJECTED_CHECK, "overlaps"),
    (lambda c, r: (c, {**r, "mask": [1, 10 ** 6]}), S.REJECTED_CHECK, "not a range"),
    (lambda c, r: (c, {**r, "warp_tile": [1, 2]}), S.REJECTED_CHECK, "does not use"),
])
def test_lift_rejections(tmp_path, edit, state, words):
    cuir, ranges = edit(KERNEL_CUIR, lifting_map(KERNEL_CU))
    accept = Acceptor()
    with ScriptedServer(tmp_path, [{"choices": [completion(_lift_answer(cuir, ranges))]}]) as srv:
        sol = _run(LiftTask(strip_markers(KERNEL_CU)), srv, accept, tmp_path, max_retries=0)
    [rec] = sol.records
    assert rec.state is state and words in rec.reason and accept.calls == []


def test_lift_with_the_server_down_stops_quietly(tmp_path):
    from scripted import closed_port
    backend = OpenAIHTTPBackend(f"http://127.0.0.1:{closed_port()}/v1", model="m", retries=0)
    sol = run_task(LiftTask(strip_markers(KERNEL_CU)), backend, Acceptor(), out_dir=tmp_path, samples=4)
    assert not sol.accepted and [r.state for r in sol.records] == [S.PROPOSER_ERROR]
