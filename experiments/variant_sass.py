"""ptxas spills and SASS opcode counts of one lowered variant at tile configs with knobs, on this
machine (nvcc, no GPU): where a variant's tile or mask costs instructions (cubridge/lower/NOTES.md
Session 13: ag_sliding_window's ISETP per element, ag_head_mask's two-piece path).

    python experiments/variant_sass.py tests/corpus/ag_head_mask.py 128x128 128x128+variant_codegen+row_select

A config is BMxBN[+KNOB...] (experiments/patches/knobs/KNOB.patch, as variant_tiles.py); the spec
`dense` is kernel.cu itself (causal). DH=64 in the environment builds head dim 64.
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from expkit import disassembler, lowered_patched, sass_opcodes  # noqa: E402
from cubridge.runtime.fa3_sm90 import KERNEL_DIR, default_config  # noqa: E402

OPS = ("ISETP", "FSEL", "VIADD", "IMAD", "HGMMA", "BRA")


def source(spec: str) -> str:
    if spec == "dense":
        return (KERNEL_DIR / "kernel.cu").read_text()
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.runtime.kernels import reference_kernel
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    cand = transfer(parse_file(reference_kernel("fa3_sm90").cuir_path()), load_spec(spec), spec_params={})
    return lower(cand.program, "fa3_sm90").source


def measure(src: str, config: str, dense: bool) -> str:
    parts = config.split("+")
    bm, bn = map(int, parts[0].split("x"))
    text = lowered_patched(src, *[f"knobs/{k}" for k in parts[1:]]) if parts[1:] else src
    cfg = replace(default_config(int(os.environ.get("DH", 128)), dense, True, 8192, variant=not dense),
                  block_m=bm, block_n=bn)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cu").write_text(text)
        r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", *cfg.defines(), f"-I{KERNEL_DIR}",
                            "-Xptxas", "-v", "-o", f"{d}/k.cubin", f"{d}/k.cu"], capture_output=True, text=True)
        if r.returncode:
            return f"nvcc failed: {r.stderr[-300:]}"
        spill = max(int(l.split("bytes spill stores")[0].split(",")[-1]) for l in r.stderr.splitlines()
                    if "bytes spill stores" in l)
        sass = subprocess.run([*disassembler(), f"{d}/k.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(o.split(".")[0] for o in sass_opcodes(sass))
    return f"spill {spill:4} B  total {sum(ops.values()):6}  " + "  ".join(f"{o} {ops[o]:5}" for o in OPS)


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    spec, configs = sys.argv[1], sys.argv[2:]
    src = source(spec)
    for c in configs:
        print(f"{Path(spec).stem:26} {c:36} {measure(src, c, spec == 'dense')}", flush=True)


if __name__ == "__main__":
    main()
