"""The Llama client's training step in parts (experiments/llama_client.py --train, issue 17).

Issue 17's bar is a training step >= 1.3x the same step with FlexAttention. Session 12 estimated
attention at ~18 ms of our ~92 ms step, so even free attention would give ~1.29x: this module
makes that a measurement.

  free attention      FREE: an attention implementation that costs nothing and keeps the graph:
                      out = q's memory seen as [B, N, Hq, D] (a view, no kernel), backward dq =
                      dout, dk = dv = zeros (two memsets), so every projection still gets a
                      gradient and AdamW updates every parameter as in the real step; the mask
                      function is cubridge's (no mask built, no host sync). The step with it is
                      the floor any attention kernel can reach: T_flex / T_free is the largest
                      speedup over Flex that attention alone can give.
  Flex without LSE    FLEX_NOLSE: transformers' flex_attention_forward always asks Flex for the
                      LSE on CUDA, and the FLASH backend's backward refuses a graph that holds it
                      (session 10: "FLASH backend backward does not support differentiating
                      through logsumexp"). This calls the same compiled flex_attention with the
                      same BlockMask, GQA and scale, without the LSE, so Flex-FLASH can train.
  the parts           bracketed(impl): impl with its forward inside record_function(FWD_MARK)
                      and its backward inside a range BWD_MARK opened by the backward of an
                      identity after the call and closed by the backward of an identity before
                      it (every kernel the autograd thread launches in between is the
                      attention's backward: the engine runs the attention's nodes, whose
                      sequence numbers lie between the two identities', before anything made
                      earlier). step_parts() sums one profiled step's CUDA kernel time into
                      attention forward / backward, GEMMs, optimizer and the rest.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

FWD_MARK, BWD_MARK = "attention_forward", "attention_backward"
FREE, FLEX_NOLSE = "expkit_free_attention", "expkit_flex_nolse"
GEMM = re.compile(r"gemm|nvjet|xmma|cutlass.*(?:Kernel|kernel)|matmul|sm90_.*tn|ampere_.*tn", re.I)
OPTIMIZER = re.compile(r"multi_tensor|foreach|adam", re.I)
PARTS = ("attention_fwd", "attention_bwd", "gemm", "optimizer", "other")
CPU_CATS = ("user_annotation", "cpu_op")


class _FreeAttention(torch.autograd.Function):
    """q [B, Hq, N, D] -> q's memory as [B, N, Hq, D]; gradients dq = dout, dk = dv = 0."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.kv = (k.shape, k.dtype, k.device, v.shape, v.dtype)
        return q.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        ks, kd, dev, vs, vd = ctx.kv
        return dout.transpose(1, 2), torch.zeros(ks, dtype=kd, device=dev), torch.zeros(vs, dtype=vd, device=dev)


def free_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature: (out [B, N, Hq, D], None), costing no kernel."""
    return _FreeAttention.apply(query, key, value), None


_FLEX = []


def flex_nolse(module, query, key, value, attention_mask, scaling=None, kernel_options=None, **kwargs):
    """FlexAttention as transformers calls it (compiled flex_attention, the BlockMask, GQA, the
    module's scale) without asking for the LSE; (out [B, N, Hq, D], None)."""
    if not _FLEX:
        from cubridge.runtime.timing import compiled_flex_attention
        _FLEX.append(compiled_flex_attention()[0])
    out = _FLEX[0](query, key, value, block_mask=attention_mask, enable_gqa=query.shape[1] != key.shape[1],
                   scale=scaling, kernel_options=kernel_options)
    return out.transpose(1, 2).contiguous(), None


def register_train_systems() -> dict:
    """Register FREE (cubridge's mask function) and FLEX_NOLSE (Flex's); {system: impl name}."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from cubridge.integrations.transformers import no_mask
    AttentionInterface.register(FREE, free_attention)
    AttentionMaskInterface.register(FREE, no_mask)
    AttentionInterface.register(FLEX_NOLSE, flex_nolse)
    AttentionMaskInterface.register(FLEX_NOLSE, AttentionMaskInterface._global_mapping["flex_attention"])
    return {"none": FREE, "flex_flash_nolse": FLEX_NOLSE, "flex_triton_nolse": FLEX_NOLSE}


def unregister(*names: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    for name in names:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


# ------------------------------------------------------------------ the bracket
class _BeforeAttention(torch.autograd.Function):
    """Identity on q, k, v; its backward (the attention's last) closes the BWD_MARK range."""

    @staticmethod
    def forward(ctx, box, q, k, v):
        ctx.box = box
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        handle = ctx.box.pop("range", None)
        if handle is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(handle)
        return None, dq, dk, dv


class _AfterAttention(torch.autograd.Function):
    """Identity on the output; its backward (the attention's first) opens the BWD_MARK range."""

    @staticmethod
    def forward(ctx, box, out):
        ctx.box = box
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        ctx.box["range"] = torch.ops.profiler._record_function_enter_new(BWD_MARK, None)
        return None, dout


def bracketed(impl: str) -> str:
    """Register a copy of attention implementation `impl` (and its mask function) whose forward
    runs inside record_function(FWD_MARK) and whose backward inside a BWD_MARK range; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    fn, name = ALL_ATTENTION_FUNCTIONS[impl], f"parts_{impl}"

    def wrapped(module, query, key, value, attention_mask, **kwargs):
        box = {}
        query, key, value = _BeforeAttention.apply(box, query, key, value)
        with torch.profiler.record_function(FWD_MARK):
            out, weights = fn(module, query, key, value, attention_mask, **kwargs)
        return _AfterAttention.apply(box, out), weights
    AttentionInterface.register(name, wrapped)
    if impl in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[impl])
    return name


# ------------------------------------------------------------------ one profiled step
def profile_step(model, step, tmp: Path, device: str = "cuda") -> dict:
    """step_parts of one call of `step` with the model's attention bracketed (its implementation
    switched to bracketed(...) for the call and back after)."""
    from torch.profiler import ProfilerActivity, profile
    impl = model.config._attn_implementation
    model.set_attn_implementation(bracketed(impl))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        _sync(device)
        with profile(activities=activities) as prof:
            step()
            _sync(device)
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / "step_trace.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
        path.unlink()
    finally:
        model.set_attn_implementation(impl)
        unregister(f"parts_{impl}")
    return step_parts(data["traceEvents"] if isinstance(data, dict) else data)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_parts(events: list[dict], top: int = 4) -> dict:
    """One step's GPU kernel time (us) by part: attention_fwd / attention_bwd (launched inside a
    FWD_MARK / BWD_MARK range; the ranges are the only ones of those names, so launch time alone
    places a kernel), else gemm / optimizer / other by name; memsets and copies count as kernels
    of their part. Also the busy time (union of kernel intervals), the window (first start to
    last end), the marks seen (a step whose BWD_MARK never opened measured no backward), the
    kernels' names and the top kernels per part."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # CPU-side ranges only: Kineto also draws each annotation on the GPU timeline (gpu_user_annotation,
    # spanning its kernels' GPU time), and a launch time tested against those put the CPU's run-ahead
    # launches (GEMMs, AdamW) into the attention (session 13 mid call: marks 8 / 8 for 4 layers)
    marks = {m: [(e["ts"], e["ts"] + e["dur"]) for e in spans
                 if e.get("name") == m and e.get("cat") in CPU_CATS] for m in (FWD_MARK, BWD_MARK)}
    launches = {e["args"]["correlation"]: e["ts"] for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    us = dict.fromkeys(PARTS, 0.0)
    count = dict.fromkeys(PARTS, 0)
    names: dict = {p: {} for p in PARTS}
    busy, end = 0.0, None
    for e in kernels:
        part = _part(e["name"], launches.get(e.get("args", {}).get("correlation")), marks)
        us[part] += float(e["dur"])
        count[part] += 1
        names[part][e["name"]] = names[part].get(e["name"], 0.0) + float(e["dur"])
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        busy += stop - start if end is None else max(0.0, stop - max(start, end))
        end = stop if end is None else max(end, stop)
    return {"us": {p: round(v, 1) for p, v in us.items()}, "kernels": count,
            "kernel_us_total": round(sum(us.values()), 1), "busy_us": round(busy, 1),
            "window_us": round(end - float(kernels[0]["ts"]), 1) if kernels else 0.0,
            "marks": {m: len(v) for m, v in marks.items()}, "kernel_names": sorted({e["name"] for e in kernels}),
            "top": {p: [[n[:100], round(t, 1)] for n, t in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
                    for p, d in names.items() if d}}


def _part(name: str, launched: float | None, marks: dict) -> str:
    if launched is not None:
        if any(a <= launched <= b for a, b in marks[FWD_MARK]):
            return "attention_fwd"
        if any(a <= launched <= b for a, b in marks[BWD_MARK]):
            return "attention_bwd"
    if GEMM.search(name):
        return "gemm"
    return "optimizer" if OPTIMIZER.search(name) else "other"


def bound(rows: list[dict], variant: str = "prefixlm") -> dict:
    """From the train_step rows of `variant`: per Flex system, T_flex / T_free (the most any
    attention can gain over it in this step), T_flex / T_cubridge (what ours gains), and the
    attention's cost in each step (T - T_free); {} without a free-attention row."""
    ms = {r["system"]: r["ms"] for r in rows if r["direction"] == "train_step" and r["variant"] == variant}
    if "none" not in ms:
        return {}
    free = ms["none"]
    out = {"free_attention_ms": free,
           "attention_cost_ms": {s: round(t - free, 3) for s, t in ms.items() if s != "none"}, "vs_flex": {}}
    for s, t in ms.items():
        if s.startswith("flex"):
            out["vs_flex"][s] = {"max_speedup_free_attention": round(t / free, 4),
                                 "cubridge_speedup": round(t / ms["cubridge"], 4) if "cubridge" in ms else None,
                                 "bar_reachable": t / free >= 1.3}
    return out
