"""Test helpers for the LLM proposers: start the scripted OpenAI-compatible server as a real
process on 127.0.0.1, read what it was sent, find a closed port.

Tests import this with tests/support on sys.path (see test_llm_http.py).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

SERVER = Path(__file__).with_name("scripted_openai_server.py")


def completion(content: str, finish_reason: str = "stop") -> dict:
    return {"content": content, "finish_reason": finish_reason}


def envelope(cuir: str, notes: str = "scripted") -> str:
    """An answer in the JSON envelope the proposer asks for."""
    return json.dumps({"cuir": cuir, "notes": notes})


def inline_scalars(cuir: str, values: dict) -> str:
    """A rules candidate as an LLM would write it: each scalar input (C0 = scalar_input(i32)) dropped
    and its uses replaced by an expression of the shape, e.g. {"C0": "NK // 2"}."""
    for name, expr in values.items():
        cuir = re.sub(rf"^{name} = scalar_input\(\w+\)\n", "", cuir, flags=re.M)
        cuir = re.sub(rf"\b{name}\b", f"({expr})", cuir)
    return cuir


class ScriptedServer:
    """The server process, replaying `responses` (see scripted_openai_server.py for the format)."""

    def __init__(self, workdir: Path, responses: list, models: list | None = None, name: str = "server"):
        workdir.mkdir(parents=True, exist_ok=True)
        self.script = workdir / f"{name}-script.json"
        self.requests_path = workdir / f"{name}-requests.jsonl"
        script = {"responses": responses}
        if models is not None:
            script["models"] = models
        self.script.write_text(json.dumps(script))
        self.proc = subprocess.Popen([sys.executable, str(SERVER), str(self.script), "--requests",
                                      str(self.requests_path)], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"scripted server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def requests(self, path: str = "/v1/chat/completions") -> list[dict]:
        if not self.requests_path.exists():
            return []
        rows = [json.loads(l) for l in self.requests_path.read_text().splitlines() if l.strip()]
        return [r["body"] for r in rows if r["path"] == path]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lifting_map(marked: str) -> dict:
    """The regions of a marked kernel as [first, last] line ranges of its unmarked text (what a
    model's lift answer carries)."""
    from cubridge.llm.regions import find_regions
    ranges, markers = {}, 0
    for name, s in sorted(find_regions(marked).items(), key=lambda kv: kv[1].open):
        lo = s.open - markers + 1
        ranges[name] = [lo, lo + s.close - s.open - 2]
        markers += 2
    return ranges
