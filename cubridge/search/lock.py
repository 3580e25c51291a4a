"""An exclusive lock on a run's output directory: one tuner (fresh or resumed) at a time.

Two tunes started 0.5 s apart on one directory used to both run (a raw Optuna traceback, trial 0
logged twice), and two `--resume` at once measured 57 trials against a budget of 30. The lock is
`flock` on `<output>/.lock`, which holds the holder's pid for the refusal message. The kernel
drops a flock when its process dies (SIGKILL included), so a dead holder's lock is simply taken
over: there is no stale-lock cleanup to get wrong.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with RunLock(d):
    ...     (d / ".lock").read_text().strip() == str(os.getpid())
    True
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from cubridge.config import ConfigError

LOCK_NAME = ".lock"


class RunLock:
    """`with RunLock(out):` or acquire() / release(); a second holder gets a ConfigError naming the
    first's pid (the CLI prints it and exits 2)."""

    def __init__(self, out: Path, where: str | None = None):
        self.out, self.where = Path(out), where
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        for p in (self.out, *self.out.parents):         # "File exists" said nothing of the cause
            if p.exists() and not p.is_dir():
                raise ConfigError(f"{p} is a file, not a directory: the run's output must be a directory",
                                  where=self.where, hint="choose another output directory (--out DIR)")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot create the run's lock file in {self.out}: {e.strerror}",
                              where=self.where, hint="choose a writable output directory (--out DIR)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise ConfigError(f"{self.out} is in use by another tuning run (pid {holder})", where=self.where,
                              hint="wait for it to finish (or stop it), or use --out DIR for a separate run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)      # no pid left behind for a reader to blame
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    # The holder writes its pid right after taking the lock: a reader in between sees nothing yet.
    return text or "unknown, just starting"
