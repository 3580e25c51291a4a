#!/usr/bin/env bash
# One call on a 2-GPU machine (nvidia-h200-x2; carry .devdeps): the fa3 kernel A/B against the
# previous version, Ray trials/min on 1 vs 2 GPUs, and ncu of the sparsest variant vs causal.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
[ -d .devdeps ] && bash .devdeps/install.sh >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== fa3 A/B ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 experiments/ab_fa3_kernel.py 74f23f2:ref_kernels/fa3_sm90/kernel.cu \
  --out "$OUT/ab_fa3_v7_vs_v6.json" 2>&1 | tail -12
echo "== ray scaling ($(date +%T))"
timeout 300 python3 experiments/ray_scaling.py --out "$OUT/ray_scaling.json" 2>&1 | tail -40
echo "== ncu ($(date +%T))"
for v in "global_sliding_window 16384" "causal 16384"; do
  CUDA_VISIBLE_DEVICES=0 timeout 90 ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis -k regex:fa3 --launch-skip 2 --launch-count 1 \
    python3 experiments/profile_variant.py $v > "$OUT/ncu_${v// /_}.txt" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Warp Cycles Per Issued|Stall|No Eligible|Active Warps Per Scheduler|Eligible Warps" "$OUT/ncu_${v// /_}.txt" | head -30
done
