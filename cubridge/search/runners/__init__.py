"""Runners behind cubridge.vocab.Runner: local (spawned processes, default), ray, replay.

`make_runner(kind, ...)` builds one by name; only runners/ray_runner.py imports ray.
"""
from __future__ import annotations

from pathlib import Path

from cubridge.errors import CubridgeError

KINDS = ("local", "ray", "replay")


def make_runner(kind: str, *, address: str | None = None, replay: str | Path | None = None, **options):
    """A runner of `kind`; options go to its constructor (e.g. gpus=0 for local)."""
    if kind == "local":
        from cubridge.search.runners.local import LocalRunner
        return LocalRunner(**options)
    if kind == "ray":
        try:
            from cubridge.search.runners.ray_runner import RayRunner
        except ImportError as e:
            raise CubridgeError(f"the ray runner needs ray ({e})",
                                hint="pip install -e '.[ray]', or --runner local") from None
        return RayRunner(address=address, **options)
    if kind == "replay":
        from cubridge.search.runners.replay import ReplayRunner
        if replay is None:
            raise CubridgeError("the replay runner needs a recorded results file", hint="--replay FILE")
        return ReplayRunner(replay, **options)
    raise CubridgeError(f"unknown runner {kind!r}", hint=f"runners: {', '.join(KINDS)}")
