"""Is the SASS of fa3_sm90's default configs the same in the working tree as at a git revision?
A refactor of ref_kernels/fa3_sm90 that should change no instruction (issue 16's bar "SASS of the
default configs unchanged") is checked with it: kernel.cu of both trees is compiled by nvcc for
every default config (D 64 / 128 / 256, causal / full, bf16 / fp16, the short- and long-sequence
tiles of default_config; all persistent, which only changes the grid) and the `cuobjdump -sass`
texts are compared line by line (nvdisasm -c where cuobjdump is not installed). CPU only.

    python experiments/sass_unchanged.py --base HEAD~1 [--head HEAD] [--jobs 2] [--only 128]
    python experiments/sass_unchanged.py --ptxas --base REV     # registers / spills, not more than REV
    python experiments/sass_unchanged.py --ptxas --space [--variants] --base REV
        (every config of the tuner's space, both masks and dtypes; --variants: also each built-in
        variant lowered onto both trees, bf16, at every config of the space; exit 1 where the
        working tree uses more registers or spills more than REV, and it lists every config that
        spills at all)
"""
from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
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


def space_configs(head_dims=(64, 128, 256), bf16s=(True, False), causals=(False, True)) -> list:
    """Every distinct Fa3Config of the tuner's space (persistent or not: the same build)."""
    from cubridge.runtime.kernels.fa3_sm90 import SPACE, config
    out = []
    for d in head_dims:
        for pt in SPACE.points(d, "sm_90a"):
            for causal in causals:
                for bf16 in bf16s:
                    c = replace(config(pt, d), causal=causal, bf16=bf16, persistent=True)
                    if c not in out:
                        out.append(c)
    return out


def lower_variants(kernel_dir: Path, names) -> dict:
    """name -> path of the variant lowered onto kernel_dir/kernel.cu, written beside it (its
    includes resolve to that tree's headers)."""
    from cubridge.cuir.parser import parse_file
    from cubridge.lower.fa3_sm90 import lower_source
    from cubridge.lower.variant import extract
    from cubridge.paths import ref_kernel_dir
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    ref = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
    text = (kernel_dir / "kernel.cu").read_text()
    out = {}
    for name in names:
        path = kernel_dir / f"variant_{Path(name).stem}.cu"
        path.write_text(lower_source(text, extract(transfer(ref, load_spec(name)).program)))
        out[name] = path
    return out


def checkout_kernel(rev: str, into: Path) -> Path:
    """ref_kernels/fa3_sm90 as of `rev`, written into the folder `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNEL_REL}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{KERNEL_REL}/{name}"], cwd=ROOT,
                              capture_output=True, check=True).stdout
        (into / name).write_bytes(blob)
    return into


def build(kernel_dir: Path, config, work: Path, source: Path | None = None) -> tuple[Path, str]:
    """(cubin, ptxas -v report) of kernel.cu in kernel_dir (or `source`) compiled for config."""
    source = source or kernel_dir / "kernel.cu"
    tag = "_".join(f.lstrip("-D").replace("=", "") for f in config.defines())
    cubin = work / f"{kernel_dir.parent.name}_{kernel_dir.name}_{source.stem}_{tag}.cubin"
    done = subprocess.run(["nvcc", *NVCC_FLAGS, *config.defines(), "-Xptxas", "-v", f"-I{kernel_dir}", "-o",
                           str(cubin), str(source)], check=True, capture_output=True, text=True)
    return cubin, done.stderr


def sass(kernel_dir: Path, config, work: Path) -> list[str]:
    """cuobjdump -sass of kernel.cu in kernel_dir compiled for config (any line naming the
    temporary cubin dropped: the two builds differ in their paths only)."""
    cubin, _ = build(kernel_dir, config, work)
    text = subprocess.run([*disassembler(), str(cubin)], check=True, capture_output=True, text=True).stdout
    return [ln for ln in text.splitlines() if str(work) not in ln]


def usage(kernel_dir: Path, config, work: Path, source: Path | None = None) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of the attention entry, from ptxas -v."""
    report = build(kernel_dir, config, work, source)[1]
    part = report[report.index(f"Function properties for {ENTRY.decode()}"):][:600]
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part).groups()
    return int(re.search(r"Used (\d+) registers", part).group(1)), int(stores), int(loads)


def trees(base: str, head: str | None, tmp: Path) -> tuple[Path, Path]:
    """Both kernel folders as copies under tmp (the working tree's too: variants are written
    beside kernel.cu)."""
    (tmp / "base").mkdir()
    old = checkout_kernel(base, tmp / "base")
    new = shutil.copytree(ROOT / KERNEL_REL, tmp / "head") if head is None else None
    if new is None:
        (tmp / "head").mkdir()
        new = checkout_kernel(head, tmp / "head")
    return old, Path(new)


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


def compare_ptxas(base: str, head: str | None, head_dims, jobs: int, space: bool = False,
                  variants=()) -> int:
    """Registers and spills of the attention entry, base vs head: 1 if head uses more anywhere.
    space: every config of the tuner's space; variants: also these specs lowered onto each tree
    (bf16, every config)."""
    with tempfile.TemporaryDirectory() as tmp:
        old, new = trees(base, head, Path(tmp))
        configs = space_configs(head_dims) if space else default_configs(head_dims)
        cases = [(None, c) for c in configs]
        sources = {old: lower_variants(old, variants), new: lower_variants(new, variants)} if variants else {}
        cases += [(v, c) for v in variants for c in configs if c.bf16 and not c.causal]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            got = list(pool.map(lambda p: usage(p[0], p[1][1], Path(tmp), sources[p[0]][p[1][0]] if p[1][0] else None),
                                [(d, case) for case in cases for d in (old, new)]))
        worse, spilling = 0, []
        for i, (variant, config) in enumerate(cases):
            a, b = got[2 * i], got[2 * i + 1]
            more = any(y > x for x, y in zip(a, b))
            worse += more
            label = f"{variant or 'dense'} {' '.join(config.defines()[:-1])}"
            if b[1] or b[2]:
                spilling.append(f"{label}: {b[1]} / {b[2]} bytes (base {a[1]} / {a[2]})")
            if more or not space:
                print(f"{'MORE' if more else 'ok':5s} regs / spill st / ld {a} -> {b}  {label}", flush=True)
        print(f"spilling in {head or 'the working tree'}: {len(spilling)} of {len(cases)}")
        print("".join(f"  {line}\n" for line in spilling), end="")
        print(f"{len(cases) - worse} of {len(cases)} {'space' if space else 'default'} configs: no more registers "
              f"or spills in {head or 'the working tree'} than in {base}")
        return 1 if worse else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    ap.add_argument("--head", default=None, help="git revision to compare (default: the working tree)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", type=int, nargs="*", default=[64, 128, 256], help="head dims")
    ap.add_argument("--ptxas", action="store_true", help="compare registers and spills (ptxas -v) instead")
    ap.add_argument("--space", action="store_true", help="with --ptxas: every config of the tuner's space")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="with --ptxas: variants lowered onto both trees too (no names: the built-in ones)")
    args = ap.parse_args(argv)
    if not args.ptxas:
        return compare(args.base, args.head, tuple(args.only), args.jobs)
    from cubridge.spec import builtin_specs
    builtin = [v for v in builtin_specs() if v not in ("full", "causal")]   # those two: the kernel itself
    variants = () if args.variants is None else args.variants or builtin
    return compare_ptxas(args.base, args.head, tuple(args.only), args.jobs, args.space, variants)


if __name__ == "__main__":
    sys.exit(main())
