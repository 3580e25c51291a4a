"""What a worker derives from a job payload: the spec, the reference kernel's CuIR, a candidate's
binder, and the lowered, compiled kernel. Shared by the job functions (jobs.py) and the GPU side
(measure.py), which therefore need not import each other.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import tempfile
from pathlib import Path

from cubridge.runtime.kernels import reference_kernel


@functools.lru_cache(maxsize=8)
def _spec(spec: str):
    from cubridge.spec import load_spec
    return load_spec(spec)


def spec_for(p: dict):
    """The payload's spec (loaded once per worker)."""
    return _spec(_spec_path(p))


def _spec_path(p: dict) -> str:
    """A spec file the worker cannot see (another node of a Ray cluster) is rebuilt from the
    source the driver sent, under the same file name."""
    spec = p["spec"]
    if ("/" in spec or spec.endswith(".py")) and not Path(spec).is_file() and p.get("spec_source"):
        digest = hashlib.sha256(p["spec_source"].encode()).hexdigest()[:16]
        local = Path(tempfile.gettempdir()) / "cubridge_specs" / digest / Path(spec).name
        if not local.is_file():
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(p["spec_source"])
        spec = str(local)
    return spec


@functools.lru_cache(maxsize=8)
def reference_program(name: str):
    from cubridge.cuir.parser import parse_file
    return parse_file(reference_kernel(name).cuir_path())


def binder_for(p: dict):
    """`bind(Nq, Nk, Hq, Hkv, B, params, device) -> extra inputs` of the payload's candidate from
    its binding data (the driver's transfer result; the worker never redoes the transfer), or
    None for a candidate that reads no extra input."""
    if not p.get("binding"):
        return None
    from cubridge.transfer.rules import Binding, bind_inputs
    return functools.partial(bind_inputs, Binding.from_json(p["binding"]), spec_for(p), dict(p.get("spec_params") or {}))


def _program(text: str, pid: str):
    from cubridge.cuir.parser import parse
    return parse(text, source=f"<candidate {pid}>")


def lowering():
    """The lowering package (cubridge.load asks for it)."""
    return importlib.import_module("cubridge.lower")


def build(p: dict):
    """Lower and compile one candidate at one config: (lowered, CompileResult). Raises
    BuildError (or any CubridgeError) on failure."""
    from cubridge.runtime.build import compile_cubin, default_compiler
    lowered, options = lower_kernel(p)
    result = compile_cubin(lowered.source, arch=p["arch"], options=options, compiler=default_compiler(),
                           name=f"{p['candidate']}.cu")
    return lowered, result


def lower_kernel(p: dict):
    """(lowered kernel, compiler options) for the payload's candidate at its tile config; the
    options are the reference kernel's own (ReferenceKernel.compile_options)."""
    from cubridge.lower import LoweredKernel, lower
    kernel = reference_kernel(p["reference"])
    options = kernel.compile_options(p["config"], int(p["head_dim"]), p["dtype"])
    if p.get("cuda_source"):        # an LLM patch of the reference kernel, accepted on a GPU
        return LoweredKernel(p["reference"], p["cuda_source"]), options
    return lower(_program(p["text"], p["candidate"]), p["reference"]), options
