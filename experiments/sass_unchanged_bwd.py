"""Is the SASS of the dense Hopper backward (ref_kernels/fa3_bwd_sm90) the same in the working tree
as at a git revision? For every option of cubridge.runtime.fa3_bwd_sm90.OPTIONS at D 64 / 128,
causal / full, fp16 / bf16 (one spec per (D, causal) pair, both dtypes across them), kernel.cu of
both trees is compiled by nvcc and the disassemblies are compared line by line (comments and
instruction encodings dropped). Used when the variant hooks went in (session 9: 20 of 20 identical
to bcd5b0b). CPU only.

    python experiments/sass_unchanged_bwd.py --base REV [--jobs 2] [--options OPTION ...]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expkit import disassembler
from cubridge.runtime import fa3_bwd_sm90 as hb

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("ref_kernels/fa3_bwd_sm90", "ref_kernels/fa3_sm90")   # kernel.cu includes ../fa3_sm90
SPECS = [(128, True, True), (128, False, False), (64, True, False), (64, False, True)]


def checkout(rev: str, into: Path) -> Path:
    """The two kernel folders as of `rev` under `into` (same layout: the relative include works)."""
    for rel in DIRS:
        (into / rel).mkdir(parents=True)
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{rel}"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split()
        for name in names:
            blob = subprocess.run(["git", "show", f"{rev}:{rel}/{name}"], cwd=ROOT, capture_output=True).stdout
            (into / rel / name).write_bytes(blob)
    return into


def sass(root: Path, option: str, spec, work: Path) -> list[str]:
    d, causal, bf16 = spec
    opts = [o for o in hb.options(d, causal, bf16, option) if not o.startswith("-I")]
    cubin = work / f"{root.name}_{option}_{d}{int(causal)}{int(bf16)}.cubin"
    subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", *opts,
                    *(f"-I{root / rel}" for rel in DIRS), "-o", str(cubin), str(root / DIRS[0] / "kernel.cu")],
                   check=True, capture_output=True, text=True)
    text = subprocess.run([*disassembler(), str(cubin)], check=True, capture_output=True, text=True).stdout
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).rstrip() for ln in text.splitlines()
            if not ln.lstrip().startswith("//") and str(work) not in ln]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--options", nargs="+", choices=sorted(hb.OPTIONS), metavar="OPTION",
                    help="compare these options only (default: every option; one new since --base has no base build)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = checkout(args.base, Path(tmp) / "base")
        # a variant-only option (PERSIST) has no dense build: its static_assert refuses the dense source
        dense = sorted(set(args.options or hb.OPTIONS) - set(hb.VARIANT_ONLY_OPTIONS))
        cases = [(o, s) for o in dense for s in SPECS]
        jobs = [(root, o, s) for o, s in cases for root in (old, ROOT)]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            texts = list(pool.map(lambda j: sass(j[0], j[1], j[2], Path(tmp)), jobs))
        differ = 0
        for i, (option, spec) in enumerate(cases):
            same = texts[2 * i] == texts[2 * i + 1]
            differ += not same
            print(f"{'same' if same else 'DIFFERS':8s} {len(texts[2 * i]):6d} lines  {option} D={spec[0]} "
                  f"causal={int(spec[1])} bf16={int(spec[2])}", flush=True)
        print(f"{len(cases) - differ} of {len(cases)}: SASS of the working tree identical to {args.base}")
        return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
