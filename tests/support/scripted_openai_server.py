"""A real OpenAI-compatible HTTP server (stdlib only) that replays scripted chat completions.

    python scripted_openai_server.py SCRIPT.json --requests REQUESTS.jsonl [--port 0]

prints `PORT <n>` on its first line once it listens on 127.0.0.1. SCRIPT.json:

    {"models": [{"id": "scripted", "max_model_len": 32768}],
     "responses": [
        {"choices": [{"content": "...", "finish_reason": "stop"}, ...]},   # 200, OpenAI JSON
        {"status": 503, "headers": {"Retry-After": "0"}},                # an error status
        {"raw": "<html>not json</html>"},                                  # 200, a body that is not JSON
        {"delay_s": 3, "choices": [...]}                                   # answers after a delay
     ]}

Each POST /v1/chat/completions takes the next response; when none is left it answers 410. Every
request (method, path, JSON body) is appended to REQUESTS.jsonl so that tests can read what was
sent (sampling fields, the schema, the retry prompt).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(script: dict, requests_path: str):
    responses = list(script.get("responses", []))
    models = script.get("models", [{"id": "scripted", "max_model_len": 32768}])
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):      # keep the test output clean
            pass

        def _record(self, body):
            with lock, open(requests_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"method": self.command, "path": self.path, "body": body}) + "\n")

        def _send(self, status: int, payload: bytes, headers: dict | None = None,
                  content_type: str = "application/json"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._record(None)
            if self.path.rstrip("/") == "/v1/models":
                data = [{"object": "model", "owned_by": "scripted", **m} for m in models]
                self._send(200, json.dumps({"object": "list", "data": data}).encode())
            else:
                self._send(404, b'{"error": {"message": "not found"}}')

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
            self._record(body)
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, b'{"error": {"message": "not found"}}')
                return
            with lock:
                entry = responses.pop(0) if responses else None
            if entry is None:
                self._send(410, b'{"error": {"message": "the script has no response left"}}')
                return
            time.sleep(entry.get("delay_s", 0))
            if "raw" in entry:
                self._send(entry.get("status", 200), entry["raw"].encode(), content_type="text/html")
                return
            if "choices" not in entry:
                err = {"error": {"message": entry.get("message", "scripted error"), "code": entry.get("status")}}
                self._send(entry.get("status", 500), json.dumps(err).encode(), entry.get("headers"))
                return
            choices = [{"index": i, "message": {"role": "assistant", "content": c.get("content", "")},
                        "finish_reason": c.get("finish_reason", "stop")} for i, c in enumerate(entry["choices"])]
            model = body.get("model", "scripted") if isinstance(body, dict) else "scripted"
            payload = {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
                       "model": model, "choices": choices,
                       "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
            self._send(entry.get("status", 200), json.dumps(payload).encode(), entry.get("headers"))

    return Handler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("script")
    ap.add_argument("--requests", required=True)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args(argv)
    with open(a.script, encoding="utf-8") as f:
        script = json.load(f)
    server = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(script, a.requests))
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
