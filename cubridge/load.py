"""`cubridge.load(DIR)`: the tuned kernel of a `cubridge-tune` output directory, as a PyTorch op.

The op picks the config for the sequence length from the dispatch table, refuses before any
launch what the kernel was not built for (another GPU architecture, dtype, head dim or head
counts, a misread layout, CPU tensors), and caches everything derived from the shape, so a
repeated call only allocates the output and launches. It works inside torch.compile(fullgraph=True)
and CUDA graphs (cubridge/op/). The run directory carries its cubins: loading needs no compiler.

Example (on the GPU the run tuned for):
    >>> attn = cubridge.load("out/h100_prefixlm")                     # doctest: +SKIP
    >>> out = attn(q, k, v)       # q [B, Hq, N, D], k/v [B, Hkv, N, D], bf16 on cuda   # doctest: +SKIP
    >>> out = attn(q, k, v, layout="bnhd", scale=0.1)                 # doctest: +SKIP
"""
from __future__ import annotations

import json
from pathlib import Path

from cubridge.archs import ARCH_RUNS_ON, check_arch  # noqa: F401 - part of this module's API
from cubridge.errors import CubridgeError


def load(directory):
    """The tuned op of a run directory (a cubridge.op.TunedOp; torch is imported here, not before)."""
    from cubridge.op.tuned import TunedOp
    manifest, dispatch = read_run(Path(directory))
    return TunedOp(Path(directory), manifest, dispatch)


def read_run(directory: Path) -> tuple[dict, dict]:
    """(manifest, dispatch) of a run directory, with clear errors for what is missing."""
    d = Path(directory)
    if not (d / "manifest.json").is_file():
        raise CubridgeError("not a cubridge-tune output directory (no manifest.json)", where=str(d),
                            hint="give the output directory of a cubridge-tune run (its config's output:)")
    manifest = json.loads((d / "manifest.json").read_text())
    if not (d / "dispatch.json").is_file():
        raise CubridgeError(f"this run has no tuned kernel (status: {manifest.get('status')}: {manifest.get('message')})",
                            where=str(d), hint="run cubridge-tune on a GPU machine (without --dry-run)")
    return manifest, json.loads((d / "dispatch.json").read_text())

