"""The Ray runner and the vLLM engine actor do not deadlock over GPUs (issue 20).

The runner is built first; it used to take every GPU for its timing actors, and the engine actor,
asking for tensor_parallel_size GPUs, waited for ever in a ray.get without a timeout. On a real
local Ray instance with two fake GPUs (`ray.init(num_gpus=2)`, no GPU needed): a runner that takes
both makes the engine fail at once with a message naming who holds them; a runner that reserves the
engine's GPUs leaves them free and the engine actor is placed (it then fails only because this
machine has no vLLM / model, which is an error, not a hang); reserving every GPU is refused."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

SCRIPT = textwrap.dedent("""\
    import time
    import ray
    ray.init(num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False)
    from cubridge.errors import CubridgeError
    from cubridge.llm.ray_actor import RayVLLMBackend
    from cubridge.search.runners.ray_runner import RayRunner

    def engine(tp):
        try:
            RayVLLMBackend("/no/such/model", tensor_parallel_size=tp, start_timeout_s=120)
            return "started"
        except CubridgeError as e:
            return str(e).splitlines()[0]

    def settle(n):
        # Ray's view of free resources lags actor placement and kills: wait until it shows n free.
        for _ in range(600):
            if ray.available_resources().get("GPU", 0) == n:
                return
            time.sleep(0.1)
        raise SystemExit(f"Ray never showed {n} free GPUs")

    r = RayRunner()
    settle(0)
    print("greedy runner gpus:", r.num_gpus)
    print("engine after greedy runner:", engine(2))
    r.close()
    settle(2)
    try:
        RayRunner(reserve_gpus=2)
        print("reserve all: accepted")
    except CubridgeError as e:
        print("reserve all:", str(e).splitlines()[0])
    r = RayRunner(reserve_gpus=1)
    settle(1)
    print("reserving runner gpus:", r.num_gpus, "free:", ray.available_resources().get("GPU", 0))
    print("engine after reserving runner:", engine(1))
    r.close()
    ray.shutdown()
""")


def test_engine_actor_gets_its_gpus_or_a_clear_error():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines["greedy runner gpus"] == "2"
    assert lines["engine after greedy runner"].startswith(
        "the vLLM Ray actor needs 2 GPU(s) but only 0 of 2 are free: other actors"), out
    assert lines["reserve all"].startswith("the Ray cluster has 2 GPU(s): the vLLM engine takes 2"), out
    assert lines["reserving runner gpus"] == "1 free: 1.0", out
    # Placed on the reserved GPU, the actor fails on this machine (no vLLM, no model): an error, no hang.
    assert lines["engine after reserving runner"].startswith("the vLLM Ray actor could not start"), out


def test_tuner_builds_the_ray_runner_leaving_the_engines_gpus():
    from types import SimpleNamespace as NS
    from cubridge.search.tuner import _runner_options

    def cfg(runner, kind, **options):
        return NS(runner=NS(kind=runner), proposer=NS(kind=kind, options=options))
    assert _runner_options(cfg("ray", "vllm", tensor_parallel_size=4)) == {"reserve_gpus": 4}
    assert _runner_options(cfg("ray", "vllm")) == {"reserve_gpus": 1}
    assert _runner_options(cfg("ray", "vllm", ray_actor=False)) == {}      # the engine runs in the tuner
    assert _runner_options(cfg("ray", "openai")) == {} and _runner_options(cfg("local", "vllm")) == {}
