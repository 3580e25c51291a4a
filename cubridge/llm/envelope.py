"""The answer envelopes the model is asked for, as JSON schemas, and a tolerant reader.

Where the backend supports structured outputs the answer is constrained to the schema; elsewhere
(or when a model ignores it) `read_envelope` also accepts the JSON inside a ```json fence or after
some prose, and, failing that, the task's fenced block (```cuir for a program). A reasoning
model's <think>...</think> preamble is dropped first. A cut-off answer (finish_reason "length") is
refused outright: half a program is never worth parsing.

Example:
    >>> read_envelope('{"cuir": "kernel(\\'k\\')", "notes": "none"}', "stop", TRANSFER)["cuir"]
    "kernel('k')"
    >>> read_envelope("Here:\\n```cuir\\nkernel('k')\\n```", "stop", TRANSFER)["cuir"]
    "kernel('k')\\n"
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from cubridge.errors import CubridgeError


@dataclass(frozen=True)
class Envelope:
    """A task's answer format: the JSON schema, its required string field, and the fence
    languages whose block can stand in for that field."""
    schema: dict
    main: str                       # the field that carries the artifact ("cuir", "regions")
    fences: tuple[str, ...] = ()


def _schema(title: str, props: dict, required) -> dict:
    return {"title": title, "type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}


TRANSFER = Envelope(_schema("cuir_transfer", {
    "cuir": {"type": "string", "description": "the whole target CuIR program"},
    "notes": {"type": "string", "description": "what changed and why, one paragraph"}}, ("cuir", "notes")),
    "cuir", ("cuir", "python", "py", ""))

LIFT = Envelope(_schema("cuir_lift", {
    "cuir": {"type": "string", "description": "the CuIR program of the CUDA kernel"},
    "regions": {"type": "object", "description": "region name -> [first line, last line] in the CUDA source",
                "additionalProperties": {"type": "array", "items": {"type": "integer"},
                                         "minItems": 2, "maxItems": 2}},
    "notes": {"type": "string"}}, ("cuir", "regions", "notes")),
    "cuir", ("cuir", "python", "py"))

LOWER = Envelope(_schema("cuda_region_patch", {
    "regions": {"type": "object", "description": "region name -> the new CUDA lines between its markers",
                "additionalProperties": {"type": "string"}},
    "notes": {"type": "string"}}, ("regions", "notes")),
    "regions", ())


class EnvelopeError(CubridgeError):
    """The answer holds no readable envelope (or was cut off)."""


_THINK = re.compile(r"<think>.*?</think>", re.S)
_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def read_envelope(text: str, finish_reason: str | None, env: Envelope, max_tokens: int | None = None) -> dict:
    """The answer's fields; raises EnvelopeError saying what was expected."""
    if finish_reason == "length":
        raise EnvelopeError(f"the answer was cut off at max_tokens{'=' + str(max_tokens) if max_tokens else ''} "
                            "(finish_reason 'length') before it was complete",
                            hint="answer with the envelope only, no commentary before it; or raise the proposer's "
                                 "max_tokens")
    text = _THINK.sub("", text or "").strip()
    if not text:
        raise EnvelopeError("the answer is empty", hint=_expected(env))
    obj = _json_object(text)
    if obj is not None and env.main in obj:
        return _typed(obj, env)
    # A JSON object without the field may be part of the program itself (a transfer records its
    # spec parameters as JSON in the docstring), so the task's fenced block still counts.
    for lang, body in _FENCE.findall(text):
        if lang.lower() in env.fences:
            return {env.main: body, "notes": _FENCE.sub("", text).strip()}
    if obj is not None:
        raise EnvelopeError(f"the JSON answer has no {env.main!r} field (fields: {', '.join(map(str, obj)) or 'none'})",
                            hint=_expected(env))
    raise EnvelopeError("no answer envelope found: the text is neither JSON nor holds a fenced block",
                        hint=_expected(env))


def _expected(env: Envelope) -> str:
    fields = ", ".join(f'"{k}": ...' for k in env.schema["properties"])
    alt = f", or a ```{env.fences[0]} fenced block" if env.fences else ""
    return f"answer with one JSON object {{{fields}}}{alt}"


def _json_object(text: str):
    candidates = [text]
    for lang, body in _FENCE.findall(text):
        if lang.lower() in ("json", ""):
            candidates.append(body)
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{"):text.rindex("}") + 1])
    for c in candidates:
        try:
            obj = json.loads(c)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def _typed(obj: dict, env: Envelope) -> dict:
    for key, prop in env.schema["properties"].items():
        if key not in obj:
            continue
        want = {"string": str, "object": dict, "array": list}[prop["type"]]
        if not isinstance(obj[key], want):
            raise EnvelopeError(f"field {key!r} is a {type(obj[key]).__name__}, not a {prop['type']}",
                                hint=_expected(env))
    return obj
