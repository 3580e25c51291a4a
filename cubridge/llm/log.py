"""The proposer's record: every prompt, everything the model said, and why each candidate was
rejected, as JSON lines in the output directory (one file per proposer run).

Events: "start" (backend, options), "prompt" (each distinct prompt once, by hash), "completion"
(the raw text, finish_reason, seed, the prompt's hash), "backend_error" (a request that produced
nothing), "candidate" (read and handed on), "duplicate", "rejected" (state, reason), "retry" (a
repair scheduled, with the error fed back), "accepted", "give_up" (the backend kept failing).

Example:
    >>> import tempfile, json
    >>> log = EventLog(tempfile.mkdtemp(), "openai")
    >>> log.write("rejected", state="wrong_answer", reason="max err 0.8")
    >>> json.loads(log.path.read_text().splitlines()[-1])["event"]
    'rejected'
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, out_dir, name: str):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"llm-{name}.jsonl"
        self._prompts: set[str] = set()

    def write(self, event: str, **fields) -> None:
        rec = {"t": round(time.time(), 3), "event": event, **fields}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    def prompt(self, messages) -> str:
        """Log a prompt the first time it is seen; returns its hash."""
        digest = hashlib.sha256(json.dumps(list(messages), sort_keys=True).encode()).hexdigest()[:16]
        if digest not in self._prompts:
            self._prompts.add(digest)
            self.write("prompt", prompt=digest, messages=list(messages))
        return digest

    def events(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]
