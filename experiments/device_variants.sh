#!/usr/bin/env bash
# One device call: the variants on the Hopper kernel -- GPU verification of all ten, the reference
# kernel's own GPU suite (hooks changed its signature), then the side-by-side benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest tests/gpu/test_variants.py -q -x -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/test_variants.log"
timeout 200 python3 -m pytest tests/gpu/test_fa3_sm90.py tests/gpu/test_lift.py tests/gpu/test_fa2_sm80.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/test_fa3.log"
timeout ${BENCH_TIMEOUT:-300} python3 experiments/bench_variants.py --out "$OUT/variants.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
