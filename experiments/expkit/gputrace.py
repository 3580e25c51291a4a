"""Where one call's GPU time goes, from a torch.profiler chrome trace (experiments/llama_profile.py):
the kernels it ran (name, duration, whether a marked CPU range launched them), the GPU's busy time
(the union of kernel intervals) against the window from the first kernel's start to the last one's
end, the idle gaps between kernels with the CPU op that launched the kernel after each gap, and
the CUDA runtime / driver calls that wait for the GPU (synchronisations, device-to-host copies).

Pure Python on the trace's JSON, so the CPU tests check it on a hand-made trace.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")     # what keeps the GPU busy (memsets / copies count as "other")
# runtime / driver calls that block the host until the GPU gets there (a host sync)
SYNC_CALLS = re.compile(r"Synchronize|cuMemcpyDtoH|cudaMemcpy(?!Async)|cuStreamSynchronize|cuCtxSynchronize")
# attention kernels by name, for a kernel whose launch the trace did not link to a CPU call
ATTENTION = re.compile(r"fa3_sm90_fwd|flash|fmha|flex_attention|attention", re.I)
GEMM = re.compile(r"gemm|nvjet|xmma|cutlass.*(?:Kernel|kernel)|matmul|sm90_.*tn|ampere_.*tn", re.I)


def load_events(path: Path) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def analyse(events: list[dict], mark: str = "attention", top_gaps: int = 5, min_gap_us: float = 5.0) -> dict:
    """One profiled call: {"kernels": [(name, dur_us, kind)], "window_us", "busy_us", "idle_us",
    "gaps": [...], "syncs": {call: count}, "cpu_us"}; kind is "marked" for kernels launched inside a
    CPU range named `mark` (record_function), or, where the trace links no launch to the kernel,
    named like an attention kernel (ATTENTION); else "gemm" or "other" by name."""
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    marks = [(e["ts"], e["ts"] + e["dur"]) for e in cpu_ops if e.get("name") == mark]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"), key=lambda e: e["ts"])
    rows, gaps = [], []
    busy, end = 0.0, None
    for e in kernels:
        launch = launches.get(e.get("args", {}).get("correlation"))
        t = launch["ts"] if launch else None
        marked = any(a <= t <= b for a, b in marks) if t is not None else bool(ATTENTION.search(e["name"]))
        rows.append((e["name"], float(e["dur"]), "marked" if marked else ("gemm" if GEMM.search(e["name"]) else "other")))
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if end is not None and start - end >= min_gap_us:
            gaps.append({"gap_us": round(start - end, 1), "next_kernel": e["name"][:90],
                         "launched_by": _innermost(cpu_ops, t) if t is not None else None})
        busy += max(0.0, stop - max(start, end)) if end is not None else stop - start
        end = stop if end is None else max(end, stop)
    window = (end - float(kernels[0]["ts"])) if kernels else 0.0
    syncs: dict = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and SYNC_CALLS.search(e.get("name", "")):
            syncs[e["name"]] = syncs.get(e["name"], 0) + 1
    tops = [e for e in cpu_ops if e.get("name", "").startswith("call#")]
    return {"kernels": rows, "window_us": window, "busy_us": busy, "idle_us": window - busy,
            "gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:top_gaps], "n_gaps": len(gaps),
            "gap_total_us": sum(g["gap_us"] for g in gaps), "syncs": syncs,
            "cpu_us": float(tops[0]["dur"]) if tops else None}


def _innermost(cpu_ops: list[dict], t: float) -> str | None:
    """The name of the shortest CPU op (or annotation) whose range holds time t."""
    best = None
    for e in cpu_ops:
        if e["ts"] <= t <= e["ts"] + e["dur"] and (best is None or e["dur"] < best["dur"]):
            best = e
    return best["name"] if best else None


def summarise(calls: list[dict], top: int = 12) -> dict:
    """Per-call means over several analysed calls: totals by kind, the top kernels by CUDA time
    (name -> mean us per call, launches per call), window / busy / idle, the worst gaps seen."""
    n = max(1, len(calls))
    by_name: dict = {}
    kinds = {"marked": 0.0, "gemm": 0.0, "other": 0.0}
    for c in calls:
        for name, dur, kind in c["kernels"]:
            s = by_name.setdefault(name, {"us": 0.0, "count": 0, "kind": kind})
            s["us"] += dur
            s["count"] += 1
            kinds[kind] += dur
    topk = sorted(by_name.items(), key=lambda kv: -kv[1]["us"])[:top]
    mean = lambda key: sum(c[key] for c in calls) / n      # noqa: E731
    gaps = sorted((g for c in calls for g in c["gaps"]), key=lambda g: -g["gap_us"])[:5]
    syncs: dict = {}
    for c in calls:
        for k, v in c["syncs"].items():
            syncs[k] = syncs.get(k, 0) + v / n
    cpu = [c["cpu_us"] for c in calls if c.get("cpu_us") is not None]
    return {"calls": len(calls), "kernels_per_call": sum(len(c["kernels"]) for c in calls) / n,
            "kernel_us": {k: round(v / n, 1) for k, v in kinds.items()},
            "kernel_us_total": round(sum(kinds.values()) / n, 1),
            "window_us": round(mean("window_us"), 1), "busy_us": round(mean("busy_us"), 1),
            "idle_us": round(mean("idle_us"), 1), "gap_total_us": round(mean("gap_total_us"), 1),
            "cpu_us": round(sum(cpu) / len(cpu), 1) if cpu else None, "syncs_per_call": syncs,
            "top_kernels": [{"name": k[:120], "us_per_call": round(v["us"] / n, 1), "per_call": v["count"] / n,
                             "kind": v["kind"]} for k, v in topk],
            "worst_gaps": gaps}
