"""What the search's modules hand each other: the candidate, the job payload a worker reads, the
run's result, and the one way to run a batch of jobs to completion. The tuner, the finishing
pass (finish.py), LLM lowering and lift checks all build jobs here, so none imports another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cubridge.vocab import Job, Proposal


@dataclass(frozen=True)
class Candidate:
    proposal: Proposal
    reference: str
    cuda_source: str | None = None    # an accepted LLM lowering, when the generators have none

    @property
    def id(self) -> str:
        return self.proposal.id


@dataclass
class TuneResult:
    status: str                       # tuned | screened | no_gpu | nothing_verified | no_trial_ok
    message: str
    out: Path
    dispatch: list = field(default_factory=list)
    records: list = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if self.status in ("tuned", "screened") else 1



# ------------------------------------------------------------------ jobs
def payload(cfg: TuneConfig, cand: Candidate, point=None, **extra) -> dict:
    """The JSON payload of a screen / compile / measure job for `cand` at tile config `point`."""
    s = cfg.shapes
    if getattr(cand, "cuda_source", None) and "cuda_source" not in extra:
        extra["cuda_source"] = cand.cuda_source        # an accepted LLM lowering (llm_lowering.py)
    return {"candidate": cand.id, "reference": cand.reference, "origin": cand.proposal.origin,
            "text": cand.proposal.text, "spec": cfg.spec, "spec_params": cfg.spec_params, "head_dim": s.head_dim,
            "heads_q": s.heads_q, "heads_kv": s.heads_kv, "dtype": cfg.dtype, "arch": cfg.arch, "config": point,
            "cache_dir": str((cfg.output / "cache").resolve()),
            "shapes": [{"key": t.key, "batch": t.batch, "seqlen": t.seqlen, "query_len": t.nq} for t in s.targets],
            "spec_source": Path(cfg.spec).read_text() if Path(cfg.spec).is_file() else None, **extra}


def run_jobs(runner, jobs: list[Job]) -> dict:
    """Submit and wait for every job; results by candidate id."""
    runner.submit(jobs)
    done = {}
    while len(done) < len(jobs):
        for r in runner.results(timeout_s=5.0):
            done[r.job.payload["candidate"]] = r
    return done


def proposer_options(cfg, out) -> dict:
    """The proposer's options, with defaults that follow from the run: an LLM proposer logs into
    <output>/llm, and with the Ray runner the in-process vLLM engine runs in a Ray actor that
    holds its GPUs (so timing workers are not scheduled on them)."""
    options = dict(cfg.proposer.options)
    if cfg.proposer.kind in ("vllm", "openai"):
        options.setdefault("out_dir", str(Path(out) / "llm"))
    if cfg.proposer.kind == "vllm" and cfg.runner.kind == "ray":
        options.setdefault("ray_actor", True)
    return options
