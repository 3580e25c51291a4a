"""A run directory straight from tile configs, with no search and no timing: transfer the spec onto
the reference kernel (rules), lower it, compile one cubin per config and write what
`cubridge.load` reads (dispatch.json, manifest.json, spec.py, kernel/, cubins/), all paths
relative to the directory. For a machine that cannot tune (no Optuna, or no time): the tile
configs are the runtime's measured defaults for lowered variants unless given.

Example (compiles with nvcc or NVRTC; no GPU needed):
    >>> build_run("prefixlm", "out/prefixlm_default", heads_q=16, heads_kv=4)     # doctest: +SKIP
    >>> attn = cubridge.load("out/prefixlm_default")                               # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

from cubridge.errors import CubridgeError

DEFAULT_LENGTHS = (1024, 8192)


def default_points(reference: str, head_dim: int, lengths, wide: bool | int = False) -> dict:
    """seqlen -> tile config point: the reference kernel's untuned defaults for a lowered variant
    (wide: the generator's wide_tile of its VariantIR, see wide_tile)."""
    from cubridge.runtime.kernels import reference_kernel
    kernel = reference_kernel(reference)
    return {n: kernel.variant_default(head_dim, n, wide) for n in lengths}


def wide_tile(reference: str, ir) -> bool | int:
    """The generator's wide_tile(ir) (a measured wider default tile for this variant; an int: from
    that length on), else False."""
    import importlib
    from cubridge.runtime.kernels import reference_kernel
    wide = getattr(importlib.import_module(reference_kernel(reference).generator), "wide_tile", lambda _: False)(ir)
    return wide if isinstance(wide, int) else bool(wide)


def build_run(spec: str, out, *, reference: str = "fa3_sm90", dtype: str = "bf16", head_dim: int = 128,
              heads_q: int = 16, heads_kv: int = 4, configs: dict | None = None, lengths=DEFAULT_LENGTHS,
              spec_params: dict | None = None, arch: str = "sm_90a") -> Path:
    """Write a loadable run directory at `out`; `configs` maps a sequence length to a tile config
    point (default: default_points). Returns the directory."""
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.runtime.build import portable_options
    from cubridge.runtime.kernels import reference_kernel
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    out, kernel = Path(out), reference_kernel(reference)
    spec_obj = load_spec(spec)
    cand = transfer(parse_file(kernel.cuir_path()), spec_obj, spec_params=spec_params or {})
    lowered = lower(cand.program, reference)
    points = {int(n): dict(p) for n, p in (configs or default_points(reference, head_dim, lengths,
                                                                       wide_tile(reference, lowered.ir))).items()}
    cid = hashlib.sha256(cand.text.encode()).hexdigest()[:16]
    (out / "kernel").mkdir(parents=True, exist_ok=True)
    (out / "cubins").mkdir(exist_ok=True)
    (out / "kernel" / f"{cid}.cuir").write_text(cand.text)
    shutil.copyfile(spec_obj.path, out / "spec.py")
    ordered = sorted(points)
    buckets = []
    for i, n in enumerate(ordered):
        point, name = points[n], f"{cid}_{kernel.space.label(points[n])}"
        options = kernel.compile_options(point, head_dim, dtype)
        if not (out / "cubins" / f"{name}.cubin").is_file():
            (out / "cubins" / f"{name}.cubin").write_bytes(_compile(lowered.source, arch, options))
            (out / "kernel" / f"{name}.cu").write_text(lowered.source)
        lo = 1 if i == 0 else math.floor(math.sqrt(ordered[i - 1] * n)) + 1
        hi = None if i == len(ordered) - 1 else math.floor(math.sqrt(n * ordered[i + 1]))
        buckets.append({"shape": f"N={n}", "seqlen": n, "min_seqlen": lo, "max_seqlen": hi, "candidate": cid,
                        "origin": "rules", "reference": reference, "config": point, "label": kernel.space.label(point),
                        "cuir": f"kernel/{cid}.cuir", "cuda": f"kernel/{name}.cu", "cubin": f"cubins/{name}.cubin",
                        "nvcc_options": portable_options(options)})
    dispatch = {"arch": arch, "dtype": dtype, "head_dim": head_dim, "heads_q": heads_q, "heads_kv": heads_kv,
                "spec": "spec.py", "spec_name": spec_obj.name, "spec_params": spec_params or {}, "buckets": buckets}
    (out / "dispatch.json").write_text(json.dumps(dispatch, indent=1, sort_keys=True) + "\n")
    manifest = {"status": "built", "message": "built from default tile configs by cubridge.op.build (not tuned, "
                "not timed)", "spec": {"name": spec_obj.name, "sha256": hashlib.sha256(spec_obj.source.encode()).hexdigest()},
                "dispatch": "dispatch.json"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return out


def _compile(source: str, arch: str, options: list[str]) -> bytes:
    from cubridge.runtime.build import NO_COMPILER, available_compiler, compile_cubin
    compiler = available_compiler()
    if compiler is None:
        raise CubridgeError(NO_COMPILER, where="cubridge.op.build")
    return compile_cubin(source, arch=arch, options=options, compiler=compiler, name="kernel.cu").cubin
