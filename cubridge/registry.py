"""Proposer registry: `make_proposer(kind, ctx, options)` for the tuner; kinds register themselves.

Built in: "rules" (cubridge.transfer.proposer). The LLM kinds ("vllm", "openai") live in
cubridge/llm and register when that package is imported, so the core needs no LLM dependency.
"""
from __future__ import annotations

from typing import Callable

from cubridge.errors import CubridgeError

_FACTORIES: dict[str, Callable] = {}


def register(kind: str):
    def deco(factory):
        _FACTORIES[kind] = factory
        return factory
    return deco


def make_proposer(kind: str, ctx, options: dict | None = None):
    if kind not in _FACTORIES:
        _load_builtin(kind)
    if kind not in _FACTORIES:
        raise CubridgeError(f"unknown proposer {kind!r}", hint=f"proposers: {', '.join(sorted(available()))}")
    return _FACTORIES[kind](ctx, dict(options or {}))


def available() -> list[str]:
    for k in ("rules", "llm"):
        _load_builtin(k)
    return sorted(_FACTORIES)


def _load_builtin(kind: str):
    import importlib
    module = "cubridge.transfer.proposer" if kind == "rules" else "cubridge.llm"
    try:
        importlib.import_module(module)
    except ImportError:
        pass
