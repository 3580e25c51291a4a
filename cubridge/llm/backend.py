"""What every LLM backend speaks: chat prompts in, completions out.

A backend turns a list of `Request`s (chat messages + sampling) into one `Reply` each: the
completions, or an error message when that request could not be served. Backends never raise for
a request that failed (unreachable server, timeout, a body that is not JSON): the proposer turns
the message into a PROPOSER_ERROR record and carries on. They raise `CubridgeError` only when they
cannot be built at all (vllm missing, model directory missing).

Implementations: `http.OpenAIHTTPBackend` (an OpenAI-compatible endpoint such as `vllm serve`,
stdlib only), `vllm_backend.VLLMBackend` (vllm.LLM in this process), `ray_actor.RayVLLMBackend`
(vllm.LLM inside a Ray actor holding its GPUs).

Example:
    >>> s = Sampling(n=4, temperature=0.7, seed=3, max_tokens=512)
    >>> estimate_tokens([{"role": "user", "content": "x" * 300}])
    108
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from cubridge.errors import CubridgeError

# A conservative (high) token estimate: ~3 bytes per token. BPE tokenizers average 3.5-4.5 bytes
# per token on English and code; over-estimating by ~25% refuses a few prompts that would fit, but
# never sends one that a server rejects for length after a long queue wait.
BYTES_PER_TOKEN = 3
# Chat templates add role markers and separators around every message.
TOKENS_PER_MESSAGE = 8


@dataclass(frozen=True)
class Sampling:
    """Sampling for one request, every field explicit (no server defaults are relied on)."""
    n: int = 1
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 4096


@dataclass(frozen=True)
class Request:
    messages: tuple           # ({"role": ..., "content": ...}, ...)
    sampling: Sampling
    schema: dict | None = None  # JSON schema the answer must follow (structured outputs)


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str | None = None     # "stop", "length", ...


@dataclass
class Reply:
    completions: list = field(default_factory=list)   # of Completion
    error: str | None = None                          # why the request produced nothing


class PromptTooLong(CubridgeError):
    """A prompt plus its max_tokens does not fit the model's context."""


class Backend(ABC):
    """Serves chat requests; see the module docstring."""
    name: str = "backend"
    model: str = ""

    @abstractmethod
    def generate(self, requests: list[Request]) -> list[Reply]:
        """One Reply per request, in order; never raises for a failed request."""

    def prepare(self) -> str | None:
        """Get ready before the first request (e.g. learn the served model); an error message if
        that failed. Called again before the next draw after a failure."""
        return None

    def max_model_len(self) -> int | None:
        """The model's context length in tokens, when known (after prepare)."""
        return None

    def describe(self) -> str:
        return f"{self.name} ({self.model or 'model unknown'})"


def estimate_tokens(messages) -> int:
    """A high estimate of a chat prompt's length in tokens (see BYTES_PER_TOKEN)."""
    return sum(math.ceil(len(m["content"].encode()) / BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE for m in messages)


def check_fits(messages, max_tokens: int, max_model_len: int | None, what: str = "prompt") -> int:
    """Raise PromptTooLong unless the estimated prompt plus max_tokens fits max_model_len."""
    est = estimate_tokens(messages)
    if max_model_len is not None and est + max_tokens > max_model_len:
        raise PromptTooLong(
            f"the {what} needs about {est} tokens (estimated at {BYTES_PER_TOKEN} bytes per token) plus "
            f"max_tokens={max_tokens}, more than the model's max_model_len={max_model_len}",
            hint="raise max_model_len (and start the model with it: `vllm serve ... --max-model-len N`), "
                 "lower max_tokens, or drop the worked example (proposer option worked_example: false)")
    return est
