"""Ray runner: one actor per GPU (num_gpus=1; CPU actors when the cluster has no GPU), and plain
CPU tasks for jobs that need no GPU (screening, compilation). The only module that imports ray.

`ray.init()` starts a local instance (no dashboard) unless `address` names a cluster ("auto", or
ray://host:10001); under `ray job submit` RAY_ADDRESS is set and `address="auto"` joins it. Actors
restart on failure (max_restarts); a job whose actor dies comes back as CRASH, one past its timeout
as TIMEOUT (the actor is killed and replaced, a task is cancelled). Only the driver writes the
study and the trial log: workers just return JobResults.

Example:
    >>> from cubridge.vocab import Job
    >>> r = RayRunner(num_cpus=2)                                        # doctest: +SKIP
    >>> r.submit([Job("echo", {"x": 1}, needs_gpu=False)])              # doctest: +SKIP
    >>> r.results(timeout_s=60)[0].data                                  # doctest: +SKIP
    {'x': 1}
"""
from __future__ import annotations

import time
from collections import deque

import ray
from ray.exceptions import (GetTimeoutError, RayActorError, RayError, TaskCancelledError,
                            WorkerCrashedError)

from cubridge.vocab import Job, JobResult, Outcome, Runner, TrialState

MAX_RESTARTS = 8
ACTOR_START_TIMEOUT_S = 300.0      # placing the worker actors (a cold node starts worker processes)


class _Worker:
    """Actor body: runs jobs in its own process; its GPU is the one Ray assigned."""

    def __init__(self, name: str):
        self.name = name

    def run(self, job: Job) -> JobResult:
        from cubridge.search.jobs import run_job
        return run_job(job, worker=self.name)

    def ready(self) -> str:
        return self.name


def _run_task(job: Job, name: str) -> JobResult:
    from cubridge.search.jobs import run_job
    return run_job(job, worker=name)


class RayRunner(Runner):
    def __init__(self, address: str | None = None, *, num_cpus: int | None = None, gpus: int | None = None,
                 object_store_memory: int | None = None, max_restarts: int = MAX_RESTARTS, reserve_gpus: int = 0):
        """`reserve_gpus`: GPUs left free for others (the vLLM engine actor, which is created after the
        runner: taking every GPU here deadlocked it)."""
        self._started = False
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, num_cpus=num_cpus, object_store_memory=object_store_memory,
                         log_to_driver=False)
                self._started = True
        cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
        if reserve_gpus and cluster_gpus and reserve_gpus >= cluster_gpus:
            from cubridge.errors import CubridgeError
            if self._started:
                ray.shutdown()
            raise CubridgeError(f"the Ray cluster has {cluster_gpus} GPU(s): the vLLM engine takes {reserve_gpus} "
                                "and timing needs at least one more",
                                hint="add GPUs, lower the proposer's tensor_parallel_size, or use proposer kind openai")
        usable = cluster_gpus - reserve_gpus if cluster_gpus else 0
        self._gpus = usable if gpus is None else min(gpus, usable)
        self._max_restarts = max_restarts
        self._actors = [self._new_actor(i) for i in range(max(1, self._gpus))]
        self._wait_placed()
        self._busy: dict[int, tuple] = {}                  # actor index -> (ref, job, deadline)
        self._tasks: dict = {}                             # ref -> (job, deadline)
        self._task = ray.remote(num_cpus=1, max_retries=0)(_run_task)
        self._cpu_slots = max(1, int(ray.cluster_resources().get("CPU", 1)) - (0 if self._gpus else 1))
        self._pending_gpu: deque[Job] = deque()
        self._pending_cpu: deque[Job] = deque()
        self._done: list[JobResult] = []
        self._closed = False

    def _wait_placed(self) -> None:
        """Actors are placed asynchronously: wait until they hold their GPUs, so that what comes next
        (the vLLM engine actor) sees the GPUs that are really free, and a runner that cannot be
        placed says so instead of hanging its first job."""
        try:
            ray.get([a.ready.remote() for a in self._actors], timeout=ACTOR_START_TIMEOUT_S)
        except GetTimeoutError:
            from cubridge.errors import CubridgeError
            raise CubridgeError(f"the Ray runner's {len(self._actors)} worker actor(s) were not placed within "
                                f"{ACTOR_START_TIMEOUT_S:g} s (Ray has {ray.available_resources().get('GPU', 0):g} "
                                f"of {ray.cluster_resources().get('GPU', 0):g} GPUs free)",
                                hint="check `ray status`: other jobs may hold the GPUs") from None

    def __repr__(self) -> str:
        return f"RayRunner({self._gpus} GPU actors)" if self._gpus else "RayRunner(1 CPU actor)"

    def _name(self, i: int) -> str:
        return f"ray-gpu-{i}" if self._gpus else f"ray-cpu-{i}"

    def _new_actor(self, i: int):
        resources = {"num_gpus": 1, "num_cpus": 0} if self._gpus else {"num_cpus": 1}
        cls = ray.remote(max_restarts=self._max_restarts, max_task_retries=0, **resources)(_Worker)
        return cls.remote(self._name(i))

    @property
    def num_workers(self) -> int:
        return len(self._actors)

    @property
    def num_gpus(self) -> int:
        return self._gpus

    def submit(self, jobs: list[Job]) -> None:
        if self._closed:
            raise RuntimeError("runner is closed")
        for job in jobs:
            (self._pending_gpu if job.needs_gpu else self._pending_cpu).append(job)
        self._dispatch()

    def _dispatch(self) -> None:
        now = time.monotonic()
        for i, actor in enumerate(self._actors):
            if i not in self._busy and self._pending_gpu:
                job = self._pending_gpu.popleft()
                self._busy[i] = (actor.run.remote(job), job, now + job.timeout_s)
        while self._pending_cpu and len(self._tasks) < self._cpu_slots:
            job = self._pending_cpu.popleft()
            self._tasks[self._task.remote(job, "ray-task")] = (job, now + job.timeout_s)

    def results(self, timeout_s: float | None = None) -> list[JobResult]:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._dispatch()
            refs = [ref for ref, _, _ in self._busy.values()] + list(self._tasks)
            if not refs and not self._done:
                return []
            deadlines = [d for _, _, d in self._busy.values()] + [d for _, d in self._tasks.values()]
            now = time.monotonic()
            wake = min(deadlines + ([end] if end is not None else []))
            ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, min(wake - now, 5.0))) if refs else ([], [])
            for ref in ready:
                self._finish(ref)
            self._expire()
            if self._done:
                out, self._done = self._done, []
                return out
            if end is not None and time.monotonic() >= end:
                return []

    def _finish(self, ref) -> None:
        actor_i = next((i for i, (r, _, _) in self._busy.items() if r == ref), None)
        job = self._busy.pop(actor_i)[1] if actor_i is not None else self._tasks.pop(ref)[0]
        name = self._name(actor_i) if actor_i is not None else "ray-task"
        try:
            result = ray.get(ref, timeout=0)
        except (RayActorError, WorkerCrashedError) as e:
            why = f"{name} died while running the job: {_first_line(e)}"
            result = JobResult(job, Outcome(TrialState.CRASH, why), {}, name)
            if actor_i is not None:
                # A fresh actor takes its place at once: a job sent to the restarting one could reach
                # the dead worker before Ray notices (seen under load: the next job came back CRASH).
                self._replace(actor_i)
        except TaskCancelledError:
            result = JobResult(job, Outcome(TrialState.TIMEOUT, "task cancelled"), {}, name)
        except (RayError, GetTimeoutError) as e:
            result = JobResult(job, Outcome(TrialState.CRASH, f"{name}: {type(e).__name__}: {_first_line(e)}"), {}, name)
        self._done.append(result)
        if actor_i is not None and result.data.get("restart_worker"):
            self._replace(actor_i)

    def _expire(self) -> None:
        now = time.monotonic()
        for i, (ref, job, deadline) in list(self._busy.items()):
            if now > deadline:
                del self._busy[i]
                why = f"job ran past its timeout ({job.timeout_s:g} s); actor {self._name(i)} killed"
                self._done.append(JobResult(job, Outcome(TrialState.TIMEOUT, why), {}, self._name(i)))
                self._replace(i)
        for ref, (job, deadline) in list(self._tasks.items()):
            if now > deadline:
                del self._tasks[ref]
                ray.cancel(ref, force=True)
                why = f"task ran past its timeout ({job.timeout_s:g} s); cancelled"
                self._done.append(JobResult(job, Outcome(TrialState.TIMEOUT, why), {}, "ray-task"))

    def _replace(self, i: int) -> None:
        # Killed on purpose (timeout, CUDA fault) or out of restarts: a fresh actor takes the slot at
        # once; a restarting one would fail the next job sent to it while it is still going down.
        ray.kill(self._actors[i], no_restart=True)
        self._actors[i] = self._new_actor(i)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except RayError:
                pass
        if self._started:
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
