"""Instructions per consumer step of the Hopper backward's main loop, by opcode class, from SASS:
fa3_bwd_sm90 built for one or more options (D = 128, causal, bf16 by default; --variants: built-in specs
lowered onto them, e.g. sigmoid's and composite's per-element work beside softmax's), and optionally a
SASS listing of FA4's SM90 backward (experiments/results/session11_h100/fa4_sass/02_*.sass, from
cuobjdump). Session 11 (ref_kernels/fa3_bwd_sm90/NOTES.md "Session 11") used it to tie the tensor
pipe's 58% (ours) vs 77% (FA4) under ncu to the instructions each step issues. CPU only.

The loop is the backward branch after the last HGMMA that jumps above the first HGMMA. Ours has
two P-pass bodies (masked / unmasked steps): the count skips the masked one (the first forward
branch inside the loop over a span with >= 25 MUFU or FMNMX and the most ISETP), i.e. it is an unmasked step. FA4 has one
body that masks every step (its FSEL / ISETP are in its count).

    python3 experiments/sass_step_count.py --options bulk_overlap_lse_lean bulk_overlap_lse_lean_issue \
        [--fa4 experiments/results/session11_h100/fa4_sass/02_*.sass] [--out counts.json]

--fwd ROW...: the forward instead (fa3_sm90 at D 256 causal, bench_d256's rows, e.g. 128x80fr), its steady KV
step per consumer warp (session 15: R2UR / IMAD / IADD3 before and after d256o's options), counted by
experiments/sass_step_count_fwd.py (fwd_step_counts; the same as `sass_step_count_fwd.py --rows 128x80fr`).
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from expkit import disassembler
from expkit.sass_stalls_fwd import parse_listing as parse
from cubridge.runtime import fa3_bwd_sm90 as hb
# The forward's step count is expkit's (one rule for this --fwd and experiments/sass_step_count_fwd.py); the callers
# of sass_step_count.fwd_step_counts get it from there.
from expkit.sass_stalls_fwd import d256_config, fwd_listing, fwd_step_counts  # noqa: F401 (re-exported)

UNIFORM = ("R2UR", "S2UR", "ELECT")
CLASSES = {"fp32": ("FFMA", "FMUL", "FADD", "FSEL", "FMNMX"), "mufu": ("MUFU",), "convert": ("F2FP",),
           "int": ("IMAD", "VIADD", "LOP3", "SHF", "IADD3", "LEA", "ISETP", "SEL", "PRMT", "PLOP3", "IABS", "I2F",
                   "F2I", "CS2R", "MOV"),
           "shared": ("LDS", "STS", "STSM", "LDSM"), "hgmma": ("HGMMA",),
           "sync": ("BAR", "SYNCS", "WARPGROUP", "MEMBAR", "FENCE", "DEPBAR")}


def op_class(op: str) -> str:
    base = op.split(".")[0]
    if base.startswith("U") or base in UNIFORM:
        return "uniform"
    return next((c for c, ops in CLASSES.items() if base in ops), "other")


def step_counts(text: str) -> dict:
    """Per-class and per-opcode counts of one (unmasked) step of the listing's HGMMA loop."""
    ins = parse(text)
    hg = [a for a, op, _ in ins if op.startswith("HGMMA")]
    if not hg:
        raise SystemExit("error: no HGMMA in the listing (not an sm_90a wgmma kernel?)")
    end, head = next((a, t) for a, op, t in ins if op.startswith("BRA") and a > hg[-1] and t is not None
                     and t < hg[0])
    # the per-element P bodies: forward spans with >= 25 MUFU (softmax's EX2, sigmoid's TANH) or FMNMX
    # (relu); the masked one is the span with the most ISETP (its index compares). Composite's masked
    # body comes second in the listing, the dense kernel's first (the same span the old first-EX2 rule took).
    spans = []
    for a, op, t in ins:
        if op.startswith("BRA") and head < a < end and t is not None and a < t < end:
            ops = [o for b, o, _ in ins if a < b < t]
            if sum(1 for o in ops if o.startswith(("MUFU", "FMNMX"))) >= 25:
                spans.append((sum(1 for o in ops if o.startswith("ISETP")), -a, (a + 16, t)))
    skip = max(spans)[2] if spans else None
    body = [op for a, op, _ in ins if head <= a <= end and not (skip and skip[0] <= a < skip[1])]
    classes = collections.Counter(op_class(op) for op in body)
    ops = collections.Counter(op.split(".")[0] for op in body)
    return dict(instructions=len(body), classes=dict(classes.most_common()), opcodes=dict(ops.most_common()))


def ours_fwd(row: str, work: Path) -> str:
    """fa3_sm90's SASS at D 256 causal for a bench_d256 row (128x80fr, 128x80fru ...): sass_step_count_fwd's."""
    return fwd_listing(d256_config(row), work, f"fwd_{row}")[0]


def ours(option: str, d: int, causal: bool, bf16: bool, work: Path, variant: str | None = None) -> str:
    """The main kernel's SASS; `variant`: that built-in spec lowered (cubridge.lower.fa3_bwd_sm90), built
    non-causal as the runtime builds it (its mask is the variant's)."""
    source = hb.KERNEL_SOURCE
    if variant is not None:
        from cubridge.runtime.variant_bwd import VariantBackward
        source = work / f"{variant}.cu"
        source.write_text(VariantBackward(variant).hopper.source)
        causal = False
    cubin = work / f"{option}_{variant}.cubin"
    subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", *hb.options(d, causal, bf16, option),
                    f"-I{hb.KERNEL_DIR}", "-o", str(cubin), str(source)], check=True, capture_output=True, text=True)
    text = subprocess.run([*disassembler(), str(cubin)], check=True, capture_output=True, text=True).stdout
    start = text.find(".text.fa3_bwd_sm90:")   # the main kernel only (the cubin also holds the convert / prep)
    return text[start:] if start >= 0 else text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--options", nargs="+", default=[hb.DEFAULT_OPTION], choices=sorted(hb.OPTIONS))
    ap.add_argument("--d", type=int, default=128, choices=hb.HEAD_DIMS)
    ap.add_argument("--full", action="store_true", help="full attention instead of causal")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--fa4", type=Path, help="a SASS listing of FA4's SM90 backward main kernel")
    ap.add_argument("--variants", nargs="+", default=[],
                    help="built-in specs lowered onto each option (a VARIANT_OPTIONS one), counted beside it")
    ap.add_argument("--fwd", nargs="+", default=[],
                    help="instead: the forward's (fa3_sm90) steady KV step at D 256 causal for these bench_d256 rows")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in args.fwd:
            results[row] = fwd_step_counts(ours_fwd(row, Path(tmp)))
        if args.fwd:
            args.options = []
        for option in args.options:
            results[option] = step_counts(ours(option, args.d, not args.full, not args.fp16, Path(tmp)))
            for variant in args.variants:
                results[f"{variant}@{option}"] = step_counts(ours(option, args.d, not args.full, not args.fp16,
                                                                  Path(tmp), variant))
    if args.fa4:
        results["fa4"] = step_counts(args.fa4.read_text())
    names = list(results)
    keys = sorted({k for r in results.values() for k in r["classes"]})
    print("| per step | " + " | ".join(names) + " |\n| --- |" + " --- |" * len(names))
    print("| instructions | " + " | ".join(str(results[n]["instructions"]) for n in names) + " |")
    for k in keys:
        print(f"| {k} | " + " | ".join(str(results[n]["classes"].get(k, 0)) for n in names) + " |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
