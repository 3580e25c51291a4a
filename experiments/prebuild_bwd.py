"""Build every specialisation (D 64 / 128, causal / full, fp16 / bf16) of fa3_bwd_sm90 options into the compile
cache, all in parallel (nvcc runs outside the GIL), before a tests/gpu/test_bwd_sm90.py run: its session fixture
builds them one after another in each pytest worker. No GPU needed.

    python3 experiments/prebuild_bwd.py --options OPTION [OPTION ...] [--jobs 16]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import expkit  # noqa: F401 - cubridge importable from a bare checkout
from cubridge.runtime import fa3_bwd_sm90 as hb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--options", nargs="+", required=True, choices=sorted(hb.OPTIONS), metavar="OPTION")
    ap.add_argument("--jobs", type=int, default=16)
    args = ap.parse_args(argv)
    specs = list(itertools.product(args.options, hb.HEAD_DIMS, (False, True), (False, True)))
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda s: hb.build_cubin(s[1], s[2], s[3], option=s[0]), specs))
    print(f"prebuild_bwd: {len(specs)} cubins of {len(args.options)} option(s) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
