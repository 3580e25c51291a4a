"""`TunedOp`: a tuned run as a PyTorch op (`cubridge.load(DIR)` returns one).

    out = attn(q, k, v)                                   # q [B, Hq, N, D], k / v [B, Hkv, N, D]
    out = attn(q, k, v, layout="bnhd")                    # q [B, N, Hq, D]: out comes back [B, N, Hq, D]
    out, lse = attn(q, k, v, scale=0.05, return_lse=True) # lse [B, Hq, N] float32 (softmax specs)

The call checks what it is given against what was tuned (dtype, head dim, head counts, layout,
device, arch) with an error naming the argument and the fix, then launches. Inside
`torch.compile` it goes through the custom ops `cubridge::attention` / `cubridge::attention_lse`
(cubridge/op/library.py), whose fake implementations give the output shapes, so a compiled model
traces through it with no graph break. Eagerly it calls the same implementation directly (the
dispatcher round trip is host time the op does not need).

Per shape (device, B, Hq, Hkv, N, scale) the first call binds the spec's extra inputs, packs them,
counts the tile order on the GPU and builds the launch (`Prepared`); every later call allocates
the output and launches: no host sync, no host-to-device copy, so the call can be captured in a
CUDA graph once the shape has been seen (a first call inside a capture is refused, saying so).
With runtime inputs (`attn(q, k, v, doc_ids=ids)`: kernels.RuntimePrepared) every call also binds
them: the block table and the tile order are rebuilt on the GPU in the current stream (three small
launches into the shape's buffers for that stream) and the shape's launch is re-pointed at them
(op/NOTES.md 6).
"""
from __future__ import annotations

import math
import threading
from pathlib import Path

import torch

from cubridge.errors import LaunchError
from cubridge.op import handles, library  # noqa: F401 - library registers the custom ops torch.compile sees
from cubridge.op.checks import apply_plan, bnhd_order, check_plan, copy_reason, out_like
from cubridge.op.autograd import check_trainable
from cubridge.op.kernels import DTYPES, Bucket, RuntimePrepared, device_checked

WHERE = "cubridge op"
PLAN_CACHE = 256         # checked call signatures remembered (host data only)
_KEY_SCALARS = (type(None), float, int, str)   # scale / layout types the fast path keys on
# Taken only by a shape's first call: two threads that both miss build one launch, not two (the
# second would replace the first's in _prepared while the first still launches through it).
_PREPARE_LOCK = threading.Lock()


class TunedOp:
    def __init__(self, directory: Path, manifest: dict, dispatch: dict):
        self.directory, self.manifest, self.dispatch = Path(directory), manifest, dispatch
        self.buckets = dispatch["buckets"]
        self._buckets = [Bucket(self.directory, dispatch, e) for e in self.buckets]
        self.dtype = DTYPES[dispatch["dtype"]]
        self.head_dim = int(dispatch["head_dim"])
        self.heads = (int(dispatch["heads_q"]), int(dispatch["heads_kv"]))
        self.runtime_inputs: tuple[str, ...] = _declared_runtime_inputs(self.directory, dispatch)
        self.softmax = self._buckets[0].softmax   # lowers the CuIR (pure Python; no compiler)
        self._prepared: dict = {}
        self._plans: dict = {}
        self._fast: dict = {}              # eager call signature -> _fast_call closure (see _remember)
        self._fast_op: dict = {}           # the same for the custom op's calls (op_forward)
        self._captured: list = []          # per-call launches (runtime inputs) a CUDA graph holds
        self.device_type = "cuda"          # CPU tests set "cpu" and stub the launch
        self.handle = handles.register(self)

    def __repr__(self) -> str:
        d = self.dispatch
        spans = ", ".join((f"N<={b['max_seqlen']}" if b["max_seqlen"] else f"N>{b['min_seqlen'] - 1}") + f": {b['label']}"
                          for b in self.buckets)
        return (f"TunedOp({d['spec_name']} from {self.buckets[0]['reference']}, {d['arch']} {d['dtype']} "
                f"D={d['head_dim']} Hq={self.heads[0]} Hkv={self.heads[1]}; {spans})")

    def select(self, seqlen: int) -> dict:
        """The dispatch-table entry (config, cubin, kernel files) for a sequence length."""
        return self.buckets[self._bucket_index(seqlen)]

    def _bucket_index(self, seqlen: int) -> int:
        if seqlen < 1:
            raise LaunchError(f"sequence length {seqlen}", where=WHERE, hint="N must be >= 1")
        for i, e in enumerate(self.buckets):
            if e["min_seqlen"] <= seqlen and (e["max_seqlen"] is None or seqlen <= e["max_seqlen"]):
                return i
        raise LaunchError(f"no dispatch bucket holds N={seqlen}", where=str(self.directory / "dispatch.json"))

    # -------------------------------------------------------------- the call
    def __call__(self, q, k, v, *, layout: str | None = None, scale: float | None = None, return_lse: bool = False,
                 **runtime):
        """out (or (out, lse)); layout None reads [B, H, N, D] and refuses what only [B, N, H, D] or
        both could mean; runtime: the spec's declared runtime inputs as keyword tensors."""
        compiling, key = torch.compiler.is_compiling(), None
        if (not (compiling or runtime or return_lse) and type(q) is type(k) is type(v) is torch.Tensor
                and type(scale) in _KEY_SCALARS and type(layout) in _KEY_SCALARS):   # hashable, checked later
            # _signature inline: this is the repeated call's hot path (one function call less)
            key = (layout, scale, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
                   v.dtype, q.device, k.device, v.device)
            fast = self._fast.get(key)
            if fast is not None and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                       or v.requires_grad)):
                return fast(q, k, v)
        plan = self._plan(q, k, v, layout, compiling)
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        qh, kh, vh = apply_plan(plan, q, k, v)
        layout = plan[0]
        scale = self._scale(scale)
        rt = self._runtime_list(runtime, qh)
        if return_lse and not self.softmax:
            raise LaunchError(f"return_lse=True: {self.dispatch['spec_name']} is not a softmax attention, it has no LSE",
                              where=WHERE, hint="call without return_lse")
        if needs_grad:   # through attention_lse's autograd (cubridge/op/autograd.py): the backward reads LSE
            check_trainable(self, rt)
            out, lse = torch.ops.cubridge.attention_lse(qh, kh, vh, self.handle, scale, rt)
            lse = lse if return_lse else None
        elif compiling or type(qh) is not torch.Tensor:    # traced, or fake tensors
            if return_lse:
                out, lse = torch.ops.cubridge.attention_lse(qh, kh, vh, self.handle, scale, rt)
            else:
                out, lse = torch.ops.cubridge.attention(qh, kh, vh, self.handle, scale, rt), None
        else:
            out, lse = self.forward(qh, kh, vh, scale, rt, return_lse)
            if key is not None:
                self._remember(key, plan, q, qh, kh, scale)
        if layout == "bnhd":
            out = out.transpose(1, 2)
        return (out, lse) if return_lse else out

    def _remember(self, key, plan, q, qh, kh, scale: float) -> None:
        """Keep the checked plan and the prepared launch of this call signature as one closure, so a
        repeated eager call costs one key, one lookup, the output's allocation and the launch: the
        separate plan and prepared-launch lookups (two keys with torch.Size / device objects) were
        ~7 us of a 19-33 us host path on the H100 host (session 7 op_bench). The closure enters
        the launch by addresses (op/NOTES.md 10): the key fixed every shape and stride."""
        prep = self._prepared.get((qh.shape, kh.shape, qh.device, scale))
        if prep is None:     # an empty shape: nothing was prepared
            return
        _remember_bounded(self._fast, key, _fast_call(plan, prep, q, tuple(qh.shape), qh.dtype, qh.device, bnhd_order(qh)))

    def op_forward(self, q, k, v, scale: float):
        """cubridge::attention's implementation without runtime inputs (what a compiled graph runs):
        out in q's memory order (the fake implementation's out_like), q / k / v the kernel cannot
        read in place copied first. A repeated signature runs a _fast_call closure from its own
        cache (a key shared with the eager call's layout strings could serve a refused layout):
        `_readable`'s three copy_reason checks, the prepared-launch lookup, out_like and
        `_in_order_of` were ~13 us of the custom op's path on the CPU host (op/NOTES.md 10)."""
        plain = type(q) is type(k) is type(v) is torch.Tensor
        key = (scale, *_signature(q, k, v)) if plain else None
        fast = self._fast_op.get(key) if plain else None
        if fast is not None:
            return fast(q, k, v)
        copies = tuple(copy_reason(self, t) is not None for t in (q, k, v))
        qh, kh, vh = (t.contiguous() if c else t for t, c in zip((q, k, v), copies))
        out = self.forward(qh, kh, vh, scale, [], False)[0]
        out = out if bnhd_order(out) == bnhd_order(q) else out_like(q).copy_(out)
        prep = self._prepared.get((qh.shape, kh.shape, qh.device, scale))
        if plain and prep is not None:
            _remember_bounded(self._fast_op, key, _fast_call(("bhnd", copies), prep, q, tuple(q.shape), q.dtype,
                                                             q.device, bnhd_order(q)))
        return out

    def _plan(self, q, k, v, layout, compiling: bool):
        """check_plan, remembered per (layout, shapes, strides, dtypes, devices) when eager: a
        repeated call costs one dictionary lookup, not the checks (~7 us of Python)."""
        if compiling or not (type(q) is type(k) is type(v) is torch.Tensor):
            return check_plan(self, q, k, v, layout)
        key = (layout, *_signature(q, k, v))
        plan = self._plans.get(key)
        if plan is None:
            plan = check_plan(self, q, k, v, layout)
            _remember_bounded(self._plans, key, plan)
        return plan

    def _scale(self, scale) -> float:
        if scale is None:
            return 1.0 / math.sqrt(self.head_dim)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (scale > 0 and math.isfinite(scale)):
            raise LaunchError(f"scale={scale!r} is not a positive finite number", where=f"{WHERE}: scale",
                              hint="pass a Python float > 0, or leave it out for 1/sqrt(D)")
        return float(scale)

    def _runtime_list(self, runtime: dict, q) -> list:
        """The runtime inputs in declared order; an unknown or missing name is an error."""
        if not runtime and not self.runtime_inputs:
            return []
        unknown = sorted(set(runtime) - set(self.runtime_inputs))
        if unknown:
            declared = ", ".join(self.runtime_inputs) or "none"
            raise LaunchError(f"unexpected keyword argument(s) {', '.join(unknown)}: spec "
                              f"{self.dispatch['spec_name']!r} declares runtime inputs: {declared}", where=WHERE,
                              hint="pass only the runtime inputs the spec declares (RUNTIME_INPUTS in its file)")
        missing = [n for n in self.runtime_inputs if n not in runtime]
        if missing:
            raise LaunchError(f"missing runtime input(s) {', '.join(missing)} of spec {self.dispatch['spec_name']!r}",
                              where=WHERE, hint=f"pass them as keywords: attn(q, k, v, {missing[0]}=tensor)")
        for n in self.runtime_inputs:
            t = runtime[n]
            if not isinstance(t, torch.Tensor) or t.device != q.device:
                raise LaunchError(f"runtime input {n} must be a tensor on {q.device}, got "
                                  f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.device}",
                                  where=f"{WHERE}: {n}", hint=f"move it with {n}.to(q.device)")
        return [runtime[n] for n in self.runtime_inputs]

    # -------------------------------------------------------------- the launch
    def forward(self, q, k, v, scale: float, rt: list, want_lse: bool):
        """(out, lse or None) for [B, H, N, D] views that check_plan accepted; out in q's memory
        order (checks.out_like)."""
        b, hq, n, d = q.shape
        out = out_like(q)
        if b * hq * n == 0:
            lse = torch.empty((b, hq, n), dtype=torch.float32, device=q.device)
            return out, (lse if want_lse else None)
        prep = self._prepared.get((q.shape, k.shape, q.device, scale))
        if prep is None:
            with _PREPARE_LOCK:
                prep = self._prepared.get((q.shape, k.shape, q.device, scale)) or self._prepare(q, k, scale, rt)
        lse = torch.empty((b, hq, n), dtype=torch.float32, device=q.device) if want_lse else prep.lse_scratch
        if rt:    # kernels.RuntimePrepared: binds this call's inputs, on the GPU
            keep = prep.launch(q, k, v, out, lse, rt)
            if torch.cuda.is_current_stream_capturing():   # the graph replays with this call's tables
                self._captured.append(keep)
        else:
            prep.launch(q, k, v, out, lse)
        return out, (lse if want_lse else None)

    def _prepare(self, q, k, scale: float, rt: list):
        """The launch at this shape, built once and cached; with runtime inputs a
        kernels.RuntimePrepared, which binds each call's inputs (block tables and tile order follow
        the data) on the GPU, so it can be captured too once the shape's kernel is loaded."""
        device = q.device
        b, hq, n, _ = q.shape
        bucket = self._buckets[self._bucket_index(n)]
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing:      # also with runtime inputs: the shape's scratch must not come from the graph's pool
            raise LaunchError(f"first call at shape q {tuple(q.shape)} inside a CUDA graph capture: binding the "
                              "spec's inputs, loading the kernel and counting the tile order copy to the GPU, which "
                              "a capture forbids", where=WHERE,
                              hint="call the op once at this shape before capturing (a warm-up run)")
        device_checked(self.dispatch["arch"], device.index if device.index is not None else torch.cuda.current_device())
        if rt:
            prep = RuntimePrepared(bucket, device, (b, hq, k.shape[1], n, k.shape[2]), scale, self.runtime_inputs)
        else:
            prep = bucket.prepare(device, b, hq, k.shape[1], n, k.shape[2], scale, {})
        # never evicted: a CUDA graph captured at this shape points into prep's buffers
        self._prepared[(q.shape, k.shape, q.device, scale)] = prep
        return prep

    def warmup(self, q, k, v, **kw) -> None:
        """Build the per-shape state for these inputs (what a first call does), e.g. before a capture."""
        self(q, k, v, **kw)


def _signature(q, k, v) -> tuple:
    """What a checked call depends on: the three tensors' shapes, strides, dtypes and devices."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device)


def _remember_bounded(cache: dict, key, value) -> None:
    """cache[key] = value, the oldest entry dropped first once PLAN_CACHE are kept."""
    if len(cache) >= PLAN_CACHE:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _fast_call(plan, prep, q, shape: tuple, dtype, device, out_bnhd: bool):
    """The repeated eager call of the checked signature of the caller's `q` (its shape and strides
    are the key's): allocate only the output, in the caller's layout and q's memory order (what
    out_like and the bnhd transpose give), and launch (LSE goes to the prepared scratch; no other
    allocation, no GPU work beside the kernel). A launch with `fixed_layout` (runtime.fa3_fast)
    is entered by addresses alone: no views, no stride reads."""
    bnhd, copies = plan[0] == "bnhd", plan[1]
    b, h, n, d = shape
    # the output as the caller gets it: [B, H, N, D] (or its [B, N, H, D] transpose for layout bnhd)
    # over memory in q's order; one empty_strided instead of empty + one or two transposes (and
    # cheaper than torch.empty even where contiguous: 0.85 vs 1.09 us on the CPU host, which goes
    # through empty's memory-format handling)
    bhnd_out = (torch.empty((b, n, h, d), device="meta").transpose(1, 2) if out_bnhd
                else torch.empty(shape, device="meta"))
    final = bhnd_out.transpose(1, 2) if bnhd else bhnd_out
    size, stride = tuple(final.shape), final.stride()
    fixed = getattr(prep.launch, "fixed_layout", None)
    if fixed is not None and not any(copies):
        views = _bhnd_views if bnhd else _same
        launch, lse = fixed(views), prep.lse_scratch
        # where empty_like(q) gives O's strides (q dense: the usual case, either layout) it makes O
        # with one tensor argument to parse: 0.74 vs 1.04 us for empty_strided on the CPU host
        like = torch.empty_like(torch.empty_strided(q.shape, q.stride(), device="meta")).stride() == stride

        def call(q, k, v):
            out = torch.empty_like(q) if like else torch.empty_strided(size, stride, dtype=dtype, device=device)
            launch(q, k, v, out, lse)
            return out
        return call
    launch, lse, any_copy = prep.launch, prep.lse_scratch, any(copies)

    def checked(q, k, v):
        if bnhd:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if any_copy:
            q, k, v = (t.contiguous() if c else t for t, c in zip((q, k, v), copies))
        out = torch.empty_strided(size, stride, dtype=dtype, device=device)
        launch(q, k, v, out.transpose(1, 2) if bnhd else out, lse)
        return out
    return checked


def _same(q, k, v, out):
    return q, k, v, out


def _bhnd_views(q, k, v, out):
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2)


def _declared_runtime_inputs(directory: Path, dispatch: dict) -> tuple[str, ...]:
    """The names of the tensors a call supplies (the spec's runtime inputs, in declared order)."""
    if "runtime_inputs" in dispatch:
        return tuple(dispatch["runtime_inputs"])
    from cubridge.spec import load_spec
    spec = load_spec(str(directory / dispatch["spec"]))
    return tuple(getattr(spec, "runtime_inputs", None) or ())
