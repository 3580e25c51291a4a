"""The in-process vLLM backend and its Ray actor wrapper, without vllm or ray: request building is
checked on the plain dicts it builds, and the backend's calls on stand-in modules that record what
they were given (vllm.LLM kwargs, SamplingParams, structured outputs, the actor's GPUs). A real
vllm run is tested only where vllm is importable and a local model directory is named."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cubridge.errors import CubridgeError
from cubridge.llm.backend import Request, Sampling
from cubridge.llm.envelope import TRANSFER
from cubridge.llm.vllm_backend import (VLLMBackend, engine_kwargs, import_vllm, make_sampling_params,
                                       sampling_kwargs)
from cubridge.vocab import TrialState
from cubridge.registry import make_proposer
from cubridge.search.screen import ScreenContext, screen
from cubridge.transfer.proposer import RulesProposer
from cubridge.verify import Case

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SCHEMA = TRANSFER.schema


# ------------------------------------------------------------------ stand-ins
class _Recorded:
    def __init__(self, **kw):
        self.kw = kw


def fake_vllm(answers=(), new_api: bool = True, fail: bool = False) -> types.ModuleType:
    """A module shaped like vllm: LLM records its kwargs and chat() calls and answers `answers`."""
    mod = types.ModuleType("vllm")
    sp = types.ModuleType("vllm.sampling_params")
    if new_api:
        sp.StructuredOutputsParams = type("StructuredOutputsParams", (_Recorded,), {})
    else:
        sp.GuidedDecodingParams = type("GuidedDecodingParams", (_Recorded,), {})
    mod.sampling_params = sp
    mod.SamplingParams = type("SamplingParams", (_Recorded,), {})
    queue = list(answers)
    mod.engines = []

    class LLM:
        def __init__(self, **kw):
            self.kw, self.calls = kw, []
            cfg = types.SimpleNamespace(max_model_len=kw.get("max_model_len", 32768))
            self.llm_engine = types.SimpleNamespace(model_config=cfg)
            mod.engines.append(self)

        def chat(self, conversations, sampling_params=None, use_tqdm=True):
            self.calls.append((conversations, sampling_params))
            if fail:
                raise RuntimeError("CUDA out of memory")
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text=queue.pop(0), finish_reason="stop")
                                                   for _ in range(sp.kw["n"])])
                    for sp in sampling_params]

    mod.LLM = LLM
    return mod


class FakeRay(types.ModuleType):
    """ray.remote(num_gpus=...)(cls).remote(...) builds the actor in this process; ray.get is identity."""

    def __init__(self):
        super().__init__("ray")
        self.started, self.remote_kwargs, self.killed = False, None, []

    def is_initialized(self):
        return self.started

    def init(self, **_):
        self.started = True

    def remote(self, **kw):
        self.remote_kwargs = kw

        def wrap(cls):
            def build(*a, **k):
                obj = cls(*a, **k)
                return types.SimpleNamespace(**{name: types.SimpleNamespace(remote=getattr(obj, name))
                                                for name in ("generate", "max_model_len")}, obj=obj)
            return types.SimpleNamespace(remote=build)
        return wrap

    def get(self, value, timeout=None):
        self.timeouts = getattr(self, "timeouts", []) + [timeout]
        return value

    def kill(self, actor):
        self.killed.append(actor)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


# ------------------------------------------------------------------ request building (plain dicts)
def test_sampling_kwargs_are_explicit():
    kw = sampling_kwargs(Sampling(n=5, temperature=0.2, top_p=0.9, seed=42, max_tokens=1234), SCHEMA)
    assert kw == {"n": 5, "temperature": 0.2, "top_p": 0.9, "seed": 42, "max_tokens": 1234,
                  "structured_outputs": {"json": SCHEMA}}
    assert "structured_outputs" not in sampling_kwargs(Sampling(), None)


@pytest.mark.parametrize("new_api, field, cls", [(True, "structured_outputs", "StructuredOutputsParams"),
                                                 (False, "guided_decoding", "GuidedDecodingParams")])
def test_sampling_params_for_new_and_old_vllm(new_api, field, cls):
    params = make_sampling_params(fake_vllm(new_api=new_api), sampling_kwargs(Sampling(n=2, seed=1), SCHEMA))
    assert type(params).__name__ == "SamplingParams" and params.kw["n"] == 2 and params.kw["seed"] == 1
    assert type(params.kw[field]).__name__ == cls and params.kw[field].kw == {"json": SCHEMA}


def test_sampling_params_without_structured_outputs_support():
    mod = fake_vllm()
    mod.sampling_params = types.ModuleType("vllm.sampling_params")
    with pytest.raises(CubridgeError, match="neither StructuredOutputsParams"):
        make_sampling_params(mod, sampling_kwargs(Sampling(), SCHEMA))
    assert make_sampling_params(mod, sampling_kwargs(Sampling(), None)).kw["n"] == 1


def test_engine_kwargs():
    kw = engine_kwargs("/m", tensor_parallel_size=4, max_model_len=16384, seed=3)
    assert kw == {"model": "/m", "tokenizer": "/m", "tensor_parallel_size": 4, "gpu_memory_utilization": 0.85,
                  "dtype": "auto", "seed": 3, "trust_remote_code": False, "max_model_len": 16384}
    assert engine_kwargs("/m", distributed_executor_backend="mp")["distributed_executor_backend"] == "mp"


# ------------------------------------------------------------------ the backend on a stand-in vllm
def test_backend_builds_the_engine_and_batches_requests(model_dir):
    mod = fake_vllm(["a", "b", "c"])
    b = VLLMBackend(str(model_dir), tensor_parallel_size=2, max_model_len=8192, vllm_module=mod)
    [engine] = mod.engines
    assert engine.kw["model"] == str(model_dir.resolve()) and engine.kw["tensor_parallel_size"] == 2
    msgs = ({"role": "user", "content": "hi"},)
    replies = b.generate([Request(msgs, Sampling(n=2, seed=5), SCHEMA), Request(msgs, Sampling(n=1, seed=6), None)])
    assert [[c.text for c in r.completions] for r in replies] == [["a", "b"], ["c"]]
    [(convs, params)] = engine.calls                       # one batched chat() call
    assert convs == [[{"role": "user", "content": "hi"}]] * 2
    assert params[0].kw["structured_outputs"].kw == {"json": SCHEMA} and "structured_outputs" not in params[1].kw
    assert b.max_model_len() == 8192


def test_engine_failure_fails_the_requests_not_the_caller(model_dir):
    b = VLLMBackend(str(model_dir), vllm_module=fake_vllm(fail=True))
    [r] = b.generate([Request(({"role": "user", "content": "x"},), Sampling())])
    assert r.completions == [] and "CUDA out of memory" in r.error


def test_model_must_be_a_local_directory(tmp_path):
    with pytest.raises(CubridgeError, match="not a local model directory") as e:
        VLLMBackend(str(tmp_path / "Qwen/Qwen2.5-7B"), vllm_module=fake_vllm())
    assert "never downloads" in e.value.hint


def test_import_sets_offline_mode(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    mod = fake_vllm()
    monkeypatch.setitem(sys.modules, "vllm", mod)
    assert import_vllm() is mod
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"


def test_missing_vllm_says_how_to_install(monkeypatch, tmp_path, model_dir):
    monkeypatch.setitem(sys.modules, "vllm", None)           # import vllm -> ImportError
    ctx = ScreenContext.build("fa2_sm80", "causal", quick=True)
    with pytest.raises(CubridgeError, match="needs the vllm package") as e:
        make_proposer("vllm", ctx, {"model": str(model_dir), "out_dir": str(tmp_path)})
    assert 'pip install "cubridge[vllm]"' in e.value.hint and "proposer: openai" in e.value.hint


def test_vllm_proposer_end_to_end_on_a_stand_in(monkeypatch, tmp_path, model_dir):
    ctx = dataclasses.replace(ScreenContext.build("fa2_sm80", "causal"), cases=[Case(1, 2, 1, 70, 70, 32, 0)])
    good = RulesProposer(ctx).ask(1)[0].text
    import json
    mod = fake_vllm([json.dumps({"cuir": good, "notes": "n"}), "no envelope here"])
    monkeypatch.setitem(sys.modules, "vllm", mod)
    p = make_proposer("vllm", ctx, {"model": str(model_dir), "tensor_parallel_size": 2, "samples": 2,
                                    "seed": 9, "max_retries": 0, "out_dir": str(tmp_path / "out")})
    props = p.ask(2)
    assert len(props) == 1 and props[0].origin == "vllm"
    p.tell(props[0], screen(props[0], ctx, p.binder(props[0])))
    assert sorted(r.state.value for r in p.records) == ["rejected_parse", "verified"]
    [engine] = mod.engines
    assert engine.kw["tensor_parallel_size"] == 2 and engine.kw["seed"] == 9
    [(_, [params])] = engine.calls
    assert params.kw["n"] == 2 and params.kw["seed"] == 9 and params.kw["structured_outputs"].kw["json"] == SCHEMA
    assert (tmp_path / "out" / "llm-vllm.jsonl").exists()


# ------------------------------------------------------------------ the Ray actor wrapper
def test_ray_actor_holds_the_gpus_it_needs(monkeypatch, model_dir):
    from cubridge.llm.ray_actor import RayVLLMBackend
    mod = fake_vllm(["x"])
    monkeypatch.setitem(sys.modules, "vllm", mod)
    ray = FakeRay()
    b = RayVLLMBackend(str(model_dir), tensor_parallel_size=2, ray_module=ray, max_model_len=4096)
    assert ray.started and ray.remote_kwargs == {"num_gpus": 2}
    [engine] = mod.engines                                 # built inside the actor
    assert engine.kw["distributed_executor_backend"] == "mp" and engine.kw["tensor_parallel_size"] == 2
    assert b.max_model_len() == 4096
    [r] = b.generate([Request(({"role": "user", "content": "x"},), Sampling())])
    assert r.completions[0].text == "x"
    b.close()
    assert ray.killed


def test_ray_actor_that_cannot_start_is_an_error(monkeypatch, tmp_path):
    from cubridge.llm.ray_actor import RayVLLMBackend
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())
    with pytest.raises(CubridgeError, match="could not start"):
        RayVLLMBackend(str(tmp_path / "missing"), ray_module=FakeRay())


def test_missing_ray_says_how_to_install(monkeypatch, tmp_path, model_dir):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())
    monkeypatch.setitem(sys.modules, "ray", None)            # import ray -> ImportError
    ctx = ScreenContext.build("fa2_sm80", "causal", quick=True)
    with pytest.raises(CubridgeError, match="needs the ray package") as e:
        make_proposer("vllm", ctx, {"model": str(model_dir), "ray_actor": True, "out_dir": str(tmp_path)})
    assert 'pip install "cubridge[ray]"' in e.value.hint


def test_importing_the_llm_package_imports_no_optional_dependency():
    code = ("import sys, cubridge.llm, cubridge.llm.ray_actor\n"
            "from cubridge.registry import available\n"
            "assert {'vllm', 'openai'} <= set(available())\n"
            "bad = [m for m in ('vllm', 'ray', 'openai', 'requests', 'httpx') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# ------------------------------------------------------------------ real vllm, where it exists
REAL_VLLM_SKIP = ("vllm is not installed (optional extra: pip install \"cubridge[vllm]\", needs a CUDA GPU)"
                  if not HAVE_VLLM else None if os.environ.get("CUBRIDGE_TEST_VLLM_MODEL") else
                  "set CUBRIDGE_TEST_VLLM_MODEL to a local instruct model directory to run vllm for real")


@pytest.mark.skipif(REAL_VLLM_SKIP is not None, reason=REAL_VLLM_SKIP or "")
def test_real_vllm_answers_in_the_envelope():
    b = VLLMBackend(os.environ["CUBRIDGE_TEST_VLLM_MODEL"], max_model_len=4096, gpu_memory_utilization=0.5)
    msgs = ({"role": "user", "content": 'Answer {"cuir": "kernel(\'k\')", "notes": "ok"} exactly.'},)
    [r] = b.generate([Request(msgs, Sampling(n=2, temperature=0.0, seed=0, max_tokens=64), SCHEMA)])
    assert r.error is None and len(r.completions) == 2
    from cubridge.llm.envelope import read_envelope
    for c in r.completions:
        assert "cuir" in read_envelope(c.text, c.finish_reason, TRANSFER)
    assert TrialState.VERIFIED.value == "verified"
