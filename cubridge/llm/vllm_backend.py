"""vllm.LLM in this process, from a local model directory, fully offline.

`vllm` is an optional extra: importing this module does not import it; building a VLLMBackend
does, and says `pip install "cubridge[vllm]"` when it is missing. The engine never touches the
network: HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 are set before vllm is imported, and the model
must be a local directory (cubridge never downloads weights).

The request building is plain data so it is testable without vllm:
    >>> from cubridge.llm.backend import Sampling
    >>> sampling_kwargs(Sampling(n=4, temperature=0.7, seed=3, max_tokens=512), {"type": "object"})
    {'n': 4, 'temperature': 0.7, 'top_p': 1.0, 'seed': 3, 'max_tokens': 512, 'structured_outputs': {'json': {'type': 'object'}}}
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

from cubridge.errors import CubridgeError
from cubridge.llm.backend import Backend, Completion, Reply, Request, Sampling

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
INSTALL_HINT = 'install the extra: pip install "cubridge[vllm]" (on a machine with a CUDA GPU)'


def sampling_kwargs(s: Sampling, schema: dict | None) -> dict:
    """SamplingParams keyword arguments, every sampling field explicit; the JSON schema as vLLM's
    structured outputs (converted to the installed vllm's class by `make_sampling_params`)."""
    kw = {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed, "max_tokens": s.max_tokens}
    if schema is not None:
        kw["structured_outputs"] = {"json": schema}
    return kw


def make_sampling_params(vllm, kwargs: dict):
    """vllm.SamplingParams from `sampling_kwargs`, for the installed vllm: >= 0.12 takes
    `structured_outputs=StructuredOutputsParams(json=...)`, older ones
    `guided_decoding=GuidedDecodingParams(json=...)`."""
    kw = dict(kwargs)
    structured = kw.pop("structured_outputs", None)
    if structured is not None:
        sp_module = getattr(vllm, "sampling_params", None)
        if hasattr(sp_module, "StructuredOutputsParams"):
            kw["structured_outputs"] = sp_module.StructuredOutputsParams(**structured)
        elif hasattr(sp_module, "GuidedDecodingParams"):
            kw["guided_decoding"] = sp_module.GuidedDecodingParams(**structured)
        else:
            raise CubridgeError("this vllm has neither StructuredOutputsParams nor GuidedDecodingParams",
                                hint='use vllm >= 0.6, or set proposer option structured: "none"')
    return vllm.SamplingParams(**kw)


def engine_kwargs(model: str, *, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                  gpu_memory_utilization: float = 0.85, dtype: str = "auto", seed: int = 0,
                  trust_remote_code: bool = False, distributed_executor_backend: str | None = None) -> dict:
    """vllm.LLM keyword arguments."""
    kw = {"model": model, "tokenizer": model, "tensor_parallel_size": tensor_parallel_size,
          "gpu_memory_utilization": gpu_memory_utilization, "dtype": dtype, "seed": seed,
          "trust_remote_code": trust_remote_code}
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    if distributed_executor_backend is not None:
        kw["distributed_executor_backend"] = distributed_executor_backend
    return kw


def check_model_dir(model: str) -> str:
    path = Path(model).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise CubridgeError(f"model {model!r} is not a local model directory (no config.json there)",
                            where="proposer option model",
                            hint="give the path of a downloaded Hugging Face model directory; cubridge runs "
                                 "vLLM offline and never downloads weights")
    return str(path.resolve())


def import_vllm():
    for k, v in OFFLINE_ENV.items():
        os.environ[k] = v
    try:
        return importlib.import_module("vllm")
    except ImportError as e:
        raise CubridgeError(f"the vllm proposer needs the vllm package, which is not importable ({e})",
                            hint=INSTALL_HINT + '; or run `vllm serve` elsewhere and use proposer: openai') from None


class VLLMBackend(Backend):
    """vllm.LLM in this process. `vllm_module` replaces the real import (tests)."""
    name = "vllm"

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.85, dtype: str = "auto", seed: int = 0,
                 trust_remote_code: bool = False, structured: bool = True,
                 distributed_executor_backend: str | None = None, vllm_module=None):
        self.vllm = vllm_module or import_vllm()
        self.model = check_model_dir(model)
        self.structured = structured
        self.engine_kwargs = engine_kwargs(
            self.model, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, seed=seed,
            trust_remote_code=trust_remote_code, distributed_executor_backend=distributed_executor_backend)
        self.llm = self.vllm.LLM(**self.engine_kwargs)
        self._max_model_len = max_model_len

    def max_model_len(self) -> int | None:
        if self._max_model_len is None:
            try:
                self._max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
            except (AttributeError, TypeError, ValueError):
                return None
        return self._max_model_len

    def generate(self, requests: list[Request]) -> list[Reply]:
        """One batched llm.chat call for all requests (vLLM schedules them together)."""
        if not requests:
            return []
        try:
            params = [make_sampling_params(self.vllm, sampling_kwargs(r.sampling, r.schema if self.structured else None))
                      for r in requests]
            outputs = self.llm.chat([[dict(m) for m in r.messages] for r in requests], sampling_params=params,
                                    use_tqdm=False)
        except Exception as e:       # an engine error fails these requests, not the tuner
            msg = f"vllm.LLM.chat failed: {type(e).__name__}: {e}"
            return [Reply(error=msg) for _ in requests]
        return [Reply([Completion(o.text, getattr(o, "finish_reason", None)) for o in out.outputs])
                for out in outputs]
