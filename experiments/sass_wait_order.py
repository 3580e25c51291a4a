"""Where ptxas puts the steady-state loop's softmax relative to wgmma.wait_group 0 (NOTES v17,
item 3). No GPU: builds the cubin (nvcc), disassembles it (nvdisasm from the CUDA toolkit, or the
`nvidia-cuda-nvdisasm` wheel) and counts, in the consumer code, the MUFU instructions between each
`WARPGROUP.DEPBAR.LE gsb0, 0x1` and the next `... 0x0`, and after it (up to the next HGMMA).
Overlap means the loop's MUFU sit between the two waits.

    python experiments/sass_wait_order.py                       # the kernel as it is
    python experiments/sass_wait_order.py --patch pv_wait_first   # the placement before session 11
    python experiments/sass_wait_order.py --variant sigmoid     # a lowered variant's source
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from cubridge.runtime.fa3_sm90 import Fa3Config, build_cubin  # noqa: E402

CONFIGS = [Fa3Config(128, 128, 128, 2, False, True), Fa3Config(128, 128, 128, 2, True, True),
           Fa3Config(128, 128, 176, 2, False, True), Fa3Config(64, 192, 128, 2, True, True)]
INSTR = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);")


def waits(sass: str) -> list[tuple[int, int]]:
    """(MUFU between wait_group 1 and wait_group 0, MUFU after wait_group 0 before the next
    HGMMA) for each such pair in the consumer code (between setmaxnreg inc and dec)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, sass.splitlines()) if m]
    lo = next(a for a, t in ins if "TRY_ALLOC" in t)
    hi = next(a for a, t in ins if "DEALLOC" in t)
    seg = [(a, t) for a, t in ins if lo <= a <= hi]
    deps = [(a, t) for a, t in seg if "DEPBAR" in t]
    out = []
    for (a1, t1), (a0, t0) in zip(deps, deps[1:]):
        if "0x1" in t1 and "0x0" in t0:
            nxt = next((a for a, t in seg if a > a0 and "HGMMA" in t), hi)
            out.append((sum(a1 < a < a0 and "MUFU" in t for a, t in seg),
                        sum(a0 < a < nxt and "MUFU" in t for a, t in seg)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patch", help="an experiments/patches/ name applied first")
    ap.add_argument("--variant", help="a built-in variant, lowered onto fa3_sm90 (D = 128 configs only)")
    args = ap.parse_args(argv)
    source = None
    if args.patch:
        from expkit import patched_source
        source = patched_source(args.patch)
    if args.variant:
        from expkit import Ours
        from expkit import inline_headers, patched_files
        changed = patched_files(args.patch) if args.patch else {}
        source = inline_headers(Ours().lowered(args.variant)[2], changed)
    from expkit import disassembler
    tool = disassembler()
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in CONFIGS:
            if args.variant and (cfg.head_dim != 128 or cfg.causal):
                continue
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(build_cubin(cfg, source=source))
            sass = subprocess.run([*tool, str(cubin)], capture_output=True, text=True, check=True).stdout
            pairs = waits(sass)
            label = f"D{cfg.head_dim} {cfg.block_m}x{cfg.block_n} {'causal' if cfg.causal else 'full'}"
            print(f"{label:<22} (MUFU between wait 1 and wait 0, MUFU after wait 0) per pair: {pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
