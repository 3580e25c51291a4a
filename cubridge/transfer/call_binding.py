"""A candidate's extra kernel inputs at one call: `bind_inputs(binding, spec, spec_params, ...)`,
which `Candidate.bind` (cubridge.transfer.rules) and a search worker (from the job's Binding JSON)
both call.

What depends only on the shape (the scalars C0, C1, ... that differ between shapes, captured
tensors built from the shape, the block table of a mask that reads no runtime input) is computed on
the first call at a shape and cached. What depends on the call's runtime inputs is redone per call,
with no host round trip where possible:
- a runtime input the mods read directly becomes the kernel input as it is (int32 / float32 on its
  own device; a tensor of another integer or float type is converted in the current stream);
- the block table of a mask that reads runtime inputs is built on the GPU
  (cubridge.runtime.block_table), in the current stream, when the call is on a CUDA device;
- a capture *derived* from runtime inputs (the hooks compute a new tensor from them) needs the
  hooks re-run per call on the host: `Candidate.host_path` says so, and such a call refuses to run
  inside a CUDA graph capture.

Example:
    >>> from cubridge.cuir.parser import parse_file
    >>> from cubridge.paths import ref_kernel_dir
    >>> from cubridge.spec import load_spec
    >>> from cubridge.transfer.rules import transfer
    >>> cand = transfer(parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir"), load_spec("document"))
    >>> ids = torch.tensor([[0] * 100 + [1] * 200])
    >>> sorted(cand.bind(Nq=300, Nk=300, Hq=2, Hkv=1, B=1, runtime={"doc_ids": ids}))
    ['BLOCK_CLASS', 'DOC_IDS']
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from cubridge.errors import LaunchError
from cubridge.inputs import check_query_length

# Shapes whose static part is kept (a model calls a handful; a tuner's checks a few more).
CACHED_SHAPES = 256
_CACHE: OrderedDict = OrderedDict()


@dataclass
class _Static:
    """What one shape fixes."""
    consts: dict            # scalar slot name -> value
    captures: dict          # capture name -> tensor (not from runtime inputs)
    table: torch.Tensor | None


def bind_inputs(binding, spec, spec_params: dict, *, Nq: int, Nk: int, Hq: int, Hkv: int, B: int = 1,
                params: dict | None = None, device="cpu", runtime: dict | None = None) -> dict:
    """The extra kernel inputs at one call (see the module docstring). `binding`: a
    transfer.rules.Binding; `runtime`: the call's runtime inputs by name, or None for the
    representative values the tuner uses."""
    return shape_binder(binding, spec, spec_params, Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B, params=params,
                        device=device)(runtime)


def shape_binder(binding, spec, spec_params: dict, *, Nq: int, Nk: int, Hq: int, Hkv: int, B: int = 1,
                 params: dict | None = None, device="cpu") -> "ShapeBinder":
    """bind(runtime) -> the extra inputs of a call at this shape (bind_inputs' arguments but
    `runtime`), kept per shape: a caller that binds every call (the op with runtime inputs) holds
    it and skips this lookup too."""
    check_query_length(Nq, Nk, spec.path)
    cfg = {**dict(binding.params), **(params or {})}
    device = torch.device(device)
    key = (binding, spec.path, repr(sorted(spec_params.items())), Nq, Nk, Hq, Hkv, B, cfg.get("BLOCK_M"),
           cfg.get("BLOCK_N"), str(device))
    binder = _CACHE.get(key)
    if binder is None:
        if len(_CACHE) >= CACHED_SHAPES:
            _CACHE.popitem(last=False)                      # the oldest shape
        binder = _CACHE[key] = ShapeBinder(binding, spec, spec_params, (Nq, Nk, Hq, Hkv, B), cfg, device)
    return binder


class ShapeBinder:
    """The extra inputs at one shape: the static part (_Static) built on the first call, then per
    call only what follows the runtime inputs (checked, converted, the table built on the GPU)."""

    def __init__(self, binding, spec, spec_params: dict, dims: tuple, cfg: dict, device: torch.device):
        self.binding, self.spec, self.spec_params, self.dims, self.cfg, self.device = (
            binding, spec, spec_params, dims, cfg, device)
        self.resolved = spec.resolved_params(**spec_params)
        self.static: _Static | None = None
        self.table_builder = None           # runtime.block_table.TableBuilder of a GPU-built table

    def __call__(self, runtime: dict | None = None, scratch: dict | None = None) -> dict:
        """The inputs of a call on `runtime`; a GPU-built table goes to `scratch` when given
        (driver.scratch_tensor: the caller launches in one stream and keeps the buffers)."""
        binding, spec, spec_params, device = self.binding, self.spec, self.spec_params, self.device
        Nq, Nk, Hq, Hkv, B = self.dims
        values = spec.runtime_for(Nq, Nk, Hq, Hkv, B, device, runtime, self.resolved)
        static = self.static
        if static is None:
            static = self.static = _static(binding, spec, spec_params, Nq, Nk, Hq, Hkv, B, self.cfg, device, values)
        inputs = dict(static.consts)
        inputs.update(static.captures)
        if binding.derived:
            inputs.update(_derived(binding, spec, spec_params, Nq, Nk, Hq, Hkv, B, device, values))
        for cap, name in binding.runtime:
            inputs[cap] = kernel_tensor(values[name])
        if binding.table:
            inputs["BLOCK_CLASS"] = (static.table if static.table is not None
                                     else self._runtime_table(values, inputs, scratch))
        return inputs

    def _runtime_table(self, values: dict, inputs: dict, scratch: dict | None) -> torch.Tensor:
        binding, spec, device = self.binding, self.spec, self.device
        Nq, Nk, Hq, Hkv, B = self.dims
        if builds_on_device(device) and not binding.derived and binding.mask:
            if self.table_builder is None:
                from cubridge.runtime.block_table import TableBuilder
                scalars = [(name, "int" if dt == "i32" else "float") for name, _, dt in binding.slots]
                self.table_builder = TableBuilder(binding.mask, inputs, scalars, B=B, Hq=Hq, Nq=Nq, Nk=Nk,
                                                  block_m=self.cfg["BLOCK_M"], block_n=self.cfg["BLOCK_N"],
                                                  per_bh=binding.per_bh, device=device)
            return self.table_builder(inputs, scratch)
        if device.type == "cuda":
            _refuse_in_capture(spec, "its block table is built on the host")
        hooks = spec.hooks_for(Nq, Nk, Hq, Hkv, device, B=B, runtime=values, **self.spec_params)
        return host_table(binding, hooks, B, Hq, Nq, Nk, self.cfg, device)


def kernel_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the kernels read it: int32 or float32, contiguous, on its own device."""
    t = t.detach() if t.requires_grad else t
    dtype = torch.float32 if t.is_floating_point() else torch.int32
    if t.dtype is dtype and t.is_contiguous():       # the op's every call: no dispatcher round trip
        return t
    return t.to(dtype).contiguous()


def _static(binding, spec, spec_params, Nq, Nk, Hq, Hkv, B, cfg, device, values) -> _Static:
    from cubridge.transfer.forms import trace_at
    from cubridge.transfer.trace import TraceError
    fingerprint, consts, captured = trace_at(spec, Nq, Nk, Hq, Hkv, spec_params, device, runtime=values, B=B)
    if fingerprint != binding.skeleton:
        raise TraceError(f"the hooks of {spec.name!r} trace to a different structure at "
                         f"Nq={Nq}, Nk={Nk}, Hq={Hq}: the transfer cannot be reused at this shape",
                         where=spec.path, hint="make the hooks' structure independent of the shape")
    skip = {c for c, _ in binding.runtime} | set(binding.derived)
    captures = {n: _static_tensor(t, device) for n, t in captured.items() if n not in skip}
    table = None
    if binding.table and not binding.table_reads_runtime:
        hooks = spec.hooks_for(Nq, Nk, Hq, Hkv, device, B=B, runtime=values, **spec_params)
        table = host_table(binding, hooks, B, Hq, Nq, Nk, cfg, device)
    return _Static({name: consts[i] for name, i, _ in binding.slots}, captures, table)


def _static_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # The interpreter (device cpu) reads int64 / float32 host tensors, as before runtime inputs
    # existed; a GPU call keeps them on its device, converted once per shape.
    if device.type == "cpu":
        t = t.detach().to("cpu")
        return t.to(torch.int64) if not t.is_floating_point() else t.to(torch.float32)
    return kernel_tensor(t.to(device))


def _derived(binding, spec, spec_params, Nq, Nk, Hq, Hkv, B, device, values) -> dict:
    """Captures the hooks compute from runtime inputs: the hooks are re-run on this call's values."""
    from cubridge.transfer.forms import trace_at
    _refuse_in_capture(spec, "its hooks derive captured tensors from runtime inputs")
    captured = trace_at(spec, Nq, Nk, Hq, Hkv, spec_params, device, runtime=values, B=B)[2]
    return {n: _static_tensor(captured[n], device) for n in binding.derived}


def host_table(binding, hooks, B, Hq, Nq, Nk, cfg, device) -> torch.Tensor:
    from cubridge.transfer.forms import block_classes
    table = block_classes(hooks, B, Hq, Nq, Nk, cfg["BLOCK_M"], cfg["BLOCK_N"], binding.per_bh, device)
    return table if device.type == "cpu" else table.to(device=device, dtype=torch.int32)


def builds_on_device(device: torch.device) -> bool:
    """Whether a runtime table is built by the GPU kernel on `device` (CPU tests that stub the
    kernel's launch say yes for "cpu" to count what a GPU call does)."""
    return device.type == "cuda"


def _refuse_in_capture(spec, why: str):
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise LaunchError(f"spec {spec.name!r} cannot run inside a CUDA graph capture: {why}, which "
                          "needs host work per call", where=spec.path,
                          hint="read the runtime inputs directly in the mods (no tensor computed from them "
                               "in hooks()), or call outside the graph")
