"""The narrow interfaces of the search: proposers and runners both speak ask / tell.

- A **Proposer** (rules, vLLM, OpenAI-compatible endpoint) proposes candidate transfers as CuIR
  text (`ask`) and is told how each fared (`tell`), so that an LLM proposer can retry with the
  checker's, interpreter's or compiler's error.
- A **Runner** (local worker processes, Ray actors, replay) executes jobs on workers and returns
  their results; a job that crashes, hangs or fails to compile costs one trial, never the run.
- A **TrialRecord** holds candidate, config, per-shape times, errors and a state; failures are
  states, never exceptions that stop the tuner.

Everything here is plain data (dataclasses, str enums) so that records serialise to JSON and
travel to Ray workers unchanged.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from enum import Enum


# The one spelling of the kernel data types in configs, jobs, the CLI and the reference kernels;
# CuIR names its element types as PTX does, so the same types read "bf16" / "f16" there.
DTYPES = ("bf16", "fp16")
CUIR_TYPE = {"bf16": "bf16", "fp16": "f16"}


class TrialState(str, Enum):
    """Where a candidate (or a candidate x config trial) ended. Only OK carries timings."""
    PENDING = "pending"
    OK = "ok"                                  # verified, compiled, checked on GPU, timed
    VERIFIED = "verified"                      # passed every CPU stage; not timed (no GPU / dry run)
    REJECTED_PARSE = "rejected_parse"          # not valid CuIR text (syntax, forbidden construct)
    REJECTED_CHECK = "rejected_check"          # static checker: shapes, dtypes, waits, barriers
    REJECTED_STRUCTURE = "rejected_structure"  # changes what the rule taxonomy forbids
    WRONG_ANSWER = "wrong_answer"              # verification rule failed (interpreter or GPU)
    COMPILE_ERROR = "compile_error"
    CONFIG_INVALID = "config_invalid"          # tile config violates smem / register / divisibility
    CRASH = "crash"                            # worker died (illegal address, abort, ...)
    TIMEOUT = "timeout"
    PROPOSER_ERROR = "proposer_error"          # the proposer could not produce text (LLM unreachable, ...)

    @property
    def failed(self) -> bool:
        return self not in (TrialState.OK, TrialState.VERIFIED, TrialState.PENDING)


@dataclass(frozen=True)
class Proposal:
    """One candidate transfer: target CuIR text plus where it came from."""
    text: str                                  # CuIR program text
    origin: str                                # "rules", "vllm", "openai", ...
    attempt: int = 0                           # retry number for this slot of the population
    parent: str | None = None                  # id of the proposal this one repairs
    notes: tuple[str, ...] = ()                # e.g. rules applied, model name, sampling seed
    # How a worker binds its extra inputs (transfer.rules.Binding.to_json()); None: it reads none.
    binding: dict | None = field(default=None, compare=False, hash=False)

    @property
    def id(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclass
class Outcome:
    """What happened to a proposal (or a trial): the state, a reason a person or an LLM can act
    on, and per-shape times in milliseconds when it was timed."""
    state: TrialState
    reason: str = ""
    times_ms: dict = field(default_factory=dict)     # shape key ("N=8192,B=2") -> ms

    def to_json(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Outcome":
        """Inverse of to_json; a missing reason or times read as empty, an unknown state raises
        ValueError naming it."""
        return cls(TrialState(d["state"]), d.get("reason") or "", dict(d.get("times_ms") or {}))


# The keys of a trial record in trials.jsonl. Runs logged before `baselines_ms` ... `finished_at`
# existed lack some of the optional ones (they read as unset); a key outside both sets means the
# log comes from another cubridge version (or was edited): refused, not guessed at.
RECORD_KEYS = ("number", "proposal_id", "origin", "config", "outcome")
RECORD_OPTIONAL = ("baselines_ms", "worker", "cubin_key", "gpu_check", "device", "finished_at")


@dataclass(frozen=True)
class TrialRecord:
    """A finished trial: proposal x tile config, with everything measured; every field is set
    when the driver records it. trials.jsonl holds one to_json() per line."""
    number: int
    proposal_id: str
    origin: str
    reference: str                                    # the reference kernel the candidate transfers
    label: str                                        # the tile config's short name ("128x128s2p")
    point: dict                                       # the tile config
    outcome: Outcome
    baselines_ms: dict = field(default_factory=dict)  # shape key -> {system: ms}, same run
    worker: str = ""                                  # which worker measured it
    cubin_key: str | None = None                      # its cubin in the compile cache
    gpu_check: list | None = None                     # the GPU verification cases and their results
    device: dict | None = None                        # the GPU it was timed on
    finished_at: float | None = None                  # time.time() when the driver took the result

    @property
    def state(self) -> TrialState:
        return self.outcome.state

    @property
    def times_ms(self) -> dict:
        return self.outcome.times_ms

    def to_json(self) -> dict:
        return {"number": self.number, "proposal_id": self.proposal_id, "origin": self.origin,
                "config": {"reference": self.reference, "label": self.label, "point": dict(self.point)},
                "outcome": self.outcome.to_json(), "baselines_ms": self.baselines_ms, "worker": self.worker,
                "cubin_key": self.cubin_key, "gpu_check": self.gpu_check, "device": self.device,
                "finished_at": self.finished_at}

    @classmethod
    def from_json(cls, d: dict) -> "TrialRecord":
        """Inverse of to_json. Raises ValueError saying which key is missing or unknown, or which
        value is malformed (the trial log's reader adds the file and line)."""
        if not isinstance(d, dict):
            raise ValueError(f"a JSON object expected, got {type(d).__name__}")
        missing = [k for k in RECORD_KEYS if k not in d]
        unknown = sorted(set(d) - set(RECORD_KEYS) - set(RECORD_OPTIONAL))
        if missing or unknown:
            raise ValueError("; ".join([f"missing {', '.join(missing)}"] * bool(missing)
                                       + [f"unknown {', '.join(unknown)}"] * bool(unknown)))
        try:
            cfg, extra = d["config"], {k: d[k] for k in RECORD_OPTIONAL if d.get(k) is not None}
            return cls(int(d["number"]), str(d["proposal_id"]), str(d["origin"]), str(cfg["reference"]),
                       str(cfg["label"]), dict(cfg["point"]), Outcome.from_json(d["outcome"]), **extra)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed {type(e).__name__}: {e}") from e


class Proposer(ABC):
    """Proposes candidate transfers. Implementations: rules (deterministic), vllm, openai."""
    name: str = "proposer"

    @abstractmethod
    def ask(self, n: int) -> list[Proposal]:
        """Up to n new proposals (fewer, possibly none, when the proposer has nothing new)."""

    @abstractmethod
    def tell(self, proposal: Proposal, outcome: Outcome) -> None:
        """How a proposal fared; a proposer may use a rejection to retry (bounded)."""


@dataclass(frozen=True)
class Job:
    """Work for a runner's worker: `kind` names a registered job function, `payload` is JSON-able."""
    kind: str
    payload: dict
    timeout_s: float = 120.0
    needs_gpu: bool = True


@dataclass
class JobResult:
    job: Job
    outcome: Outcome
    data: dict = field(default_factory=dict)          # job-specific results (timings, logs)
    worker: str = ""


class Runner(ABC):
    """Runs jobs on workers. Implementations: local (spawned processes, one per GPU), ray (one
    actor per GPU), replay (answers from recorded results, for CPU tests of the search logic)."""

    @abstractmethod
    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs; results come back from `results`."""

    @abstractmethod
    def results(self, timeout_s: float | None = None) -> list[JobResult]:
        """Finished jobs since the last call (blocks up to timeout_s for at least one)."""

    @property
    @abstractmethod
    def num_workers(self) -> int: ...

    @property
    def num_gpus(self) -> int:
        """GPUs the workers time on; 0 means the tuner screens and compiles but cannot time."""
        return 0

    def close(self) -> None:
        """Stop workers; idempotent."""
