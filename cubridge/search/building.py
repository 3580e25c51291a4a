"""What a worker derives from a KernelJob: the spec, the reference kernel's CuIR, a candidate's
binder, and the lowered, compiled kernel. Shared by the job functions (jobs.py) and the GPU side
(measure.py), which therefore need not import each other.
"""
from __future__ import annotations

import functools
import hashlib
import tempfile
from pathlib import Path

from cubridge.runtime.kernels import reference_kernel
from cubridge.search.messages import KernelJob


@functools.lru_cache(maxsize=8)
def _spec(spec: str):
    from cubridge.spec import load_spec
    return load_spec(spec)


def spec_for(job: KernelJob):
    """The job's spec (loaded once per worker)."""
    return _spec(_spec_path(job.spec, job.spec_source))


def _spec_path(spec: str, source: str | None) -> str:
    """A spec file the worker cannot see (another node of a Ray cluster) is rebuilt from the
    source the driver sent, under the same file name."""
    if ("/" in spec or spec.endswith(".py")) and not Path(spec).is_file() and source:
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        local = Path(tempfile.gettempdir()) / "cubridge_specs" / digest / Path(spec).name
        if not local.is_file():
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(source)
        spec = str(local)
    return spec


@functools.lru_cache(maxsize=8)
def reference_program(name: str):
    from cubridge.cuir.parser import parse_file
    return parse_file(reference_kernel(name).cuir_path())


def binder_for(job: KernelJob):
    """`bind(Nq, Nk, Hq, Hkv, B, params, device) -> extra inputs` of the job's candidate from its
    binding data (the driver's transfer result; the worker never redoes the transfer), or None
    for a candidate that reads no extra input."""
    if not job.binding:
        return None
    from cubridge.transfer.rules import Binding, bind_inputs
    return functools.partial(bind_inputs, Binding.from_json(job.binding), spec_for(job), dict(job.spec_params))


def _program(text: str, pid: str):
    from cubridge.cuir.parser import parse
    return parse(text, source=f"<candidate {pid}>")


def build(job: KernelJob):
    """Lower and compile one candidate at one config: (lowered, CompileResult). Raises
    BuildError (or any CubridgeError) on failure."""
    from cubridge.runtime.build import compile_cubin, default_compiler
    lowered, options = lower_kernel(job)
    result = compile_cubin(lowered.source, arch=job.arch, options=options, compiler=default_compiler(),
                           name=f"{job.candidate}.cu")
    return lowered, result


def lower_kernel(job: KernelJob):
    """(lowered kernel, compiler options) for the job's candidate at its tile config; the
    options are the reference kernel's own (ReferenceKernel.compile_options)."""
    from cubridge.lower import LoweredKernel, lower
    kernel = reference_kernel(job.reference)
    options = kernel.compile_options(job.config, job.head_dim, job.dtype)
    if job.cuda_source:             # an LLM patch of the reference kernel, accepted on a GPU
        return LoweredKernel(job.reference, job.cuda_source), options
    return lower(_program(job.text, job.candidate), job.reference), options
