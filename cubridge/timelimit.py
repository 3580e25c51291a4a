"""Run user code (a spec's reference()) under a time limit, with an error that names it.

A reference() that never returned hung `verify-ir` for ever and cost the tuner its whole job
timeout (300 s) with no word of the cause. In the main thread the limit is a SIGALRM timer whose
handler raises inside the user's code, so a Python loop or a sleep is stopped and nothing keeps
running; elsewhere (worker threads) the call runs in a daemon thread and is abandoned at the limit.

Example:
    >>> call_with_limit(lambda: 41 + 1, 5.0, "reference()")
    42
"""
from __future__ import annotations

import signal
import threading
import time

from cubridge.errors import CubridgeError


class TimeLimitError(CubridgeError):
    """User code ran past its time limit."""


def call_with_limit(fn, seconds: float, what: str, *, where: str | None = None, hint: str | None = None):
    hint = hint or "make it finish (it runs at every verification shape), or raise the limit"
    message = f"{what} did not return within {seconds:g} s"
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _with_alarm(fn, seconds, message, where, hint)
    return _with_thread(fn, seconds, message, where, hint)


class _Expired(BaseException):
    """Raised by the alarm inside the user's code; a BaseException so `except Exception` there
    cannot swallow it."""


def _with_alarm(fn, seconds, message, where, hint):
    def on_alarm(signum, frame):
        raise _Expired()
    old = signal.signal(signal.SIGALRM, on_alarm)
    prev_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        return fn()
    except _Expired:
        raise TimeLimitError(message, where=where, hint=hint) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if prev_left:       # an outer timer was running: give it back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(prev_left - (time.monotonic() - start), 1e-3))


def _with_thread(fn, seconds, message, where, hint):
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:      # handed to the caller below
            box["error"] = e
    t = threading.Thread(target=target, daemon=True, name="cubridge-time-limit")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeLimitError(message, where=where, hint=hint)
    if "error" in box:
        raise box["error"]
    return box["value"]
