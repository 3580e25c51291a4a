"""vllm.LLM inside a Ray actor that holds the GPUs it needs (for the Ray runner).

When the tuner runs its workers through Ray, the model must not grab GPUs behind Ray's back: the
engine lives in one actor created with `num_gpus=tensor_parallel_size`, so Ray counts those GPUs
as taken and schedules kernel-timing actors on the others. Inside the actor the engine's
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

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, ray_module=None, **engine_options):
        self.ray = import_ray(ray_module)
        self.model = model            # checked inside the actor, on the node that loads it
        if not self.ray.is_initialized():
            self.ray.init()           # local; a cluster is joined by the Ray runner before this
        options = dict(engine_options, tensor_parallel_size=tensor_parallel_size)
        if tensor_parallel_size > 1:
            options["distributed_executor_backend"] = "mp"
        actor_cls = self.ray.remote(num_gpus=tensor_parallel_size)(_EngineActor)
        try:                          # wait for the engine: a bad model path fails here, not later
            self.actor = actor_cls.remote(self.model, options)
            self._max_model_len = self.ray.get(self.actor.max_model_len.remote())
        except Exception as e:
            raise CubridgeError(f"the vLLM Ray actor could not start: {type(e).__name__}: {e}",
                                hint="check the model path on the node, the GPUs Ray sees (ray status) and "
                                     "tensor_parallel_size") from None

    def generate(self, requests: list[Request]) -> list[Reply]:
        try:
            return self.ray.get(self.actor.generate.remote(list(requests)))
        except Exception as e:      # the actor died or the engine failed: these requests fail
            return [Reply(error=f"the vLLM Ray actor failed: {type(e).__name__}: {e}") for _ in requests]

    def max_model_len(self) -> int | None:
        return self._max_model_len

    def close(self) -> None:
        self.ray.kill(self.actor)
