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


def default_points(reference: str, head_dim: int, lengths) -> dict:
    """seqlen -> tile config point: the runtime's defaults for a lowered variant."""
    if reference != "fa3_sm90":
        raise CubridgeError(f"no default tile configs for reference kernel {reference!r}", where="cubridge.op.build",
                            hint="pass configs={seqlen: point} or use reference='fa3_sm90'")
    from cubridge.runtime.fa3_sm90 import default_config
    out = {}
    for n in lengths:
        c = default_config(head_dim, causal=False, seqlen=n, variant=True)
        out[n] = {"block_m": c.block_m, "block_n": c.block_n, "stages": c.stages, "persistent": c.persistent}
    return out


def label(point: dict) -> str:
    return f"{point['block_m']}x{point['block_n']}s{point['stages']}" + ("p" if point.get("persistent") else "")


def build_run(spec: str, out, *, reference: str = "fa3_sm90", dtype: str = "bf16", head_dim: int = 128,
              heads_q: int = 16, heads_kv: int = 4, configs: dict | None = None, lengths=DEFAULT_LENGTHS,
              spec_params: dict | None = None, arch: str = "sm_90a") -> Path:
    """Write a loadable run directory at `out`; `configs` maps a sequence length to a tile config
    point (default: default_points). Returns the directory."""
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.paths import ref_kernel_dir
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    out = Path(out)
    spec_obj = load_spec(spec)
    points = {int(n): dict(p) for n, p in (configs or default_points(reference, head_dim, lengths)).items()}
    cand = transfer(parse_file(ref_kernel_dir(reference) / "kernel.cuir"), spec_obj, spec_params=spec_params or {})
    cid = hashlib.sha256(cand.text.encode()).hexdigest()[:16]
    (out / "kernel").mkdir(parents=True, exist_ok=True)
    (out / "cubins").mkdir(exist_ok=True)
    (out / "kernel" / f"{cid}.cuir").write_text(cand.text)
    shutil.copyfile(spec_obj.path, out / "spec.py")
    lowered = lower(cand.program, reference)
    ordered = sorted(points)
    buckets = []
    for i, n in enumerate(ordered):
        point, name = points[n], f"{cid}_{label(points[n])}"
        options = _options(reference, point, head_dim, dtype)
        if not (out / "cubins" / f"{name}.cubin").is_file():
            (out / "cubins" / f"{name}.cubin").write_bytes(_compile(lowered.source, arch, options, reference))
            (out / "kernel" / f"{name}.cu").write_text(lowered.source)
        lo = 1 if i == 0 else math.floor(math.sqrt(ordered[i - 1] * n)) + 1
        hi = None if i == len(ordered) - 1 else math.floor(math.sqrt(n * ordered[i + 1]))
        buckets.append({"shape": f"N={n}", "seqlen": n, "min_seqlen": lo, "max_seqlen": hi, "candidate": cid,
                        "origin": "rules", "reference": reference, "config": point, "label": label(point),
                        "cuir": f"kernel/{cid}.cuir", "cuda": f"kernel/{name}.cu", "cubin": f"cubins/{name}.cubin",
                        "nvcc_options": options})
    dispatch = {"arch": arch, "dtype": dtype, "head_dim": head_dim, "heads_q": heads_q, "heads_kv": heads_kv,
                "spec": "spec.py", "spec_name": spec_obj.name, "spec_params": spec_params or {}, "buckets": buckets}
    (out / "dispatch.json").write_text(json.dumps(dispatch, indent=1, sort_keys=True) + "\n")
    manifest = {"status": "built", "message": "built from default tile configs by cubridge.op.build (not tuned, "
                "not timed)", "spec": {"name": spec_obj.name, "sha256": hashlib.sha256(spec_obj.source.encode()).hexdigest()},
                "dispatch": "dispatch.json"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return out


def _options(reference: str, point: dict, head_dim: int, dtype: str) -> list[str]:
    if reference != "fa3_sm90":
        raise CubridgeError(f"cubridge.op.build compiles fa3_sm90 kernels, not {reference!r}", where="cubridge.op.build",
                            hint="use reference='fa3_sm90' (or cubridge-tune for other kernels)")
    from cubridge.runtime.fa3_sm90 import Fa3Config
    cfg = Fa3Config(head_dim=head_dim, block_m=point["block_m"], block_n=point["block_n"], stages=point["stages"],
                    persistent=bool(point.get("persistent")), causal=False, bf16=dtype == "bf16")
    return ["-std=c++17", *cfg.defines()]


def _compile(source: str, arch: str, options: list[str], reference: str) -> bytes:
    from cubridge.paths import ref_kernel_dir
    from cubridge.runtime.build import NO_COMPILER, available_compiler, compile_cubin
    compiler = available_compiler()
    if compiler is None:
        raise CubridgeError(NO_COMPILER, where="cubridge.op.build")
    return compile_cubin(source, arch=arch, options=[*options, f"-I{ref_kernel_dir(reference)}"],
                         compiler=compiler, name="kernel.cu").cubin
