"""Instructions per KV step of the Hopper forward's steady loop, by opcode class, from SASS (issue 18,
session 15): fa3_sm90 built for Fa3Config rows (default: the dense D 128 / 64 8k defaults) and optionally
FA4's SM90 forward listings (experiments/results/session11_h100/fa4_sass/03_*.sass full, 04_* causal, D 128,
128 x 128; from experiments/fa4_sass.py). CPU only; the GPU side (executed counts, stalls) is
experiments/ncu_stalls_fwd.py.

The steady loop is the innermost backward branch whose body holds >= 2 HGMMA and >= 25 MUFU (the QK and
P V of one step and its exponentials); where several qualify (FA4 peels a masked loop before its steady
one) the last in the listing is taken. A forward span inside it with >= 16 FSEL (ours' mask pass of a
partial tile) is left out: the count is the path of a step without a mask (the NaN arm that pins the P V
wait, 2 instructions, stays in). The mbarrier
try_wait retry jumps out of the loop and back, so its retries are not in the count (ncu's are).

    python3 experiments/sass_step_count_fwd.py [--rows d128_full d128_full_z ...] [--fa4 FILE ...] [--out x.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from expkit import disassembler
from expkit.sass_stalls_fwd import op_class, parse_listing as parse

from cubridge.runtime.fa3_sm90 import KERNEL_DIR, KERNEL_SOURCE, NVCC_FLAGS, default_config

ROWS = {   # name -> (head_dim, causal, Fa3Config overrides over default_config(head_dim, causal, 8192))
    "d128_full": (128, False, {}), "d128_full_128": (128, False, dict(block_n=128, tail_split=False)),
    "d128_causal": (128, True, {}), "d64_full": (64, False, {}), "d64_causal": (64, True, {}),
}
OPTION_SUFFIX = {"z": dict(mbar_sleep=True), "d": dict(desc_once=True), "p": dict(producer_sleep=True)}   # d64_full_optd: with desc_once


def config_of(row: str):
    base, _, flags = row.partition("_opt")
    d, causal, over = ROWS[base]
    extra = {}
    for ch in flags:
        extra.update(OPTION_SUFFIX[ch])
    return replace(default_config(d, causal, seqlen=8192), **over, **extra)


def steady_loop(text: str) -> list[str]:
    ins = parse(text)
    loops = []
    for i, (a, op, t) in enumerate(ins):
        # (a BRA right after a BRA: the mbarrier retry stub's return into the loop, not a loop)
        if op.startswith("BRA") and t is not None and t < a and not ins[i - 1][1].startswith("BRA"):
            body = [o for b, o, _ in ins if t <= b <= a]
            if sum(o.startswith("HGMMA") for o in body) >= 2 and sum(o.startswith("MUFU") for o in body) >= 25:
                loops.append((t, a))
    if not loops:
        raise SystemExit("error: no loop with HGMMA and MUFU in the listing (not the forward kernel?)")
    head, end = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)][-1]
    # the mask pass (a forward span with >= 16 FSEL: ours' partial tiles) is not a dense step's path
    skip = []
    for a, op, t in ins:
        if op.startswith("BRA") and head < a < end and t is not None and a < t <= end:
            if sum(o.startswith("FSEL") for b, o, _ in ins if a < b < t) >= 16:
                skip.append((a, t))
    return [op for a, op, _ in ins if head <= a <= end and not any(s < a < t for s, t in skip)]


def counts(body: list[str]) -> dict:
    classes = collections.Counter(op_class(op) for op in body)
    ops = collections.Counter(op.split(".")[0] for op in body)
    return dict(instructions=len(body), classes=dict(classes.most_common()), opcodes=dict(ops.most_common()))


def ours(row: str, work: Path) -> tuple[str, dict]:
    cfg = config_of(row)
    cubin = work / f"{row}.cubin"
    run = subprocess.run(["nvcc", *NVCC_FLAGS, *cfg.defines(), f"-I{KERNEL_DIR}", "-Xptxas", "-v", "-o", str(cubin),
                          str(KERNEL_SOURCE)], capture_output=True, text=True, check=True)
    spills = [line for line in run.stderr.splitlines() if "spill stores" in line]
    text = subprocess.run([*disassembler(), str(cubin)], capture_output=True, text=True, check=True).stdout
    start = text.find(".text.fa3_sm90_fwd:")
    return (text[start:] if start >= 0 else text), {"config": " ".join(cfg.defines()), "ptxas": spills}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=["d128_full", "d128_full_128", "d64_full"],
                    help=f"{sorted(ROWS)}, each optionally with _opt + flags {sorted(OPTION_SUFFIX)}")
    ap.add_argument("--fa4", nargs="*", type=Path, default=[], help="SASS listings of FA4's SM90 forward")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in args.rows:
            text, info = ours(row, Path(tmp))
            results[row] = {**counts(steady_loop(text)), **info}
    for path in args.fa4:
        results[f"fa4:{path.name[:2]}"] = counts(steady_loop(path.read_text()))
    names = list(results)
    print("| static per step | " + " | ".join(names) + " |\n| --- |" + " --- |" * len(names))
    print("| instructions | " + " | ".join(str(results[n]["instructions"]) for n in names) + " |")
    for k in sorted({k for r in results.values() for k in r["classes"]}):
        print(f"| {k} | " + " | ".join(str(results[n]["classes"].get(k, 0)) for n in names) + " |")
    for op in ("IMAD", "IADD3", "R2UR", "SYNCS", "BRA", "LOP3", "SHF", "LEA", "MOV", "UIADD3", "ISETP", "SEL"):
        print(f"| {op} | " + " | ".join(str(results[n]["opcodes"].get(op, 0)) for n in names) + " |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
