"""Sampling a population and repairing it: the loop every LLM task shares (transfer, lift, lower).

A `Task` says what to ask (its chat messages), how to read an answer into a candidate, and what the
candidate is called in a retry prompt. The `Sampler` spends a budget of fresh samples (one request
with n = k per `draw`), reads every completion, and for each rejection it is told about schedules
at most one repair, bounded by `max_retries` per chain: the task's prompt, the previous answer as
the assistant's turn, then the error. Repairs are drawn before fresh samples.

Nothing here raises for a bad answer or a failed request: each ends as a `Record` with a
TrialState (PROPOSER_ERROR for backend failures, REJECTED_PARSE for an unreadable or cut-off
answer, the screen's / runner's state otherwise), and everything is logged.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

from cubridge.llm.backend import Backend, PromptTooLong, Request, Sampling, check_fits
from cubridge.llm.envelope import Envelope, EnvelopeError, read_envelope
from cubridge.llm.log import EventLog
from cubridge.llm.prompting import retry_message
from cubridge.vocab import Outcome, TrialState

# States a repair can address. Not: CONFIG_INVALID (the tile config's fault), TIMEOUT (the machine
# or the config), PROPOSER_ERROR (nothing was produced to repair).
# Consecutive failed requests (server down, timeouts) after which the sampler stops: until then a
# failed request's samples go back to the budget, so a server that is still loading costs nothing.
GIVE_UP_AFTER = 3
REPAIRABLE = (TrialState.REJECTED_PARSE, TrialState.REJECTED_CHECK, TrialState.REJECTED_STRUCTURE,
              TrialState.WRONG_ANSWER, TrialState.COMPILE_ERROR, TrialState.CRASH)


class Rejected(Exception):
    """Raised by Task.candidate: the answer is readable but not a candidate."""

    def __init__(self, state: TrialState, reason: str):
        super().__init__(reason)
        self.state = state
        self.reason = reason


class Task(ABC):
    name: str = "task"
    envelope: Envelope
    artifact: str = "answer"          # what the retry prompt asks for again

    @abstractmethod
    def messages(self) -> list[dict]:
        """The chat prompt of a fresh sample."""

    @abstractmethod
    def candidate(self, fields: dict):
        """The candidate from the envelope's fields; raise Rejected if there is none."""

    def precheck(self, candidate) -> Outcome | None:
        """CPU checks a task runs before its acceptance callable (None: none)."""
        return None

    def key(self, candidate) -> str:
        """The candidate's text, which identifies it (duplicates are dropped)."""
        return str(candidate)

    def read(self, text: str, finish_reason, max_tokens: int):
        try:
            fields = read_envelope(text, finish_reason, self.envelope, max_tokens)
        except EnvelopeError as e:
            raise Rejected(TrialState.REJECTED_PARSE, str(e)) from None
        return self.candidate(fields)


@dataclass
class Draft:
    """One answer of the model and what became of it."""
    slot: int                     # population member; repairs keep their slot
    attempt: int                  # 0 = fresh sample, k = k-th repair
    parent: str | None            # key id of the draft this one repairs
    messages: tuple               # the prompt it answered
    raw: str
    finish_reason: str | None
    seed: int
    candidate: object = None
    id: str = ""                  # sha256[:16] of the candidate's text (of the raw text if none)


@dataclass(frozen=True)
class _Repair:
    """A repair waiting to be drawn: the prompt with the previous answer and its error."""
    slot: int
    attempt: int
    parent: str
    messages: tuple


@dataclass(frozen=True)
class _Planned:
    """One request of a draw and whom its answers belong to."""
    request: Request
    slot: int | None              # None: fresh samples, each gets a new slot
    attempt: int
    parent: str | None
    k: int                        # answers wanted


@dataclass(frozen=True)
class Record:
    slot: int | None
    attempt: int
    id: str | None
    state: TrialState
    reason: str


def text_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Sampler:
    def __init__(self, task: Task, backend: Backend, log: EventLog, *, samples: int, max_retries: int,
                 sampling: Sampling, max_model_len: int | None = None, structured: bool = True):
        self.task, self.backend, self.log = task, backend, log
        self.fresh_left = samples
        self.max_retries = max_retries
        self.sampling = sampling
        self.max_model_len = max_model_len
        self.structured = structured
        self.records: list[Record] = []
        self.drafts: dict[str, Draft] = {}
        self._pending: deque[_Repair] = deque()
        self._repaired: set[str] = set()
        self._slots = 0
        self._requests = 0
        self._ready = False
        self._failures = 0                  # consecutive failed requests
        self.last_error: str | None = None

    @property
    def exhausted(self) -> bool:
        return not self._pending and self.fresh_left <= 0

    # ------------------------------------------------------------ drawing
    def draw(self, n: int) -> list[Draft]:
        """Up to n new readable candidates' drafts (repairs first). Failed requests and unreadable
        answers are recorded (and repaired later, where they can be) instead."""
        plan = []
        while self._pending and len(plan) < n:
            r = self._pending.popleft()
            plan.append(_Planned(self._request(r.messages, 1), r.slot, r.attempt, r.parent, 1))
        k = min(n - len(plan), self.fresh_left)
        if k > 0:
            k = 1 if self.sampling.temperature == 0 else k   # greedy samples would be identical
            self.fresh_left -= k
            plan.append(_Planned(self._request(tuple(self.task.messages()), k), None, 0, None, k))
        if not plan:
            return []
        if not self._ready and not self._prepare(plan):
            return []
        sendable = [p for p in plan if self._fits(p)]
        replies = self.backend.generate([p.request for p in sendable]) if sendable else []
        drafts = []
        for p, reply in zip(sendable, replies):
            prompt = self.log.prompt(p.request.messages)
            if reply.error:
                self._request_failed([p], reply.error, prompt)
                continue
            self._failures = 0
            for c in reply.completions[:p.k]:
                slot = p.slot if p.slot is not None else self._new_slot()
                d = Draft(slot, p.attempt, p.parent, p.request.messages, c.text, c.finish_reason,
                          p.request.sampling.seed)
                self.log.write("completion", slot=slot, attempt=p.attempt, parent=p.parent, prompt=prompt,
                               seed=d.seed, finish_reason=c.finish_reason, text=c.text)
                drafts.extend(self._read(d))
        return drafts

    def _request(self, messages: tuple, n: int) -> Request:
        s = self.sampling
        seed = s.seed + self._requests
        self._requests += 1
        sampling = Sampling(n=n, temperature=s.temperature, top_p=s.top_p, seed=seed, max_tokens=s.max_tokens)
        return Request(tuple(messages), sampling, self.task.envelope.schema if self.structured else None)

    def _prepare(self, plan) -> bool:
        err = self.backend.prepare()
        if err:
            self._request_failed(plan, err)
            return False
        self._ready = True
        if not self.max_model_len:
            self.max_model_len = self.backend.max_model_len()
        return True

    def _fits(self, p: _Planned) -> bool:
        try:
            check_fits(p.request.messages, p.request.sampling.max_tokens, self.max_model_len,
                       "repair prompt" if p.attempt else "prompt")
            return True
        except PromptTooLong as e:          # not transient: these samples are spent
            self._fail(p.slot, p.attempt, str(e))
            return False

    def _new_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def _read(self, d: Draft) -> list[Draft]:
        try:
            d.candidate = self.task.read(d.raw, d.finish_reason, self.sampling.max_tokens)
        except Rejected as r:
            d.id = text_id(d.raw)
            self.drafts.setdefault(d.id, d)
            self.reject(d, Outcome(r.state, r.reason))
            return []
        d.id = text_id(self.task.key(d.candidate))
        if d.id in self.drafts:
            self.log.write("duplicate", slot=d.slot, attempt=d.attempt, id=d.id)
            return []
        self.drafts[d.id] = d
        self.log.write("candidate", slot=d.slot, attempt=d.attempt, id=d.id, parent=d.parent)
        return [d]

    # ------------------------------------------------------------ outcomes
    def reject(self, d: Draft, outcome: Outcome) -> None:
        """Record a rejection; schedule one repair of this draft if its chain has attempts left."""
        self.records.append(Record(d.slot, d.attempt, d.id, outcome.state, outcome.reason))
        self.log.write("rejected", slot=d.slot, attempt=d.attempt, id=d.id, state=outcome.state.value,
                       reason=outcome.reason)
        if outcome.state not in REPAIRABLE or d.attempt >= self.max_retries or d.id in self._repaired:
            return
        self._repaired.add(d.id)
        base = tuple(self.task.messages())
        messages = base + ({"role": "assistant", "content": d.raw},
                           retry_message(outcome.state, outcome.reason, self.task.artifact))
        self._pending.append(_Repair(d.slot, d.attempt + 1, d.id, messages))
        self.log.write("retry", slot=d.slot, attempt=d.attempt + 1, parent=d.id, state=outcome.state.value,
                       error=outcome.reason)

    def accept(self, d: Draft, outcome: Outcome) -> None:
        self.records.append(Record(d.slot, d.attempt, d.id, outcome.state, outcome.reason))
        self.log.write("accepted", slot=d.slot, attempt=d.attempt, id=d.id, state=outcome.state.value,
                       reason=outcome.reason)

    def _request_failed(self, planned: list, reason: str, prompt: str | None = None) -> None:
        """Requests that produced nothing: record them; give their samples back unless the backend
        has now failed GIVE_UP_AFTER times in a row, in which case stop sampling altogether."""
        for p in planned:
            self._fail(p.slot, p.attempt, reason, prompt)
        self._failures += 1
        if self._failures < GIVE_UP_AFTER:
            for p in planned:
                if p.slot is None:
                    self.fresh_left += p.k
                else:
                    self._pending.appendleft(_Repair(p.slot, p.attempt, p.parent, p.request.messages))
        else:
            self.fresh_left = 0
            self._pending.clear()
            self.log.write("give_up", failures=self._failures, error=reason)

    def _fail(self, slot, attempt, reason: str, prompt: str | None = None) -> None:
        self.last_error = reason
        self.records.append(Record(slot, attempt, None, TrialState.PROPOSER_ERROR, reason))
        self.log.write("backend_error", slot=slot, attempt=attempt, prompt=prompt, backend=self.backend.describe(),
                       error=reason)


def solve(sampler: Sampler, check, batch: int = 4):
    """Draw and check candidates until one is accepted or the budget is spent: (draft, outcome),
    or (None, None). `check(candidate) -> Outcome` decides (OK / VERIFIED accept); a rejection is
    repaired like any other. Stops early when the backend fails (nothing to repair)."""
    while not sampler.exhausted:
        failures = sum(r.state is TrialState.PROPOSER_ERROR for r in sampler.records)
        for d in sampler.draw(batch):
            outcome = check(d.candidate)
            if outcome.state.failed:
                sampler.reject(d, outcome)
            else:
                sampler.accept(d, outcome)
                return d, outcome
        if sum(r.state is TrialState.PROPOSER_ERROR for r in sampler.records) > failures:
            break
    return None, None


@dataclass
class Solution:
    """What a lift or lower run ended with: the accepted candidate (None if none was) and the
    record of every attempt; the JSONL log has everything the model said."""
    candidate: object
    outcome: Outcome | None
    records: list
    log_path: object

    @property
    def accepted(self) -> bool:
        return self.candidate is not None


def run_task(task: Task, backend: Backend, accept, *, out_dir, samples: int = 4, max_retries: int = 3,
             sampling: Sampling = Sampling(), max_model_len: int | None = None, structured: bool = True,
             batch: int = 4) -> Solution:
    """Sample candidates for `task`, run its CPU precheck, then `accept(candidate) -> Outcome` (the
    GPU check, in the tuner's isolated runner workers); repair rejections with their errors."""
    log = EventLog(out_dir, f"{task.name}")
    log.write("start", task=task.name, backend=backend.describe(), samples=samples, max_retries=max_retries)
    sampler = Sampler(task, backend, log, samples=samples, max_retries=max_retries, sampling=sampling,
                      max_model_len=max_model_len, structured=structured)

    def check(candidate):
        pre = task.precheck(candidate)
        return pre if pre is not None and pre.state.failed else accept(candidate)

    draft, outcome = solve(sampler, check, batch)
    return Solution(draft.candidate if draft else None, outcome, sampler.records, log.path)
