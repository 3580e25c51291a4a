"""Instructions per KV step of the Hopper forward's steady loop, by opcode class, from SASS (issue 18,
sessions 15 / 17): fa3_sm90 built for Fa3Config rows (default: the dense D 128 / 64 8k defaults; a bench_d256
row such as 128x80fr is D 256 causal) and optionally FA4's SM90 forward listings (experiments/results/
session11_h100/fa4_sass/03_*.sass full, 04_* causal, D 128, 128 x 128; from experiments/fa4_sass.py). CPU only;
the GPU side (executed counts, stalls) is experiments/ncu_stalls_fwd.py. The one forward step count:
experiments/sass_step_count.py --fwd (the backward's counter's D 256 command line) calls fwd_step_counts here.

The steady loop is the innermost backward branch whose body holds both a QK HGMMA (A from shared memory:
`gdesc[UR..], R|RZ`) and a P V HGMMA (A from registers: `R.., R.., gdesc`); where several qualify (FA4 peels
a masked loop before its steady one) the last in the listing is taken. (Session 15 took ">= 25 MUFU" for the
P V's mark, which exp2_emu's steps no longer have; on every other listing both rules give the same loop.) A
forward span inside it with >= 16 FSEL (ours' mask pass of a partial tile) is left out: the count is the
path of a step without a mask (the NaN arm that pins the P V wait, 2 instructions, stays in). The mbarrier
try_wait retry jumps out of the loop and back, so its retries are not in the count (ncu's are).

    python3 experiments/sass_step_count_fwd.py [--rows d128_full d128_full_optz d64_full_opte2 128x80fr ...]
        [--fa4 FILE ...] [--out x.json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# the rule (steady_loop, counts, fwd_step_counts) and the build are expkit's, shared with sass_step_count.py --fwd
from expkit.sass_stalls_fwd import counts, d256_config, fwd_listing, fwd_step_counts, steady_loop  # noqa: F401

from cubridge.runtime.fa3_sm90 import default_config

ROWS = {   # name -> (head_dim, causal, Fa3Config overrides over default_config(head_dim, causal, 8192))
    "d128_full": (128, False, {}), "d128_full_128": (128, False, dict(block_n=128, tail_split=False)),
    "d128_causal": (128, True, {}), "d64_full": (64, False, {}), "d64_causal": (64, True, {}),
    "d64_causal_1k": (64, True, dict(block_m=128, tile_sections=0)),   # default_config(64, True, 1024)
}
OPTION_SUFFIX = {"z": dict(mbar_sleep=True), "d": dict(desc_once=True), "p": dict(producer_sleep=True)}   # d64_full_optd: with desc_once


def config_of(row: str):
    """'d64_full_optde2' -> default_config(64, False, 8192) with desc_once and exp2_emu=2 (flags: OPTION_SUFFIX's
    letters, then eM for exp2_emu=M)."""
    base, _, flags = row.partition("_opt")
    d, causal, over = ROWS[base]
    m = re.fullmatch(r"([a-z]*?)(?:e(\d))?", flags)
    if m is None or any(ch not in OPTION_SUFFIX for ch in m.group(1)):
        raise SystemExit(f"error: row {row}: flags after _opt are {sorted(OPTION_SUFFIX)}, then eM (exp2_emu=M)")
    extra = {"exp2_emu": int(m.group(2))} if m.group(2) else {}
    for ch in m.group(1):
        extra.update(OPTION_SUFFIX[ch])
    return replace(default_config(d, causal, seqlen=8192), **over, **extra)


def ours(row: str, work: Path) -> tuple[str, dict]:
    cfg = config_of(row) if row.partition("_opt")[0] in ROWS else d256_config(row)
    text, spills = fwd_listing(cfg, work, row)
    return text, {"config": " ".join(cfg.defines()), "ptxas": spills}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=["d128_full", "d128_full_128", "d64_full"],
                    help=f"{sorted(ROWS)}, each optionally with _opt + flags {sorted(OPTION_SUFFIX)} then eM "
                         "(exp2_emu=M); or a bench_d256 row (128x80fr: D 256 causal)")
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
