"""Progress of long work: trials done, best so far, failures by reason.

On a terminal a tqdm bar is redrawn in place (best and failures as its postfix; log lines go above
it through tqdm.write); in CI (the CI variable set) or when the stream is not a terminal, a plain
line is printed at most every `interval_s` seconds (and at the end), so logs stay short and
readable (tqdm's own non-terminal output is a carriage-return stream, unreadable in a CI log).

Example:
    >>> import io
    >>> p = Progress(10, stream=io.StringIO(), interval_s=0)
    >>> p.update(3, best="0.412 ms @ N=8192,B=2", failures={"compile_error": 1})
    >>> p.stream.getvalue()
    'tune: 3/10 trials | best 0.412 ms @ N=8192,B=2 | failed: compile_error 1\\n'
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time


class Progress:
    def __init__(self, total: int, *, stream=None, label: str = "tune", interval_s: float = 30.0,
                 live: bool | None = None):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.interval_s = interval_s
        if live is None:
            live = bool(getattr(self.stream, "isatty", lambda: False)()) and not os.environ.get("CI")
        self.live = live
        self._last = -float("inf")
        self._line = ""
        self._printed = ""
        self._bar = None

    def line(self, done: int, best: str | None, failures: dict) -> str:
        return f"{self.label}: {done}/{self.total} trials | {self._status(best, failures)}"

    @staticmethod
    def _status(best: str | None, failures: dict) -> str:
        fails = ", ".join(f"{k} {v}" for k, v in sorted(failures.items()) if v)
        return f"best {best or '-'}" + (f" | failed: {fails}" if fails else "")

    def update(self, done: int, best: str | None = None, failures: dict | None = None, force: bool = False) -> None:
        self._line = self.line(done, best, failures or {})
        if self.live:
            bar = self._live_bar()
            bar.set_postfix_str(self._status(best, failures or {}), refresh=False)
            bar.update(done - bar.n)
        elif self._line != self._printed and (force or done >= self.total
                                              or time.monotonic() - self._last >= self.interval_s):
            self.stream.write(self._line + "\n")
            self.stream.flush()
            self._last, self._printed = time.monotonic(), self._line

    def _live_bar(self):
        if self._bar is None:
            from tqdm import tqdm   # optuna's dependency; imported only for a terminal
            self._bar = tqdm(total=self.total, desc=self.label, unit="trial", file=self.stream,
                             dynamic_ncols=True, leave=True)
        return self._bar

    def message(self, text: str) -> None:
        """A line of its own, above the live bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
            return
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ProgressHandler(logging.Handler):
    """Sends log records to the current Progress (above its live line), or to a stream when there
    is none (--quiet runs without one): the CLI's one handler for the `cubridge` logger."""

    def __init__(self, stream=None):
        super().__init__()
        self.progress: Progress | None = None
        self.stream = stream if stream is not None else sys.stderr
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        if self.progress is not None:
            self.progress.message(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()


def configure_logging(verbose: bool = False, quiet: bool = False) -> ProgressHandler:
    """The `cubridge` logger at DEBUG (--verbose: every trial), INFO (default: the run's steps) or
    WARNING (--quiet), through one ProgressHandler."""
    logger = logging.getLogger("cubridge")
    for h in [h for h in logger.handlers if isinstance(h, ProgressHandler)]:
        logger.removeHandler(h)
    handler = ProgressHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    logger.propagate = False
    return handler


@contextlib.contextmanager
def logging_for_run(verbose: bool = False, quiet: bool = False):
    """configure_logging for the length of one CLI command, then the `cubridge` logger as it was:
    a handler left behind would keep writing to the stream of a finished command (a closed one,
    when the command ran inside pytest or a notebook cell)."""
    logger = logging.getLogger("cubridge")
    before = (logger.level, logger.propagate)
    handler = configure_logging(verbose=verbose, quiet=quiet)
    try:
        yield handler
    finally:
        handler.progress = None
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]
