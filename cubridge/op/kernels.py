"""One dispatch bucket of a run directory, made launchable: the lowered kernel (for its argument
layout), the binder of its extra inputs, the cubin (the run's own, else compiled once), and per
shape a `Prepared` launch.

Nothing here imports cubridge.search's jobs or measure: a run directory loads with the lowering
(pure Python), the rules transfer (for the binder) and the reference kernel's own launch
(ReferenceKernel.shape_launch, through the runtime's driver path). The compiler is needed only
where the run carries no cubin for the bucket.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cubridge.archs import check_arch
from cubridge.errors import LaunchError
from cubridge.runtime.driver import current_stream

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.lru_cache(maxsize=None)
def device_checked(arch: str, index: int) -> bool:
    """check_arch once per (arch, device)."""
    check_arch(arch, torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index))
    return True


@dataclass
class Prepared:
    """Everything a call at one shape needs but the tensors: launch(q, k, v, out, lse) on the current stream."""
    launch: object
    lse_scratch: torch.Tensor        # where the kernel writes LSE when the caller did not ask for it
    keep: object = None              # the packed extra inputs the launch points to


class Bucket:
    """A dispatch entry of a run directory, loaded lazily."""

    def __init__(self, directory: Path, dispatch: dict, entry: dict):
        self.directory, self.dispatch, self.entry = directory, dispatch, entry
        self.reference = entry["reference"]
        self._lowered = self._cand = None
        self._loaded: set = set()       # device indices whose launch was built

    # -------------------------------------------------------------- loading
    def lowered(self):
        if self._lowered is None:
            from cubridge.cuir.parser import parse
            from cubridge.lower import lower
            text = (self.directory / self.entry["cuir"]).read_text()
            self._lowered = lower(parse(text, source=str(self.directory / self.entry["cuir"])), self.reference)
        return self._lowered

    @property
    def softmax(self) -> bool:
        ir = self.lowered().ir
        return ir is None or ir.norm == "softmax"

    def binder(self):
        """bind(Nq=, Nk=, Hq=, Hkv=, B=, params=, device=) -> extra inputs, or None for none. Rules
        candidates are re-derived from the run's spec copy and must give the run's exact CuIR."""
        cand = self.candidate()
        return cand.bind if cand is not None else None

    def candidate(self):
        """The rules candidate (transfer.rules.Candidate) whose bind gives the extra inputs, or None."""
        if self._cand is None:
            self._cand = _rules_candidate(self.directory, self.dispatch, self.entry)
        return self._cand or None

    def cuir_params(self) -> dict:
        return self.kernel.space.to_cuir(self.entry["config"])

    @property
    def kernel(self):
        """The bucket's reference kernel (runtime.kernels): its compile options and its launch."""
        from cubridge.runtime.kernels import reference_kernel
        return reference_kernel(self.reference)

    def cubin(self) -> bytes:
        """The run's cubin for this bucket; compiled (once, cached on disk) only where it has none."""
        if self.entry.get("cubin") and (self.directory / self.entry["cubin"]).is_file():
            return (self.directory / self.entry["cubin"]).read_bytes()
        from cubridge.runtime.build import NO_COMPILER, available_compiler, compile_cubin
        compiler = available_compiler()
        if compiler is None:
            raise LaunchError(f"the run carries no cubin for {self.entry['label']} and {NO_COMPILER}",
                              where=str(self.directory / "dispatch.json"),
                              hint="tune on a machine with nvcc (the run then carries its cubins)")
        d = self.dispatch
        options = self.kernel.compile_options(self.entry["config"], int(d["head_dim"]), d["dtype"])
        return compile_cubin(self.lowered().source, arch=d["arch"], options=options,
                             compiler=compiler, name=f"{self.entry['candidate']}.cu").cubin

    def loaded(self, device: torch.device) -> bool:
        return device.index in self._loaded

    # -------------------------------------------------------------- per shape
    def prepare(self, device: torch.device, b: int, hq: int, hkv: int, nq: int, nk: int, scale: float,
                runtime: dict) -> Prepared:
        bind = self.binder()
        extra = {}
        if bind is not None:
            kw = {"runtime": runtime} if runtime else {}
            extra = bind(Nq=nq, Nk=nk, Hq=hq, Hkv=hkv, B=b, params=self.cuir_params(), device=device, **kw)
        launchable = self.lowered().args(extra, device)
        lse = torch.empty((b, hq, nq), device=device, dtype=torch.float32)
        d = self.dispatch
        launch = self.kernel.shape_launch(self.cubin(), self.entry["config"], int(d["head_dim"]), d["dtype"],
                                          launchable, device, (b, hq, hkv, nq, nk), scale)
        self._loaded.add(device.index)
        return Prepared(launch, lse, launchable)


class RuntimePrepared:
    """The launch at one shape of a spec with runtime inputs (document ids, say), built on the first
    call and kept: each call binds its inputs (the block table built on the GPU by
    runtime.block_table, the static part of the binding cached per shape by call_binding), re-points
    the launch at them (fa3: `Fa3Launch.rebind`, the tile order counted and sorted on the GPU) and
    launches, all in the current stream: no host sync, no re-tracing, no cubin read. Building a new
    launch per call (re-reading the cubin, lpt_order's ~30 torch calls) was 0.7-1.2 ms of host time
    per call on the H100 host (session 9). A kernel whose launch cannot rebind (fa2_sm80's closure)
    gets a new one per call, which costs it nothing much.

    One lock per shape serialises launch() across threads: a call's table build, rebind and launch
    share the shape's launch object and its per-stream buffers, so two threads calling at one shape
    could otherwise launch one call's q / k / v on the other's tables (A rebinds, B rebinds and
    launches, A launches with B's), or build B's table into the buffer A's queued kernel reads."""

    def __init__(self, bucket: Bucket, device: torch.device, dims: tuple, scale: float, names: tuple):
        b, hq, hkv, nq, nk = dims
        self.bucket, self.device, self.dims, self.scale, self.names = bucket, device, dims, scale, names
        self.lse_scratch = torch.empty((b, hq, nq), device=device, dtype=torch.float32)
        cand = bucket.candidate()
        self._bind = (cand.binder_at(Nq=nq, Nk=nk, Hq=hq, Hkv=hkv, B=b, params=bucket.cuir_params(), device=device)
                      if cand is not None else lambda runtime, scratch: {})
        self._lowered, self._cubin, self._launch = bucket.lowered(), None, None
        self._scratch: dict = {}           # raw stream -> the per-call tables' buffers (driver.scratch_tensor)
        self._lock = threading.Lock()      # uncontended: well under a microsecond per call

    def launch(self, q, k, v, out, lse, rt: list):
        """Launch on this call's runtime inputs `rt` (in declared order); returns what the launch
        reads (the packed variant), which a CUDA graph capture must keep alive. The block table,
        tile counts and order live in this shape's buffers for the current stream (the stream runs
        one call's kernels before the next call's writes); a capture gets fresh ones (the graph's)."""
        with self._lock:
            return self._launch_locked(q, k, v, out, lse, rt)

    def _launch_locked(self, q, k, v, out, lse, rt: list):
        scratch = None
        if not torch.cuda.is_current_stream_capturing():
            stream = current_stream(self.device.index)
            scratch = self._scratch.get(stream)
            if scratch is None:
                scratch = self._scratch[stream] = {}
        variant = self._lowered.args(self._bind(dict(zip(self.names, rt)), scratch), self.device, per_call=True)
        rebind = getattr(self._launch, "rebind", None)
        if rebind is not None:
            rebind(variant, scratch)
        else:
            b, d = self.bucket, self.bucket.dispatch
            self._cubin = self._cubin or b.cubin()
            self._launch = b.kernel.shape_launch(self._cubin, b.entry["config"], int(d["head_dim"]), d["dtype"],
                                                 variant, self.device, self.dims, self.scale)
            b._loaded.add(self.device.index)
        self._launch(q, k, v, out, lse)
        return variant


def _rules_candidate(directory: Path, dispatch: dict, entry: dict):
    """The rules candidate, or False when the candidate needs no binding (other origins)."""
    if entry.get("origin") != "rules":
        return False
    from cubridge.cuir.parser import parse_file
    from cubridge.paths import ref_kernel_dir
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    # The run keeps its spec as spec.py; the transfer records the spec's name in the program, so
    # the copy is loaded under the name it was tuned as.
    spec = replace(load_spec(str(directory / dispatch["spec"])), name=dispatch.get("spec_name") or "spec")
    ref = parse_file(ref_kernel_dir(entry["reference"]) / "kernel.cuir")
    cand = transfer(ref, spec, spec_params=dict(dispatch.get("spec_params") or {}))
    if cand.text.strip() != (directory / entry["cuir"]).read_text().strip():
        raise LaunchError("the rules transfer of this checkout gives another kernel than the run's "
                          f"{entry['cuir']}", where=str(directory / "dispatch.json"),
                          hint="load the run with the cubridge version that tuned it, or tune again")
    return cand
