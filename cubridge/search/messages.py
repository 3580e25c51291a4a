"""What the search's modules hand each other: the candidate, the job payload a worker reads, the
run's result, and the one way to run a batch of jobs to completion. The tuner, the finishing
pass (finish.py), LLM lowering and lift checks all build jobs here, so none imports another.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from cubridge.errors import CubridgeError
from cubridge.vocab import Job, Proposal

if TYPE_CHECKING:
    from cubridge.config import TuneConfig


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
    dispatch: list = field(default_factory=list)    # dispatch.json's buckets
    records: list = field(default_factory=list)     # TrialRecord, by number

    @property
    def exit_code(self) -> int:
        return 0 if self.status in ("tuned", "screened") else 1



# ------------------------------------------------------------------ jobs
@dataclass(frozen=True)
class TargetShape:
    key: str                          # "N=8192,B=2": the objective's and the dispatch table's name
    batch: int
    seqlen: int
    query_len: int | None = None      # Nq (<= seqlen, queries end-aligned); None: Nq = seqlen

    @property
    def nq(self) -> int:
        return self.seqlen if self.query_len is None else self.query_len

    def to_json(self) -> dict:
        return {"key": self.key, "batch": self.batch, "seqlen": self.seqlen, "query_len": self.query_len}


@dataclass(frozen=True)
class KernelJob:
    """Driver -> worker: one candidate of one run (screen), at one tile config (compile, measure).
    Its JSON (to_json) is the Job payload; a worker reads it back with from_json, which refuses a
    key it does not know (a driver and a worker of different checkouts)."""
    candidate: str                    # Proposal.id
    reference: str                    # reference kernel name
    origin: str                       # "rules", "vllm", ...
    text: str                         # the candidate's CuIR
    spec: str                         # spec name or file path (the worker rebuilds it from spec_source)
    spec_params: dict
    head_dim: int
    heads_q: int
    heads_kv: int
    dtype: str                        # "bf16" | "fp16"
    arch: str                         # compile target, e.g. "sm_90a"
    shapes: tuple = ()                # TargetShape: where a measure job times
    config: dict | None = None        # the tile config (a point of the kernel's space)
    spec_source: str | None = None
    binding: dict | None = None       # transfer.rules.Binding JSON; None: no extra inputs
    cuda_source: str | None = None    # an accepted LLM lowering, used instead of the generator's
    trial: int | None = None          # the Optuna trial a measure job answers
    quick: bool = False               # screen with the quick case set

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["shapes"] = [t.to_json() for t in self.shapes]
        return d

    @staticmethod
    def from_json(d: dict, extra: tuple[str, ...] = ()) -> "KernelJob":
        """The job of a payload; `extra` names keys a wrapping job (bench, race) adds."""
        names = {f.name for f in fields(KernelJob)}
        unknown = sorted(set(d) - names - set(extra))
        if unknown:
            raise CubridgeError(f"job payload has unknown keys {unknown}", where="search job",
                                hint="driver and workers must run the same cubridge checkout")
        known = {k: v for k, v in d.items() if k in names}
        known["shapes"] = tuple(TargetShape(**t) for t in d.get("shapes") or ())
        return KernelJob(**known)


def kernel_job(cfg: TuneConfig, cand: Candidate, point=None, **changes) -> KernelJob:
    """The job of `cand` in the run `cfg` at tile config `point` (None: not at a config yet)."""
    s = cfg.shapes
    spec_file = Path(cfg.spec)
    job = KernelJob(candidate=cand.id, reference=cand.reference, origin=cand.proposal.origin,
                    text=cand.proposal.text, spec=cfg.spec, spec_params=dict(cfg.spec_params),
                    head_dim=s.head_dim, heads_q=s.heads_q, heads_kv=s.heads_kv, dtype=cfg.dtype, arch=cfg.arch,
                    shapes=tuple(TargetShape(t.key, t.batch, t.seqlen, t.query_len) for t in s.targets), config=point,
                    spec_source=spec_file.read_text() if spec_file.is_file() else None,
                    binding=cand.proposal.binding, cuda_source=cand.cuda_source)
    return replace(job, **changes)


def payload(cfg: TuneConfig, cand: Candidate, point=None, **changes) -> dict:
    """kernel_job(...).to_json(): what a Job carries."""
    return kernel_job(cfg, cand, point, **changes).to_json()


BENCH_KEYS = ("entries",)             # [kernel job JSON + "shape"]: the dispatch table's kernels
RACE_KEYS = ("finalists", "by_shape")  # {trial: kernel job JSON}, {shape key: [trials]}


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
