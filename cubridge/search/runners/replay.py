"""A runner that answers from recorded JobResults: the search logic tested on CPU, no GPU.

The file is JSON:

    {"device": {"gpus": 1, "name": "NVIDIA H100 80GB HBM3"},   # what the recording ran on
     "delay_s": 0.0,                                            # simulated time per job
     "results": [{"kind": "measure",
                  "match": {"candidate": "3f2a...", "config": {"block_m": 128, ...}},
                  "outcome": {"state": "ok", "reason": "", "times_ms": {"N=1024,B=16": 0.21}},
                  "data": {}}, ...]}

A job takes the first record of its kind whose `match` items all equal the job's payload items
(an empty match answers every job of the kind). A job with no record comes back as CRASH saying
so: replay never invents a measurement. `record()` turns real JobResults into such entries.

Example:
    >>> import json, tempfile
    >>> from cubridge.vocab import Job
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> json.dump({"results": [{"kind": "echo", "match": {}, "outcome": {"state": "ok"}}]}, f); f.close()
    >>> r = ReplayRunner(f.name); r.submit([Job("echo", {"x": 1})])
    >>> r.results()[0].outcome.state.value
    'ok'
"""
from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from cubridge.errors import CubridgeError
from cubridge.vocab import Job, JobResult, Outcome, Runner, TrialState


def _outcome(d: dict) -> Outcome:
    return Outcome(TrialState(d.get("state", "ok")), d.get("reason", ""), dict(d.get("times_ms") or {}))


def record(result: JobResult, match_keys) -> dict:
    """A replay entry for a real result, matched on the payload's `match_keys`."""
    return {"kind": result.job.kind, "match": {k: result.job.payload[k] for k in match_keys if k in result.job.payload},
            "outcome": result.outcome.to_json(), "data": result.data}


class ReplayRunner(Runner):
    def __init__(self, path, *, delay_s: float | None = None):
        self.path = Path(path)
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise CubridgeError("replay file not found", where=str(self.path),
                                hint="give the JSON of recorded results (see cubridge/search/runners/replay.py)") from None
        except json.JSONDecodeError as e:
            raise CubridgeError(f"replay file is not JSON: {e}", where=f"{self.path}:{e.lineno}") from None
        doc = {"results": doc} if isinstance(doc, list) else doc
        self.records = list(doc.get("results", []))
        for i, rec in enumerate(self.records):
            if "kind" not in rec or "outcome" not in rec:
                raise CubridgeError(f"record {i} lacks 'kind' or 'outcome'", where=str(self.path),
                                    hint='each record: {"kind": ..., "match": {...}, "outcome": {"state": ...}}')
        self.device = dict(doc.get("device") or {})
        self.delay_s = float(doc.get("delay_s", 0.0) if delay_s is None else delay_s)
        # Tests of concurrent runs: once `gate_after` jobs are answered, none is while the file `gate`
        # exists, so a test holds a run mid-way (its lock held) as long as it needs, on any load.
        self.gate, self.gate_after = doc.get("gate"), int(doc.get("gate_after", 0))
        self._pending: deque[Job] = deque()
        self.answered = 0

    def __repr__(self) -> str:
        return f"ReplayRunner({self.path.name}: {len(self.records)} records, {self.num_gpus} GPU)"

    @property
    def num_workers(self) -> int:
        return max(1, self.num_gpus)

    @property
    def num_gpus(self) -> int:
        return int(self.device.get("gpus", 0))

    def submit(self, jobs: list[Job]) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError("runner is closed")
        self._pending.extend(jobs)

    def close(self) -> None:
        self._closed = True

    def results(self, timeout_s: float | None = None) -> list[JobResult]:
        if not self._pending:
            return []
        while self.gate and self.answered >= self.gate_after and Path(self.gate).exists():
            time.sleep(0.05)
        if self.delay_s:
            if timeout_s is not None and timeout_s < self.delay_s:
                time.sleep(timeout_s)
                return []
            time.sleep(self.delay_s)
        out = []
        for _ in range(min(self.num_workers, len(self._pending))):
            out.append(self._answer(self._pending.popleft()))
        self.answered += len(out)
        return out

    def _answer(self, job: Job) -> JobResult:
        for rec in self.records:
            if rec["kind"] == job.kind and all(job.payload.get(k) == v for k, v in (rec.get("match") or {}).items()):
                return JobResult(job, _outcome(rec["outcome"]), dict(rec.get("data") or {}), "replay")
        keys = ", ".join(sorted(job.payload)[:8])
        return JobResult(job, Outcome(TrialState.CRASH, f"replay: no recorded result for this {job.kind} job "
                                                        f"(payload keys: {keys})"), {}, "replay")
