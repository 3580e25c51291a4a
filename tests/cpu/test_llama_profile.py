"""experiments/llama_profile.py's trace analysis (expkit.gputrace) on a hand-made chrome trace: the
GPU's busy time is the union of kernel intervals, gaps name the CPU op that launched the next
kernel, attention kernels are those launched inside the marked range, host syncs are counted; and
the profiler's control systems (free attention, ours without a mask function) register and run on
a tiny CPU Llama, leaving no registration behind."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(scope="module")
def gputrace():
    before, added = list(sys.path), [m for m in ("expkit", "expkit.gputrace") if m not in sys.modules]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        from expkit import gputrace
        yield gputrace
    finally:
        sys.path[:] = before
        for m in added:
            sys.modules.pop(m, None)


def _trace():
    cpu = lambda name, ts, dur: {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur}   # noqa: E731
    launch = lambda ts, c, name="cudaLaunchKernel": {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts,  # noqa: E731
                                                     "dur": 2, "args": {"correlation": c}}
    kernel = lambda name, ts, dur, c: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                       "args": {"correlation": c}}
    return [cpu("call#0", 0, 500), cpu("aten::mm", 10, 5), launch(12, 1), kernel("sm90_xmma_gemm_bf16", 100, 50, 1),
            {"ph": "X", "cat": "user_annotation", "name": "attention", "ts": 20, "dur": 10},
            launch(22, 2, "cuLaunchKernel"), kernel("cubridge_fa3", 140, 40, 2),       # overlaps the GEMM by 10
            cpu("aten::item", 40, 30), launch(45, 3, "cudaStreamSynchronize"),
            cpu("aten::add", 200, 5), launch(201, 4), kernel("elementwise_add", 230, 10, 4)]


def test_busy_time_gaps_marks_and_syncs(gputrace, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    a = gputrace.analyse(gputrace.load_events(path), "attention")
    assert a["window_us"] == 140 and a["busy_us"] == 50 + 30 + 10 and a["idle_us"] == 50
    assert [k[2] for k in a["kernels"]] == ["gemm", "marked", "other"]
    assert a["gaps"] == [{"gap_us": 50.0, "next_kernel": "elementwise_add", "launched_by": "aten::add"}]
    assert a["syncs"] == {"cudaStreamSynchronize": 1} and a["cpu_us"] == 500
    s = gputrace.summarise([a, a])
    assert s["kernel_us"] == {"marked": 40.0, "gemm": 50.0, "other": 10.0} and s["kernels_per_call"] == 3
    assert s["top_kernels"][0]["name"] == "sm90_xmma_gemm_bf16" and s["top_kernels"][0]["per_call"] == 1
    assert s["syncs_per_call"] == {"cudaStreamSynchronize": 1.0} and s["idle_us"] == 50


def test_no_kernels_is_an_empty_call(gputrace):
    a = gputrace.analyse([], "attention")
    assert a["window_us"] == 0 and a["busy_us"] == 0 and a["kernels"] == [] and a["cpu_us"] is None


def test_an_unlinked_kernel_is_classified_by_name(gputrace):
    events = [{"ph": "X", "cat": "kernel", "name": "fa3_sm90_fwd", "ts": 0, "dur": 5, "args": {}},
              {"ph": "X", "cat": "kernel", "name": "nvjet_hsh_128x256", "ts": 5, "dur": 5, "args": {}}]
    assert [k[2] for k in gputrace.analyse(events, "attention")["kernels"]] == ["marked", "gemm"]


def test_dry_run_of_the_profile_on_cpu(monkeypatch, tmp_path):
    """llama_profile's whole flow on CPU: a tiny Llama, the stubbed prefixlm op of
    test_llama_client (a float64 reference behind the real op), no Flex, timers that call each
    system once, CPU-only profiler traces (no kernels: zero GPU time). Checks the plumbing and
    the JSON, not speed; the transformers registrations it makes are removed after."""
    from test_llama_client import HKV as T_HKV, HQ as T_HQ, D as T_D
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from cubridge.integrations.transformers import register
    before = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))
    modules = set(sys.modules)
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import llama_profile as lp
        from expkit import llama
        op = _prefix_op(tmp_path)
        shape = {"hq": T_HQ, "hkv": T_HKV, "d": T_D, "layers": 2, "vocab": 96, "ffn": 128}
        monkeypatch.setattr(lp, "DEVICE", "cpu")
        monkeypatch.setattr(lp, "VOCAB", 96)
        monkeypatch.setattr(lp, "make_model", lambda device: llama.make_model(device, **shape))
        monkeypatch.setattr(lp, "build_runs", lambda alt, root: ({"prefixlm": register(op, "cubridge_prefixlm_dry")},
                                                                  {"prefixlm": str(op.directory)}))
        monkeypatch.setattr(lp, "FLEX", {"auto": ()})
        monkeypatch.setattr(lp, "idle_round_robin", lambda fns, reps: [_timing(1.0 + i) for i, f in enumerate(fns)
                                                                       if f() is not None])
        monkeypatch.setattr(lp, "gpu_ms", lambda fns, reps: [0.5 + i for i, f in enumerate(fns) if f() is not None])
        assert lp.main(["--out", str(tmp_path / "p.json"), "--n", "64", "--reps", "1", "--profile-calls", "1"]) == 0
    finally:
        sys.path.remove(str(EXPERIMENTS))
        for name in set(AttentionInterface._global_mapping) - before[0]:
            AttentionInterface._global_mapping.pop(name)
        for name in set(AttentionMaskInterface._global_mapping) - before[1]:
            AttentionMaskInterface._global_mapping.pop(name)
        for m in set(sys.modules) - modules:
            if m.split(".")[0] in ("llama_profile", "expkit"):
                sys.modules.pop(m)
    saved = json.loads((tmp_path / "p.json").read_text())
    assert list(saved["systems"]) == ["cubridge", "cubridge_nomask", "sdpa_bool_mask", "none"]
    assert saved["systems"]["none"]["forward_ms_idle"] == 4.0 and saved["systems"]["cubridge"]["forward_ms_busy"] == 0.5
    prof = saved["systems"]["cubridge"]["profile"]
    assert prof["calls"] == 1 and prof["kernel_us_total"] == 0 and prof["cpu_us"] > 0    # CPU trace: no kernels
    assert saved["logits_max_diff_vs_sdpa_mask"]["cubridge"] < 0.05            # the float64 stub vs bf16 SDPA
    assert set(saved["layer0_attention"]) == {"cubridge", "sdpa_bool_mask"}
    assert "error" in saved["systems"]["cubridge"]["clock"]


def _timing(ms):
    from cubridge.runtime.timing import Timing
    return Timing(ms, ms, ms, 1)


def _prefix_op(tmp_path):
    """test_llama_client's stubbed prefixlm op, built here (its fixture is module-scoped there)."""
    import test_llama_client
    factory = test_llama_client.prefix_op.__wrapped__

    class Factory:
        def mktemp(self, name):
            d = tmp_path / name
            d.mkdir()
            return d
    return factory(Factory())
