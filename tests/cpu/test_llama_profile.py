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
