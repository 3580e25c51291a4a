#!/usr/bin/env bash
# Session 7 GPU check (coordinator): tests/gpu files given as arguments, in parallel workers
# (pytest-xdist, compile-bound), each file under its own time limit; log + junit XML under $OUT.
#   usage (repo root, GPU):  bash experiments/device_s7_check.sh tests/gpu/test_bwd.py tests/gpu/test_op.py
set -uo pipefail
OUT=${OUT:-/tmp/s7_check}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/check.log") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for f in "$@"; do
  echo "=== $f ($(date -u +%H:%M:%S))"
  timeout ${PER_FILE_S:-420} python3 -m pytest "$f" -q -n ${WORKERS:-6} -p no:cacheprovider -p no:benchmark 2>&1 \
    | grep -vE "^\s*$" | tail -${TAIL:-25}
done
echo "=== done ($(date -u +%H:%M:%S))"
