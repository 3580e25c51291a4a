"""The LLM proposers' options: typed, with defaults; unknown keys are errors listing the allowed ones.

They come from the tuner config's proposer options (`make_proposer(kind, ctx, options)`).

Example:
    >>> o = parse_options("openai", {"base_url": "http://127.0.0.1:8000/v1", "samples": 4})
    >>> o.samples, o.backend.timeout_s
    (4, 300.0)
    >>> parse_options("openai", {"sample": 4})
    Traceback (most recent call last):
    ...
    cubridge.errors.CubridgeError: proposer options (openai): sample: unknown option
      hint: allowed: samples, max_retries, temperature, top_p, seed, max_tokens, max_model_len, structured, out_dir, worked_example, example_spec, base_url, model, api_key_env, timeout_s, retries, backoff_s, structured_field
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cubridge.errors import CubridgeError
from cubridge.llm.openai_http import STRUCTURED_MODES


@dataclass(frozen=True)
class VLLMOptions:
    model: str = ""                       # local model directory (required)
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    dtype: str = "auto"
    trust_remote_code: bool = False
    ray_actor: bool = False               # run the engine in a Ray actor holding its GPUs (Ray runner)
    start_timeout_s: float = 1800.0       # ray_actor: loading the model (a 70B model from disk takes minutes)
    generate_timeout_s: float = 3600.0    # ray_actor: one batch of requests


@dataclass(frozen=True)
class OpenAIOptions:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = ""                       # served model name; "" = the first one GET /models lists
    api_key_env: str = ""                 # name of an environment variable holding the API key, if any
    timeout_s: float = 300.0              # per request
    retries: int = 3                      # resends on connection errors, 5xx, 429
    backoff_s: float = 1.0                # first backoff; doubles each retry
    structured_field: str = "response_format"   # or structured_outputs (vLLM >= 0.12), guided_json (older)


@dataclass(frozen=True)
class LLMOptions:
    samples: int = 8                      # fresh samples in all (the population), retries not counted
    max_retries: int = 2                  # repairs of one candidate, each fed the previous error
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int = 0                         # request k uses seed + k: reproducible, yet samples differ
    max_tokens: int = 4096
    max_model_len: int = 0                # 0 = ask the backend (vLLM engine config, GET /models)
    structured: bool = True               # constrain answers to the JSON envelope where supported
    out_dir: str = ""                     # where llm-<kind>.jsonl goes; "" = a fresh temporary folder
    worked_example: bool = True           # include the rules proposer's transfer of example_spec
    example_spec: str = "prefixlm"
    backend: Any = field(default=None)    # VLLMOptions or OpenAIOptions


_BACKENDS = {"vllm": VLLMOptions, "openai": OpenAIOptions}


def parse_options(kind: str, options: dict) -> LLMOptions:
    where = f"proposer options ({kind})"
    if kind not in _BACKENDS:
        raise CubridgeError(f"unknown LLM proposer kind {kind!r}", hint="use vllm or openai")
    common = [f.name for f in dataclasses.fields(LLMOptions) if f.name != "backend"]
    own = [f.name for f in dataclasses.fields(_BACKENDS[kind])]
    for key in options:
        if key not in common and key not in own:
            raise CubridgeError(f"{key}: unknown option", where=where, hint=f"allowed: {', '.join(common + own)}")
    backend = _build(_BACKENDS[kind], {k: v for k, v in options.items() if k in own}, where)
    opts = _build(LLMOptions, {k: v for k, v in options.items() if k in common}, where)
    opts = dataclasses.replace(opts, backend=backend)
    _validate(kind, opts, where)
    return opts


def _build(cls, values: dict, where: str):
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = {}
    for key, value in values.items():
        if value is None:               # YAML `key: null` / `key:` means the default
            continue
        want = type(defaults[key])
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
            raise CubridgeError(f"{key}: expected {want.__name__}, got {value!r}", where=where)
        out[key] = value
    return cls(**out)


def _validate(kind: str, o: LLMOptions, where: str) -> None:
    checks = [(o.samples >= 1, "samples must be >= 1"), (o.max_retries >= 0, "max_retries must be >= 0"),
              (o.temperature >= 0, "temperature must be >= 0"), (0 < o.top_p <= 1, "top_p must be in (0, 1]"),
              (o.max_tokens >= 1, "max_tokens must be >= 1"), (o.max_model_len >= 0, "max_model_len must be >= 0")]
    if kind == "vllm":
        checks += [(bool(o.backend.model), "model is required: the path of a local model directory"),
                   (o.backend.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
                   (o.backend.start_timeout_s > 0, "start_timeout_s must be > 0"),
                   (o.backend.generate_timeout_s > 0, "generate_timeout_s must be > 0")]
    else:
        checks += [(o.backend.base_url.startswith(("http://", "https://")), "base_url must start with http:// or https://"),
                   (o.backend.structured_field in STRUCTURED_MODES[:3],
                    f"structured_field must be one of {', '.join(STRUCTURED_MODES[:3])}"),
                   (o.backend.timeout_s > 0, "timeout_s must be > 0"), (o.backend.retries >= 0, "retries must be >= 0")]
    for ok, message in checks:
        if not ok:
            raise CubridgeError(message, where=where)
