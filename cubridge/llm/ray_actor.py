"""vllm.LLM inside a Ray actor that holds the GPUs it needs (for the Ray runner).

When the tuner runs its workers through Ray, the model must not grab GPUs behind Ray's back: the
engine lives in one actor created with `num_gpus=tensor_parallel_size`, so Ray counts those GPUs
as taken and schedules kernel-timing actors on the others. The Ray runner is built first, so it
leaves `tensor_parallel_size` GPUs free (`reserve_gpus`); an engine that still cannot be placed is an
error at once, and every `ray.get` has a timeout whose message says what was waiting on what. Inside the actor the engine's
tensor-parallel workers are plain processes ("mp" executor) over the actor's visible GPUs, so vLLM
does not try to place a second set of Ray workers.

`ray` is imported only when a RayVLLMBackend is built; `vllm` only inside the actor.

Example (on a machine with Ray, vLLM and a GPU; not run by the CPU tests):
    >>> backend = RayVLLMBackend("/models/qwen2.5-coder-32b", tensor_parallel_size=2)  # doctest: +SKIP
"""
from __future__ import annotations

import importlib

from cubridge.errors import CubridgeError
from cubridge.llm.backend import Backend, Reply, Request
from cubridge.llm.vllm_backend import VLLMBackend


class _EngineActor:
    """The actor's body: a VLLMBackend built in the actor process."""

    def __init__(self, model: str, engine_options: dict):
        self.backend = VLLMBackend(model, **engine_options)

    def generate(self, requests):
        return self.backend.generate(requests)

    def max_model_len(self):
        return self.backend.max_model_len()


def import_ray(ray_module=None):
    if ray_module is not None:
        return ray_module
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise CubridgeError("proposer option ray_actor needs the ray package, which is not installed",
                            hint='pip install "cubridge[ray]", or set ray_actor: false to run vLLM in the '
                                 "tuner's process") from None


class RayVLLMBackend(Backend):
    name = "vllm"

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, ray_module=None,
                 start_timeout_s: float = 1800.0, generate_timeout_s: float = 3600.0, **engine_options):
        self.ray = import_ray(ray_module)
        self.model = model            # checked inside the actor, on the node that loads it
        self.generate_timeout_s = generate_timeout_s
        if not self.ray.is_initialized():
            self.ray.init()           # local; a cluster is joined by the Ray runner before this
        options = dict(engine_options, tensor_parallel_size=tensor_parallel_size)
        if tensor_parallel_size > 1:
            options["distributed_executor_backend"] = "mp"
        _check_free_gpus(self.ray, tensor_parallel_size)
        actor_cls = self.ray.remote(num_gpus=tensor_parallel_size)(_EngineActor)
        try:                          # wait for the engine: a bad model path fails here, not later
            self.actor = actor_cls.remote(self.model, options)
            self._max_model_len = self.ray.get(self.actor.max_model_len.remote(), timeout=start_timeout_s)
        except Exception as e:
            if "Timeout" in type(e).__name__:
                raise CubridgeError(f"the vLLM Ray actor did not start within {start_timeout_s:g} s: the tuner was "
                                    f"waiting for it to load {model} on {tensor_parallel_size} GPU(s) "
                                    f"({_gpu_count(self.ray)})",
                                    hint="check `ray status` (are GPUs held by other actors?), the model path, "
                                         "or raise proposer option start_timeout_s") from None
            raise CubridgeError(f"the vLLM Ray actor could not start: {type(e).__name__}: {e}",
                                hint="check the model path on the node, the GPUs Ray sees (ray status) and "
                                     "tensor_parallel_size") from None

    def generate(self, requests: list[Request]) -> list[Reply]:
        try:
            return self.ray.get(self.actor.generate.remote(list(requests)), timeout=self.generate_timeout_s)
        except Exception as e:      # the actor died, hung or the engine failed: these requests fail
            why = (f"no answer within {self.generate_timeout_s:g} s (the proposer waited on the vLLM Ray actor "
                   f"for {len(requests)} request(s); raise generate_timeout_s if the model is just slow)"
                   if "Timeout" in type(e).__name__ else f"{type(e).__name__}: {e}")
            return [Reply(error=f"the vLLM Ray actor failed: {why}") for _ in requests]

    def max_model_len(self) -> int | None:
        return self._max_model_len

    def close(self) -> None:
        self.ray.kill(self.actor)


def _gpu_count(ray) -> str:
    free = getattr(ray, "available_resources", lambda: {})().get("GPU")
    total = getattr(ray, "cluster_resources", lambda: {})().get("GPU")
    return f"Ray has {free or 0:g} of {total or 0:g} GPUs free" if total is not None else "Ray reports no GPUs"


def _check_free_gpus(ray, need: int) -> None:
    """Refuse at once, not after an unbounded wait, when Ray cannot place the engine: its GPUs are
    held (by the timing actors, if the runner took them all) or the cluster has too few."""
    if not hasattr(ray, "cluster_resources"):
        return
    total = ray.cluster_resources().get("GPU", 0)
    free = ray.available_resources().get("GPU", 0)
    if total < need:
        raise CubridgeError(f"the vLLM Ray actor needs {need} GPU(s) (tensor_parallel_size) but the Ray cluster "
                            f"has {total:g}", hint="lower tensor_parallel_size, or add GPUs to the cluster")
    if free < need:
        raise CubridgeError(f"the vLLM Ray actor needs {need} GPU(s) but only {free:g} of {total:g} are free: "
                            "other actors (e.g. the Ray runner's timing workers) hold the rest",
                            hint="start the engine before the timing workers, or let the runner leave its GPUs "
                                 "(cubridge-tune does: RayRunner(reserve_gpus=tensor_parallel_size))")

