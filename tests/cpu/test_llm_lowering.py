"""The tuner's LLM-lowering stage: a verified candidate the deterministic generators cannot lower
gets a patch from the LLM lower task, accepted only after a GPU check on a runner worker (here a
stand-in runner that plays the GPU worker and records what it was asked)."""
from __future__ import annotations


import pytest

from cubridge.config import load_config
from cubridge.cuir.parser import parse_file
from cubridge.cuir.printer import to_text
from cubridge.lower import LowerError, lower
from cubridge.paths import ref_kernel_dir
from cubridge.search import llm_lowering
from cubridge.vocab import JobResult, Outcome, Proposal, Runner, TrialState
from cubridge.search.messages import Candidate
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer


class GpuStandIn(Runner):
    """Answers `measure` jobs as a GPU worker would: OK for the patch it is told is good."""

    def __init__(self, good_source: str, gpus: int = 1):
        self.good, self.gpus, self.jobs, self._done = good_source, gpus, [], []

    def submit(self, jobs):
        for job in jobs:
            self.jobs.append(job)
            ok = job.payload.get("cuda_source") == self.good and job.payload["shapes"] == []
            out = Outcome(TrialState.OK, "3 GPU checks passed") if ok else \
                Outcome(TrialState.WRONG_ANSWER, "GPU check at B=2 N=300: max err exceeds bound")
            self._done.append(JobResult(job, out))

    def results(self, timeout_s=None):
        done, self._done = self._done, []
        return done

    @property
    def num_workers(self):
        return 1

    @property
    def num_gpus(self):
        return self.gpus


def _unlowerable_candidate() -> Candidate:
    """The causal rules transfer with its score region in a form the generator does not know (the
    same numbers, so it verifies)."""
    ref = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
    text = to_text(transfer(ref, load_spec("causal")).program)
    anchor = "                s = s * sm_scale\n"
    assert text.count(anchor) == 1
    text = text.replace(anchor, anchor + "                t = s\n                s = t\n")
    cand = Candidate(Proposal(text, "openai"), "fa3_sm90")
    with pytest.raises(LowerError):
        from cubridge.cuir.parser import parse
        lower(parse(text), "fa3_sm90")
    return cand


def _cfg(tmp_path, kind="openai"):
    path = tmp_path / "run.yaml"
    options = "{base_url: 'http://127.0.0.1:9/v1', model: m}" if kind == "openai" else "{}"
    path.write_text(f"spec: causal\nreference: fa3_sm90\narch: sm_90a\nshapes: {{model: llama2-7b, lengths: [1024]}}\n"
                    f"proposer: {{kind: {kind}, options: {options}}}\noutput: {tmp_path / 'out'}\n")
    return load_config(path)


def test_patch_is_accepted_only_after_the_gpu_check(tmp_path, monkeypatch):
    cand = _unlowerable_candidate()
    kernel = (ref_kernel_dir("fa3_sm90") / "kernel.cu").read_text()
    bad, good = kernel + "\n// a patch that fails on the GPU\n", kernel + "\n// a patch that passes\n"
    runner = GpuStandIn(good)
    tried = []

    def fake_llm_lower(kernel_cu, reference, target, backend, accept, *, out_dir, reference_name):
        from cubridge.llm.engine import Solution
        from cubridge.llm.lower import LowerCandidate
        for src in (bad, good):                       # a wrong patch first, then a right one
            c = LowerCandidate(src, {})
            outcome = accept(c)
            tried.append(outcome.state)
            if outcome.state == TrialState.OK:
                return Solution(c, outcome, tried, None)
        return Solution(None, None, tried, None)

    monkeypatch.setattr("cubridge.llm.lower.lower", fake_llm_lower)
    out, said = tmp_path / "out", []
    overrides = llm_lowering.lowering_overrides(_cfg(tmp_path), [cand], runner, out, said.append, backend=object())
    assert tried == [TrialState.WRONG_ANSWER, TrialState.OK]
    assert overrides == {cand.id: good}
    assert (out / "lowered" / f"{cand.id}.cu").read_text() == good
    job = runner.jobs[-1]
    assert job.kind == "measure" and job.needs_gpu and job.payload["shapes"] == []
    assert job.payload["config"] is not None and job.payload["candidate"] == cand.id
    # a resumed run reuses the accepted patch without asking again
    again = llm_lowering.lowering_overrides(_cfg(tmp_path), [cand], GpuStandIn(good), out, said.append,
                                            backend=object())
    assert again == {cand.id: good} and len(tried) == 2


def test_without_a_gpu_nothing_is_accepted(tmp_path):
    said = []
    overrides = llm_lowering.lowering_overrides(_cfg(tmp_path), [_unlowerable_candidate()], GpuStandIn("", gpus=0),
                                                tmp_path / "out", said.append, backend=object())
    assert overrides == {} and any("need an LLM lowering" in s and "no GPU" in s for s in said), said


def test_rules_runs_say_an_llm_could_patch_it(tmp_path):
    said = []
    overrides = llm_lowering.lowering_overrides(_cfg(tmp_path, "rules"), [_unlowerable_candidate()], GpuStandIn(""),
                                                tmp_path / "out", said.append)
    assert overrides == {} and any("LLM proposer could patch" in s for s in said)


def test_an_accepted_patch_replaces_the_lowering_in_jobs(tmp_path):
    from cubridge.search.building import lower_kernel
    from cubridge.search.messages import payload
    from dataclasses import replace
    cand = replace(_unlowerable_candidate(), cuda_source="// patched kernel\n")
    cfg = _cfg(tmp_path)
    from cubridge.search.space import SPACES
    point = SPACES["fa3_sm90"].best_known(128)[0]
    p = payload(cfg, cand, point)
    assert p["cuda_source"] == "// patched kernel\n"
    from cubridge.search.messages import KernelJob
    lowered, options = lower_kernel(KernelJob.from_json(p))
    assert lowered.source == "// patched kernel\n" and any(o.startswith("-DBLOCK_M=") for o in options)
