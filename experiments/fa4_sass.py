"""Issues 17 / 18: FlashAttention-4's SM90 SASS beside ours, read instead of guessed.

The CuTe DSL compiles FA4's kernels on first call; with CUTE_DSL_KEEP_CUBIN / CUTE_DSL_DUMP_DIR it
leaves the cubins behind. This script (on a GPU with FA4 importable) runs FA4's forward (full and
causal, D 128) and backward (causal) once at 8k with those set, disassembles every cubin it finds
with cuobjdump, and writes per kernel the SASS and an instruction histogram (HGMMA, MUFU, BAR,
R2UR, FMNMX, shuffles, ...) to --out. Ours are built on any machine with nvcc
(experiments/sass_unchanged.py), so the comparison itself needs no GPU.

    python experiments/fa4_sass.py --out $OUT/fa4_sass
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from expkit import sass_opcodes

OPCODES = ["HGMMA", "MUFU.EX2", "FMNMX", "FADD", "FMUL", "FFMA", "SHFL", "BAR.SYNC", "BAR.ARV", "R2UR",
           "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "SYNCS", "UTMALDG", "UTMASTG", "STSM", "F2FP", "LDS", "STS",
           "BRA", "IMAD", "MOV", "UMOV", "USETMAXREG", "LDG", "STG", "RED", "ATOM"]


def histogram(sass: str) -> dict:
    count = collections.Counter(sass_opcodes(sass))
    out = {"instructions": sum(count.values())}
    for op in OPCODES:
        out[op] = sum(c for name, c in count.items() if name == op or name.startswith(op + "."))
    return out


def kernels_of(sass: str) -> dict:
    """Split cuobjdump's text by `Function : NAME` into {name: text}."""
    parts = re.split(r"\n\s*Function : (\S+)\n", "\n" + sass)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def run_fa4(dump: Path) -> list[str]:
    os.environ.update({"CUTE_DSL_KEEP_CUBIN": "1", "CUTE_DSL_KEEP": "cubin,ptx", "CUTE_DSL_KEEP_PTX": "1",
                       "CUTE_DSL_DUMP_DIR": str(dump), "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0"})
    import torch
    import expkit  # noqa: F401 - cubridge importable from a bare checkout
    from expkit.peers import fa4_backward, make_fa4
    done = []
    b, h, n, d = 2, 32, 8192, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for name in ("full", "causal"):
        fn, _ = make_fa4(name, q, k, v)
        fn()
        done.append(f"forward {name}")
    fa4_backward(True, q, k, v, do, bhnd=False)()
    done.append("backward causal")
    torch.cuda.synchronize()
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dump = args.out / "dump"
    dump.mkdir(exist_ok=True)
    result = {"ran": run_fa4(dump), "kernels": {}}
    cubins = sorted(p for p in dump.rglob("*") if p.suffix == ".cubin")
    for i, cubin in enumerate(cubins):
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
        for j, (name, text) in enumerate(kernels_of(sass).items()):
            short = f"{i:02d}_{j}_" + re.sub(r"[^A-Za-z0-9_]", "_", name)[30:80]
            (args.out / f"{short}.sass").write_text(text)
            result["kernels"][name] = {"cubin": cubin.name, "sass_file": f"{short}.sass", **histogram(text)}
    for p in sorted(dump.rglob("*"), reverse=True):   # the SASS text is what is read; the dump goes
        p.unlink() if p.is_file() else p.rmdir()
    dump.rmdir()
    (args.out / "fa4_sass.json").write_text(json.dumps(result, indent=1))
    print(f"{len(cubins)} cubins, {len(result['kernels'])} kernels")
    for name, h in result["kernels"].items():
        print(f"{name[:70]:<70} insts {h['instructions']:>6} HGMMA {h['HGMMA']:>4} MUFU.EX2 {h['MUFU.EX2']:>4} "
              f"BAR {h['BAR.SYNC'] + h['BAR.ARV']:>3} R2UR {h['R2UR']:>4}")
    return 0 if result["kernels"] else 1


if __name__ == "__main__":
    sys.exit(main())
