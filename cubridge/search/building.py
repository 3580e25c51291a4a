"""What a worker derives from a job payload: the spec, the reference kernel's CuIR, a candidate's
binder, and the lowered, compiled kernel. Shared by the job functions (jobs.py) and the GPU side
(measure.py), which therefore need not import each other.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import tempfile
from pathlib import Path

from cubridge.errors import CubridgeError
from cubridge.vocab import Proposal

LOWERING_MISSING = ("lowering is not available: cubridge.lower is not in this checkout yet, so no "
                    "kernel can be generated, compiled or timed (screening results stand)")


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
    from cubridge.paths import ref_kernel_dir
    return parse_file(ref_kernel_dir(name) / "kernel.cuir")


@functools.lru_cache(maxsize=16)
def _rules_candidate(reference: str, spec: str, spec_params: str):
    """The rules transfer, redone in this process (deterministic): it carries the binder."""
    from cubridge.transfer.rules import transfer
    return transfer(reference_program(reference), _spec(spec), spec_params=json.loads(spec_params))


def binder_for(p: dict):
    """`bind(Nq, Nk, Hq, Hkv, B, params, device) -> extra inputs` of a candidate, or None when it
    needs none. Rules candidates are re-derived; other origins bind nothing (their proposer must
    emit programs without extra inputs until it ships a binder)."""
    if p.get("origin") != "rules":
        return None
    cand = _rules_candidate(p["reference"], _spec_path(p), json.dumps(p.get("spec_params") or {}, sort_keys=True))
    if Proposal(cand.text, "rules").id != Proposal(p["text"], "rules").id:
        raise CubridgeError("the rules transfer in this worker differs from the driver's candidate",
                            hint="driver and workers must run the same cubridge checkout")
    return cand.bind


def _program(text: str, pid: str):
    from cubridge.cuir.parser import parse
    return parse(text, source=f"<candidate {pid}>")


def lowering():
    """The lowering module, or None where it is not built yet."""
    try:
        return importlib.import_module("cubridge.lower")
    except ModuleNotFoundError as e:
        if e.name in ("cubridge.lower", "cubridge"):
            return None
        raise


def build(p: dict):
    """Lower and compile one candidate at one config: (lowered, CompileResult). Raises
    Unavailable where lowering is missing, BuildError (or any CubridgeError) on failure."""
    from cubridge.runtime.build import compile_cubin, default_compiler
    lowered, options = lower_kernel(p)
    result = compile_cubin(lowered.source, arch=p["arch"], options=options, compiler=default_compiler(),
                           cache_dir=p.get("cache_dir"), name=f"{p['candidate']}.cu")
    return lowered, result


def lower_kernel(p: dict):
    """(lowered kernel, compiler options) for the payload's candidate at its tile config.

    Takes the agreed interface (lower(program, ref, config=, head_dim=, dtype=) with `defines` on
    the result) where the lowering offers it, else today's lower(program, ref), with the tile
    config's -D flags from the reference kernel's runtime Config (what kernel.cu reads)."""
    from cubridge.paths import ref_kernel_dir
    if p.get("cuda_source"):        # an LLM patch of the reference kernel, accepted on a GPU
        from cubridge.lower import LoweredKernel
        lowered = LoweredKernel(p["reference"], p["cuda_source"])
        defines = runtime_defines(p["reference"], p["config"], int(p["head_dim"]), p["dtype"])
        return lowered, ["-std=c++17", *defines, f"-I{ref_kernel_dir(p['reference'])}"]
    lower = lowering()
    if lower is None:
        raise Unavailable(LOWERING_MISSING)
    program = _program(p["text"], p["candidate"])
    if "config" in inspect.signature(lower.lower).parameters:
        from cubridge.search.space import SPACES
        lowered = lower.lower(program, p["reference"], config=SPACES[p["reference"]].to_cuir(p["config"]),
                              head_dim=int(p["head_dim"]), dtype=p["dtype"])
    else:
        lowered = lower.lower(program, p["reference"])
    defines = getattr(lowered, "defines", None)
    if defines is None:
        defines = runtime_defines(p["reference"], p["config"], int(p["head_dim"]), p["dtype"])
    return lowered, ["-std=c++17", *defines, f"-I{ref_kernel_dir(p['reference'])}"]


def runtime_defines(ref: str, point: dict, head_dim: int, dtype: str) -> list[str]:
    """The reference kernel's -D flags for a tile config. Masking lives in the lowered mask
    region, so the reference's own causal switch stays off."""
    if ref == "fa3_sm90":
        from dataclasses import replace

        from cubridge.search.space import fa3_config
        return replace(fa3_config(point, head_dim), causal=False, bf16=dtype == "bf16").defines()
    if ref == "fa2_sm80":
        import torch

        from cubridge.search.space import fa2_config
        return fa2_config(point).defines(head_dim, torch.bfloat16 if dtype == "bf16" else torch.float16, causal=False)
    raise CubridgeError(f"no tile-config flags known for reference kernel {ref!r}")


class Unavailable(Exception):
    """Lowering is not in this checkout: compile / measure report it, never invent numbers."""


def cubin_path(cache_dir: str | Path, key: str) -> Path:
    """Where compile_cubin stored the cubin of `key`."""
    return Path(cache_dir) / f"{key}.cubin"
