"""Is the SASS of fa3_sm90's default configs the same in the working tree as at a git revision?
A refactor of ref_kernels/fa3_sm90 that should change no instruction (issue 16's bar "SASS of the
default configs unchanged") is checked with it: kernel.cu of both trees is compiled by nvcc for
every default config (D 64 / 128 / 256, causal / full, bf16 / fp16, the short- and long-sequence
tiles of default_config; all persistent, which only changes the grid) and the `cuobjdump -sass`
texts are compared line by line (nvdisasm -c where cuobjdump is not installed). CPU only.

    python experiments/sass_unchanged.py --base HEAD~1 [--head HEAD] [--jobs 2] [--only 128]
    python experiments/sass_unchanged.py --ptxas --base REV     # registers / spills, not more than REV
"""
from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expkit import disassembler
from cubridge.runtime.fa3_sm90 import ENTRY, NVCC_FLAGS, default_config

ROOT = Path(__file__).resolve().parents[1]
KERNEL_REL = "ref_kernels/fa3_sm90"


def default_configs(head_dims=(64, 128, 256)) -> list:
    """Every distinct Fa3Config default_config picks for a dense kernel."""
    configs = {default_config(d, causal, bf16, n) for d in head_dims for causal in (False, True)
               for bf16 in (True, False) for n in (1024, 2048, 8192)}
    return sorted(configs, key=lambda c: (c.head_dim, c.causal, c.bf16, c.block_m, c.block_n))


def checkout_kernel(rev: str, into: Path) -> Path:
    """ref_kernels/fa3_sm90 as of `rev`, written into the folder `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNEL_REL}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{KERNEL_REL}/{name}"], cwd=ROOT,
                              capture_output=True, check=True).stdout
        (into / name).write_bytes(blob)
    return into


def build(kernel_dir: Path, config, work: Path) -> tuple[Path, str]:
    """(cubin, ptxas -v report) of kernel.cu in kernel_dir compiled for config."""
    tag = "_".join(f.lstrip("-D").replace("=", "") for f in config.defines())
    cubin = work / f"{kernel_dir.parent.name}_{kernel_dir.name}_{tag}.cubin"
    done = subprocess.run(["nvcc", *NVCC_FLAGS, *config.defines(), "-Xptxas", "-v", f"-I{kernel_dir}", "-o",
                           str(cubin), str(kernel_dir / "kernel.cu")], check=True, capture_output=True, text=True)
    return cubin, done.stderr


def sass(kernel_dir: Path, config, work: Path) -> list[str]:
    """cuobjdump -sass of kernel.cu in kernel_dir compiled for config (any line naming the
    temporary cubin dropped: the two builds differ in their paths only)."""
    cubin, _ = build(kernel_dir, config, work)
    text = subprocess.run([*disassembler(), str(cubin)], check=True, capture_output=True, text=True).stdout
    return [ln for ln in text.splitlines() if str(work) not in ln]


def usage(kernel_dir: Path, config, work: Path) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of the attention entry, from ptxas -v."""
    report = build(kernel_dir, config, work)[1]
    part = report[report.index(f"Function properties for {ENTRY.decode()}"):][:600]
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part).groups()
    return int(re.search(r"Used (\d+) registers", part).group(1)), int(stores), int(loads)


def trees(base: str, head: str | None, tmp: Path) -> tuple[Path, Path]:
    (tmp / "base").mkdir()
    old = checkout_kernel(base, tmp / "base")
    if head is None:
        return old, ROOT / KERNEL_REL
    (tmp / "head").mkdir()
    return old, checkout_kernel(head, tmp / "head")


def compare(base: str, head: str | None, head_dims, jobs: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        old, new = trees(base, head, Path(tmp))
        configs = default_configs(head_dims)
        pairs = [(d, c) for c in configs for d in (old, new)]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            texts = list(pool.map(lambda p: sass(p[0], p[1], Path(tmp)), pairs))
        differ = 0
        for i, config in enumerate(configs):
            a, b = texts[2 * i], texts[2 * i + 1]
            same = a == b
            differ += not same
            label = " ".join(config.defines()[:-1])
            print(f"{'same' if same else 'DIFFERS':8s} {len(a):6d} lines  {label}", flush=True)
            if not same:
                sys.stdout.writelines(ln + "\n" for ln in list(difflib.unified_diff(a, b, lineterm=""))[:40])
        print(f"{len(configs) - differ} of {len(configs)} default configs: SASS of {head or 'the working tree'} "
              f"identical to {base}")
        return 1 if differ else 0


def compare_ptxas(base: str, head: str | None, head_dims, jobs: int) -> int:
    """Registers and spills of the attention entry, base vs head: 1 if head uses more anywhere."""
    with tempfile.TemporaryDirectory() as tmp:
        old, new = trees(base, head, Path(tmp))
        configs = default_configs(head_dims)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            got = list(pool.map(lambda p: usage(p[0], p[1], Path(tmp)), [(d, c) for c in configs for d in (old, new)]))
        worse = 0
        for i, config in enumerate(configs):
            a, b = got[2 * i], got[2 * i + 1]
            worse += any(y > x for x, y in zip(a, b))
            print(f"{'MORE' if any(y > x for x, y in zip(a, b)) else 'ok':5s} regs / spill st / ld {a} -> {b}  "
                  f"{' '.join(config.defines()[:-1])}", flush=True)
        print(f"{len(configs) - worse} of {len(configs)} default configs: no more registers or spills in "
              f"{head or 'the working tree'} than in {base}")
        return 1 if worse else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    ap.add_argument("--head", default=None, help="git revision to compare (default: the working tree)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", type=int, nargs="*", default=[64, 128, 256], help="head dims")
    ap.add_argument("--ptxas", action="store_true", help="compare registers and spills (ptxas -v) instead")
    args = ap.parse_args(argv)
    return (compare_ptxas if args.ptxas else compare)(args.base, args.head, tuple(args.only), args.jobs)


if __name__ == "__main__":
    sys.exit(main())
