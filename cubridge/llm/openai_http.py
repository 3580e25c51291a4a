"""An OpenAI-compatible chat endpoint (`vllm serve`) over HTTP, with the standard library only.

POST {base_url}/chat/completions with every sampling field explicit (n, temperature, top_p, seed,
max_tokens) and, where asked, the answer constrained to a JSON schema. Connection errors, HTTP 5xx
and 429 are retried with exponential backoff (a 429's Retry-After is honoured, capped); a request
that times out is not resent, since the server is still generating it and a resend doubles its
load. Whatever fails ends as a Reply with an error message that names the address, what was tried
and how to start a server.

Structured output modes (option `structured`):
- "response_format": OpenAI's `response_format: {type: json_schema, ...}`; vLLM >= 0.6 honours it;
- "structured_outputs": vLLM >= 0.12's own field, `structured_outputs: {json: schema}`;
- "guided_json": vLLM < 0.12's field;
- "none": no constraint; the tolerant parser reads a fenced block instead.

Example:
    >>> from cubridge.llm.backend import Request, Sampling
    >>> b = OpenAIHTTPBackend("http://127.0.0.1:8000/v1", model="qwen")
    >>> body = b.request_body(Request(({"role": "user", "content": "hi"},), Sampling(n=2, seed=7)))
    >>> body["n"], body["seed"], body["max_tokens"]
    (2, 7, 4096)
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from cubridge.llm.backend import Backend, Completion, Reply, Request

STRUCTURED_MODES = ("response_format", "structured_outputs", "guided_json", "none")
RETRY_STATUS = (429, 500, 502, 503, 504)
# A Retry-After above this is not waited for: the tuner has better things to do.
MAX_RETRY_AFTER_S = 30.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")
START_HINT = ("start one with `vllm serve /path/to/model --port 8000 --max-model-len 32768` (it serves "
              "http://127.0.0.1:8000/v1), or point proposer option base_url at a running server")


class OpenAIHTTPBackend(Backend):
    name = "openai"

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 1.0,
                 structured: str = "response_format", max_model_len: int | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model or ""
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.structured = structured
        self._max_model_len = max_model_len
        # A local server is reached directly even where http_proxy is set for the outside world.
        local = urllib.parse.urlsplit(self.base_url).hostname in LOOPBACK
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}) if local else
                                                   urllib.request.ProxyHandler())

    # ------------------------------------------------------------ Backend
    def generate(self, requests: list[Request]) -> list[Reply]:
        return [self._one(r) for r in requests]

    def prepare(self) -> str | None:
        """Learn the served model's id (when not given) and max_model_len from GET /models."""
        if self.model and self._max_model_len is not None:
            return None
        status, err = self._discover()
        if err and self.model and status is not None:
            return None          # the server answers but has no usable /models: the given model will do
        return err

    def max_model_len(self) -> int | None:
        return self._max_model_len

    def request_body(self, request: Request) -> dict:
        """The JSON body of a chat completion request (what is sent, for tests and logs)."""
        s = request.sampling
        body = {"model": self.model or "default", "messages": [dict(m) for m in request.messages],
                "n": s.n, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
                "max_tokens": s.max_tokens, "stream": False}
        if request.schema is not None and self.structured != "none":
            if self.structured == "response_format":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": request.schema.get("title", "answer"), "schema": request.schema, "strict": True}}
            elif self.structured == "structured_outputs":
                body["structured_outputs"] = {"json": request.schema}
            else:
                body["guided_json"] = request.schema
        return body

    # ------------------------------------------------------------ internals
    def _one(self, request: Request) -> Reply:
        if not self.model:
            _, err = self._discover()
            if err:
                return Reply(error=err)
        body = self.request_body(request)
        status, payload, err = self._call("POST", "/chat/completions", body)
        if err:
            if status in (400, 422) and any(k in body for k in ("response_format", "structured_outputs", "guided_json")):
                err += ("\n  hint: if this server does not support structured outputs in this form, set proposer "
                        "option structured_field (response_format, structured_outputs, guided_json) or structured: false")
            return Reply(error=err)
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            return Reply(error=f"{self._url('/chat/completions')} answered HTTP {status} with JSON that has no "
                               f"'choices' list: {_clip(json.dumps(payload))}")
        out = []
        for c in choices:
            msg = c.get("message") or {}
            text = msg.get("content")
            if text is None:
                text = c.get("text", "")     # a /completions-style choice
            out.append(Completion(str(text or ""), c.get("finish_reason")))
        return Reply(out)

    def _discover(self):
        """(HTTP status, error) after learning the model id and max_model_len from GET /models
        (vLLM reports max_model_len there)."""
        status, payload, err = self._call("GET", "/models", None)
        if err:
            return status, err
        data = payload.get("data") if isinstance(payload, dict) else None
        if not data or not isinstance(data, list):
            return status, f"{self._url('/models')} lists no model; {START_HINT}"
        entry = next((d for d in data if d.get("id") == self.model), data[0])
        self.model = self.model or str(entry.get("id", ""))
        if self._max_model_len is None and isinstance(entry.get("max_model_len"), int):
            self._max_model_len = entry["max_model_len"]
        return status, None

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _call(self, method: str, path: str, body: dict | None):
        """(status, parsed JSON, None) or (status, None, error message), after retries."""
        url = self._url(path)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        tried = []
        start = time.monotonic()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(tried[-1][1])
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    raw = resp.read()
                    status = resp.status
            except urllib.error.HTTPError as e:
                detail = _clip(e.read().decode(errors="replace"))
                if e.code in RETRY_STATUS and attempt < self.retries:
                    tried.append((f"HTTP {e.code}", self._delay(attempt, e.headers.get("Retry-After"))))
                    continue
                return e.code, None, (f"{method} {url} failed with HTTP {e.code}: {detail}"
                                      + _tries(tried, start))
            except (TimeoutError, socket.timeout):
                return None, None, (f"{method} {url} timed out after {self.timeout_s:g} s (proposer option "
                                    "timeout_s); not resent, the server may still be generating it. A large "
                                    "max_tokens or n makes requests slow: lower them or raise timeout_s"
                                    + _tries(tried, start))
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    return None, None, f"{method} {url} timed out after {self.timeout_s:g} s" + _tries(tried, start)
                if attempt < self.retries:
                    tried.append((str(reason), self._delay(attempt, None)))
                    continue
                tried.append((str(reason), 0.0))
                return None, None, (f"cannot reach the OpenAI-compatible server at {self.base_url} "
                                    f"({method} {path}): {reason}" + _tries(tried, start) + f"; {START_HINT}")
            try:
                return status, json.loads(raw), None
            except ValueError:
                return status, None, (f"{method} {url} answered HTTP {status} with a body that is not JSON: "
                                      f"{_clip(raw.decode(errors='replace'))!r}; is base_url an "
                                      "OpenAI-compatible API (ending in /v1)?")
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after) -> float:
        delay = self.backoff_s * (2 ** attempt)
        try:
            if retry_after is not None:
                delay = max(delay, min(float(retry_after), MAX_RETRY_AFTER_S))
        except ValueError:
            pass
        return delay


def _tries(tried, start) -> str:
    if not tried:
        return ""
    reasons = [w for w, _ in tried]
    what = "; ".join(f"{w}" + (f" (x{reasons.count(w)})" if reasons.count(w) > 1 else "")
                     for w in dict.fromkeys(reasons))
    return f" ({len(tried)} tries over {time.monotonic() - start:.1f} s: {what})"


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more characters]"
