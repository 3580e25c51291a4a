"""The default runner: one spawned worker process per GPU (one CPU worker when there is none).

Each worker owns one GPU through CUDA_VISIBLE_DEVICES, set before it touches CUDA, and talks to
the driver over its own pipe, so a worker that dies takes no shared queue or lock with it. A job
that kills its worker (a fault, os.abort), or runs past its timeout (the worker is killed), comes
back as CRASH / TIMEOUT and the worker is restarted; a job that raises is caught in the worker
(cubridge.search.jobs.run_job). Spawn, not fork: a forked CUDA context is unusable, and a fresh
interpreter carries no state of the driver.

The driver side has no thread: dispatch, timeouts and restarts happen inside submit() and
results(), which the tuner calls in its loop.

Example:
    >>> from cubridge.vocab import Job
    >>> with LocalRunner(gpus=0) as r:                                   # doctest: +SKIP
    ...     r.submit([Job("echo", {"x": 1}, needs_gpu=False)])
    ...     [res.data for res in r.results(timeout_s=60)]
    [{'x': 1}]
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import deque
from multiprocessing.connection import wait

from cubridge.vocab import Job, JobResult, Outcome, Runner, TrialState

BOOT_TIMEOUT_S = 120.0       # a worker that has not said "ready" by then is replaced


def visible_gpus() -> list[str]:
    """Device ids for the workers, honouring the driver's own CUDA_VISIBLE_DEVICES."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import torch
        count = torch.cuda.device_count()
    except Exception:   # noqa: BLE001 - no torch CUDA: no GPU
        count = 0
    if env is not None:
        ids = [x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1"]
        return ids[:count] if count else []
    return [str(i) for i in range(count)]


def _worker_main(conn, device: str | None, name: str) -> None:
    # Before anything can initialise CUDA: this worker sees only its own GPU (or none).
    os.environ["CUDA_VISIBLE_DEVICES"] = device if device is not None else ""
    from cubridge.search.jobs import run_job
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        result = run_job(job, worker=name)
        try:
            conn.send(("result", result))
        except Exception as e:   # noqa: BLE001 - e.g. data that does not pickle
            conn.send(("result", JobResult(job, Outcome(TrialState.CRASH, f"result could not be sent: {e}"), {}, name)))


class _Worker:
    def __init__(self, ctx, device: str | None, name: str):
        self.device, self.name = device, name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, device, name), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.job: Job | None = None
        self.deadline = 0.0

    def send(self, job: Job) -> None:
        self.job = job
        self.conn.send(job)
        self.deadline = time.monotonic() + job.timeout_s if self.ready else self.started + BOOT_TIMEOUT_S + job.timeout_s

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class LocalRunner(Runner):
    def __init__(self, gpus: int | None = None):
        """`gpus`: how many GPU workers (default: every visible GPU); 0 gives one CPU worker."""
        ids = visible_gpus()
        ids = ids if gpus is None else ids[:gpus]
        self._gpus = len(ids)
        self._ctx = mp.get_context("spawn")
        slots = ids or [None]
        self._workers = [self._start(dev, i) for i, dev in enumerate(slots)]
        self._pending: deque[Job] = deque()
        self._done: list[JobResult] = []
        self._closed = False

    def _start(self, device, index) -> _Worker:
        return _Worker(self._ctx, device, f"local-{'gpu' + device if device is not None else 'cpu'}-{index}")

    def __repr__(self) -> str:
        return f"LocalRunner({self._gpus} GPU workers)" if self._gpus else "LocalRunner(1 CPU worker)"

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def num_gpus(self) -> int:
        return self._gpus

    def submit(self, jobs: list[Job]) -> None:
        if self._closed:
            raise RuntimeError("runner is closed")
        self._pending.extend(jobs)
        self._dispatch()

    def results(self, timeout_s: float | None = None) -> list[JobResult]:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._dispatch()
            self._collect()
            if self._done:
                out, self._done = self._done, []
                return out
            busy = [w for w in self._workers if w.job is not None]
            if not busy and not self._pending:
                return []
            now = time.monotonic()
            if end is not None and now >= end:
                return []
            wake = min([w.deadline for w in busy] + ([end] if end is not None else []), default=now + 1.0)
            handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            wait(handles, timeout=max(0.0, min(wake - now, 5.0)))

    def _dispatch(self) -> None:
        for i, w in enumerate(self._workers):
            if w.job is None and self._pending:
                job = self._pending.popleft()
                try:
                    w.send(job)
                except (OSError, BrokenPipeError):
                    self._pending.appendleft(job)
                    w.job = None
                    self._replace(i)

    def _collect(self) -> None:
        for i, w in enumerate(self._workers):
            try:
                while w.conn.poll():
                    tag, msg = w.conn.recv()
                    if tag == "ready":
                        w.ready = True
                        if w.job is not None:
                            w.deadline = time.monotonic() + w.job.timeout_s
                    elif tag == "result":
                        w.job = None
                        self._done.append(msg)
                        if msg.data.get("restart_worker"):
                            self._replace(i)
                            break
            except (EOFError, OSError):
                pass   # the worker died: found below by its exit code
            w = self._workers[i]
            if not w.proc.is_alive():
                self._fail(i, TrialState.CRASH, f"worker {w.name} {_death(w.proc.exitcode)} while running the job")
            elif w.job is not None and time.monotonic() > w.deadline:
                limit = f"{w.job.timeout_s:g} s" if w.ready else f"{w.job.timeout_s:g} s + {BOOT_TIMEOUT_S:g} s start-up"
                self._fail(i, TrialState.TIMEOUT, f"job ran past its timeout ({limit}); worker {w.name} killed")

    def _fail(self, i: int, state: TrialState, reason: str) -> None:
        w = self._workers[i]
        if w.job is not None:
            self._done.append(JobResult(w.job, Outcome(state, reason), {}, w.name))
            w.job = None
        self._replace(i)

    def _replace(self, i: int) -> None:
        old = self._workers[i]
        old.kill()
        self._workers[i] = self._start(old.device, i)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                if w.proc.is_alive() and w.job is None:
                    w.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
