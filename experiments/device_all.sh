#!/usr/bin/env bash
# Everything the open issues' bars need from one GPU, in two device calls of under 10 minutes:
#   part A: every GPU test (both reference kernels, the ten variants on both, the lift check),
#           compute-sanitizer on both kernels, then the variant benchmark (ours vs FlexAttention,
#           SDPA + mask, eager, compiled reference, our causal softmax; GQA prefixlm);
#   part B: the Hopper kernel against cuDNN / flash (experiments/bench_fa3.py) and the main job,
#           cubridge-tune configs/h100_prefixlm.yaml, twice (cold, then warm compile cache).
# Narrower parts, one question each (each under ~4 minutes):
#   C: after a kernel change (GPU tests, fa3 sanitizer, mask variants vs Flex, normalisations);
#   D: the sigmoid FMA-share sweep and ncu of the dense kernel vs cuDNN at 1k;
#   E: after a launch-path change (fa3 tests, host cost per call, fa3 vs cuDNN);
#   F: ncu of composite beside sigmoid (pipes, stalls, per-instruction samples);
#   G: after a softmax-path change (all GPU tests, sanitizer, fa3 vs cuDNN, normalisations
#      round-robin beside our causal softmax);
#   H: the variant benchmark and the fa3 tile sweep;
#   I: the NVRTC build on the GPU, and the D = 64 1k sweep;
#   J: the Q-slot A/B (one vs two Q tiles in shared memory) at 1k and D = 64 8k, after the fa3 GPU
#      tests and the sanitizer, and the MUFU rate microbenchmark;
#   K: the kernel.cu experiment knobs (ascending KV order; the early next-tile fetch and a share of
#      the exponentials on the FMA pipe were measured here and then removed) at 1k and D = 64 8k;
#   M: after the cross-tile overlap (a tile's last P V and epilogue under the next tile's first
#      QK): every GPU test, the sanitizer, the OVERLAP_TILES A/B, fa3 vs cuDNN with the defaults;
#   N: the bars after M, measured again: fa3 vs cuDNN twice (a spread), the mask variants vs
#      FlexAttention at every length, the normalisations round-robin beside our causal softmax;
#   O, P (session 5): SOFTMAX_TURNS (softmax phases in turns; =2 also covering convert_p) and
#      composite's tile configs; the knob measured no faster and was removed (fa3 NOTES v16);
#   Q: three consumers at D = 128: GPU cases, every variant's tiles beside our causal softmax,
#      the dense sweep with them (at most 8 files come back from a call: keep each part under);
#   R: session 5's close: every GPU test, the sanitizer, the normalisations beside causal.
#   S1, S2 (session 6, after composite's softcap + sigmoid fusion): S1 every GPU test and the
#      sanitizer; S2 the normalisations beside our causal softmax (composite also at 192x80) and
#      beside eager PyTorch and torch.compile of the reference at 8k.
# Usage on the device (name the kind nvidia-h100-x1: the bars are stated for an H100; carry
# .devdeps from ../shared/tools/pack-device-deps.sh for part B):
#   bash experiments/device_all.sh A      bash experiments/device_all.sh B
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
step() { echo; echo "== $* ($(date +%T))"; }
sanitize_fa3() {   # memcheck + racecheck of the fa3 case (dense GQA ragged; lowered variants, 2 CTAs)
  step sanitizer
  for tool in memcheck racecheck; do
    timeout 90 compute-sanitizer --print-limit 20 --error-exitcode 9 --tool $tool \
      python3 experiments/bench_fa3.py --sanitize-case > "$OUT/fa3_$tool.log" 2>&1; echo "fa3 $tool rc=$?"
  done
}
case "${1:-A}" in
A)
  step gpu tests
  timeout 240 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
  step sanitizer
  SAN="compute-sanitizer --print-limit 20 --error-exitcode 9"
  for tool in memcheck racecheck; do
    timeout 60 $SAN --tool $tool python3 experiments/sanitize_fa2.py > "$OUT/fa2_$tool.log" 2>&1; echo "fa2 $tool rc=$?"
    timeout 90 $SAN --tool $tool python3 experiments/bench_fa3.py --sanitize-case > "$OUT/fa3_$tool.log" 2>&1; echo "fa3 $tool rc=$?"
  done
  step variant benchmark
  timeout 330 python3 experiments/bench_variants.py --out "$OUT/variants.json" --n 8192 4096 16384 1024 \
    --models llama2-7b qwen2.5-72b llama3.1-405b 2>&1 | tail -50
  ;;
B)
  step fa3 vs cuDNN
  timeout 260 python3 experiments/bench_fa3.py --out "$OUT/fa3_bench.json" 2>&1 | tail -25
  [ -d .devdeps ] && bash .devdeps/install.sh >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
  for run in cold warm; do
    step "cubridge-tune ($run compile cache)"
    start=$(date +%s)
    timeout 150 python3 -m cubridge.cli tune configs/h100_prefixlm.yaml --out "$OUT/tune_$run" 2>&1 | tail -3
    echo "tune $run wall $(( $(date +%s) - start )) s"
    [ "$run" = cold ] && cp -r "$OUT/tune_cold/cache" /tmp/warm_cache && \
      mkdir -p "$OUT/tune_warm" && cp -r /tmp/warm_cache "$OUT/tune_warm/cache"
    sed -n 5,12p "$OUT/tune_$run/report.md"
    rm -rf "$OUT/tune_$run/cache" "$OUT/tune_$run/kernel" "$OUT/tune_$run/candidates"
  done
  ;;
D)
  # The normalisations' MUFU balance (share of sigmoids on the FMA pipe, verified then timed
  # beside our causal softmax), and ncu of the dense kernel vs cuDNN at 1k (where it trails).
  step "math helpers + sigmoid/composite on the GPU"
  timeout 200 python3 -m pytest tests/gpu/test_cexpr_math.py tests/gpu/test_variants.py -q -p no:cacheprovider \
    -k "cexpr or sigmoid or composite" 2>&1 | tail -4 | tee "$OUT/tests.log"
  step "sigmoid FMA share"
  timeout 300 python3 experiments/sigmoid_fma_share.py --out "$OUT/sigmoid_fma_share.json" 2>&1 | tail -45
  step "ncu dense 1k: ours vs cuDNN"
  NCU="ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy"
  for v in causal full; do
    timeout 60 $NCU -k regex:fa3_sm90 --launch-skip 2 --launch-count 1 \
      python3 experiments/profile_variant.py $v 1024 --dense > "$OUT/ncu_ours_${v}_1k.txt" 2>&1
    timeout 60 $NCU -k regex:"sdpa|fmha|cudnn|sm90" --launch-skip 2 --launch-count 1 \
      python3 experiments/profile_variant.py $v 1024 --cudnn > "$OUT/ncu_cudnn_${v}_1k.txt" 2>&1
  done
  for f in "$OUT"/ncu_*_1k.txt; do echo "-- $f"; grep -E "^  [a-z_0-9]+.*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Registers Per|Grid Size|Dynamic Shared" "$f" | head -14; done
  ;;
E)
  # After a change to the fa3 launch path: its GPU tests, the host cost per call, fa3 vs cuDNN.
  step "fa3 GPU tests"
  timeout 240 python3 -m pytest tests/gpu/test_fa3_sm90.py tests/gpu/test_cexpr_math.py -q -p no:cacheprovider \
    2>&1 | tail -4 | tee "$OUT/tests.log"
  step "host cost per call"
  timeout 60 python3 experiments/host_overhead.py --out "$OUT/host_overhead.json" 2>&1 | tail -8
  step "fa3 vs cuDNN"
  timeout 260 python3 experiments/bench_fa3.py --out "$OUT/fa3_bench.json" 2>&1 | tail -25
  ;;
F)
  # Where composite's time goes beside sigmoid's (pipe utilisation, stalls, per-instruction samples).
  for v in composite sigmoid; do
    timeout 120 ncu --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
      --section SourceCounters --section SpeedOfLight -k regex:fa3_sm90_fwd --launch-skip 2 --launch-count 1 \
      -o "$OUT/ncu_$v" python3 experiments/profile_variant.py $v 8192 > "$OUT/ncu_${v}_run.txt" 2>&1
    ncu -i "$OUT/ncu_$v.ncu-rep" --page details --print-details all > "$OUT/ncu_$v.txt" 2>&1
    ncu -i "$OUT/ncu_$v.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${v}_sass.csv" 2>&1 || true
    grep -E "Duration|Issue Slots Busy|Pipe|Stall|Warp Cycles Per Issued" "$OUT/ncu_$v.txt" | head -30
  done
  ;;
G)
  # After a change to the fa3 kernel's softmax path: every GPU test, the fa3 sanitizer case, fa3
  # vs cuDNN, and the normalisations round-robin beside our causal softmax.
  step gpu tests
  timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
  sanitize_fa3
  step "fa3 vs cuDNN"
  timeout 200 python3 experiments/bench_fa3.py --out "$OUT/fa3_bench.json" 2>&1 | tail -22
  step "normalisations vs our causal softmax"
  timeout 150 python3 experiments/sigmoid_fma_share.py --out "$OUT/norms.json" --composite 0 --sigmoid 0 --relu \
    --n 8192 4096 16384 2>&1 | tail -16
  ;;
H)
  # The variant benchmark after a kernel change (ours vs FlexAttention, SDPA + mask, eager,
  # compiled reference, our causal softmax; GQA prefixlm), then the fa3 tile sweep beside cuDNN.
  step variant benchmark
  timeout 330 python3 experiments/bench_variants.py --out "$OUT/variants.json" --n 8192 4096 16384 1024 \
    --models llama2-7b qwen2.5-72b llama3.1-405b --sweep-variants 2>&1 | tail -40
  step "fa3 tile sweep"
  timeout 220 python3 experiments/bench_fa3.py --sweep --out "$OUT/fa3_sweep.json" 2>&1 | tail -14
  ;;
I)
  # The NVRTC build on the GPU (bitwise equal to nvcc's, dense and a lowered variant), then D = 64
  # at 1k beside cuDNN (the one Hopper bar still open).
  step "nvcc vs NVRTC"
  timeout 150 python3 -m pytest tests/gpu/test_fa3_sm90.py -q -p no:cacheprovider -k nvrtc 2>&1 | tail -3
  step "d64 1k sweep"
  timeout 200 python3 experiments/bench_fa3.py --sweep --only llama2-7b-d64:1024 --out "$OUT/sweep_d64_1k.json" \
    2>&1 | tail -4
  ;;
J)
  step fa3 gpu tests
  timeout 240 python3 -m pytest tests/gpu/test_fa3_sm90.py -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
  sanitize_fa3
  step MUFU rates
  timeout 60 python3 experiments/mufu_rates.py --out "$OUT/mufu_rates.json" 2>&1 | tail -26
  step Q-slot sweep
  timeout 300 python3 experiments/bench_fa3.py --sweep --out "$OUT/sweep_q_slots.json" --q-slots 1 2 \
    --only llama2-7b-d64:1024 llama2-7b:1024 qwen2.5-72b:1024 llama2-7b-d64:8192 \
    --tiles 128x128s2 128x128s4 192x128s2 128x176s2 2>&1 | tail -12
  ;;
K)
  step knob sweep
  timeout 420 python3 experiments/bench_fa3.py --sweep --out "$OUT/sweep_knobs.json" \
    --only llama2-7b-d64:1024 llama2-7b:1024 llama2-7b-d64:8192 --tiles 128x128s2 128x128s4 192x128s2 \
    --knobs "" KV_ASCENDING=1 2>&1 | tail -12
  ;;
M)
  step gpu tests
  timeout 260 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
  sanitize_fa3
  step overlap sweep
  timeout 200 python3 experiments/bench_fa3.py --sweep --out "$OUT/sweep_overlap.json" \
    --only llama2-7b-d64:1024 llama2-7b:1024 qwen2.5-72b:1024 llama2-7b-d64:8192 llama2-7b:8192 \
    --tiles 128x128s2 192x128s2 128x176s2 --knobs "" OVERLAP_TILES=0 2>&1 | tail -10
  step fa3 vs cuDNN
  timeout 150 python3 experiments/bench_fa3.py --out "$OUT/fa3_bench.json" 2>&1 | tail -22
  ;;
N)
  for rep in 1 2; do
    step "fa3 vs cuDNN ($rep)"
    timeout 150 python3 experiments/bench_fa3.py --out "$OUT/fa3_bench_$rep.json" 2>&1 | tail -21
  done
  step variant benchmark
  timeout 240 python3 experiments/bench_variants.py --out "$OUT/variants.json" --n 8192 16384 4096 1024 \
    --variants causal prefixlm global_sliding_window causal_blockwise share_question relative_pos \
    --systems ours flex --sweep-variants 2>&1 | tail -26
  step normalisations round-robin
  timeout 120 python3 experiments/sigmoid_fma_share.py --out "$OUT/norms.json" --composite 0 --sigmoid 0 --relu \
    --n 8192 4096 16384 2>&1 | tail -12
  ;;
Q)
  # Three consumers at D = 128 (192 x 64 / 192 x 80): their GPU cases, every lowered variant at
  # 128x128 / 192x80 / 192x64 beside our causal softmax, the dense kernel's sweep with them.
  step "three-consumer GPU cases"
  timeout 100 python3 -m pytest tests/gpu/test_fa3_sm90.py -q -p no:cacheprovider -k "d128_block_m192" 2>&1 | tail -2
  for v in composite sigmoid relu prefixlm causal global_sliding_window causal_blockwise share_question relative_pos; do
    step "tiles: $v"
    timeout 100 python3 experiments/variant_tiles.py $v --out "$OUT/tiles_$v.json" --n 8192 1024 \
      --configs 128x128s2 192x80s2 192x64s2 2>&1 | grep -v "^check .*passed" | tail -8
  done
  step "dense sweep"
  timeout 150 python3 experiments/bench_fa3.py --sweep --out "$OUT/sweep_192.json" \
    --only llama2-7b:8192 llama2-7b:1024 qwen2.5-72b:8192 --tiles 128x128s2 128x176s2 192x64s2 192x80s2 2>&1 | tail -6
  ;;
R)
  # Session 5 close: every GPU test, the sanitizer (now with a three-consumer D = 128 config), the
  # normalisations beside our causal softmax (composite also at 192x80 and with two knobs).
  step gpu tests
  timeout 260 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
  sanitize_fa3
  step normalisations
  timeout 120 python3 experiments/variant_tiles.py composite --out "$OUT/norm_composite.json" --n 8192 4096 16384 \
    --configs 128x128s2 192x80s2 192x80s2+KV_ASCENDING=1 192x80s2+OVERLAP_TILES=0 2>&1 | grep -v "^check .*passed"
  for v in sigmoid relu; do
    timeout 80 python3 experiments/variant_tiles.py $v --out "$OUT/norm_$v.json" --n 8192 4096 16384 \
      --configs 128x128s2 2>&1 | grep -v "^check .*passed"
  done
  ;;
S1)
  step gpu tests
  timeout 330 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
  sanitize_fa3
  ;;
S2)
  step normalisations beside causal softmax
  timeout 150 python3 experiments/variant_tiles.py composite --out "$OUT/norm_composite.json" --n 8192 4096 16384 \
    --configs 128x128s2 192x80s2 2>&1 | grep -v "^check .*passed"
  for v in sigmoid relu; do
    timeout 100 python3 experiments/variant_tiles.py $v --out "$OUT/norm_$v.json" --n 8192 4096 16384 \
      --configs 128x128s2 2>&1 | grep -v "^check .*passed"
  done
  step normalisations beside eager and torch.compile
  timeout 200 python3 experiments/bench_variants.py --out "$OUT/variants_norm.json" --n 8192 \
    --variants relu sigmoid composite --systems ours eager compiled_reference ours_causal 2>&1 | tail -6
  ;;
C)
  # After a kernel change: GPU tests, the fa3 sanitizer case (lowered variants included), the mask
  # variants against FlexAttention at every length, the normalisations at 8k, and fa3 vs cuDNN.
  step gpu tests
  timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tests.log"
  sanitize_fa3
  step variant benchmark
  timeout 200 python3 experiments/bench_variants.py --out "$OUT/variants.json" --n 8192 16384 4096 1024 \
    --variants causal prefixlm global_sliding_window causal_blockwise share_question relative_pos \
    --systems ours flex --sweep-variants 2>&1 | tail -26
  timeout 60 python3 experiments/bench_variants.py --out "$OUT/variants_norm.json" --n 8192 \
    --variants relu sigmoid composite --systems ours ours_causal --sweep-variants 2>&1 | tail -4
  step fa3 vs cuDNN
  timeout 120 python3 experiments/bench_fa3.py --out "$OUT/fa3_bench.json" 2>&1 | tail -22
  ;;
esac
