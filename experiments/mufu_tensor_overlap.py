"""Do the tensor cores and the MUFU unit of an SM run at full rate at the same time? A
microbenchmark for the question composite raises (two MUFU ops per score: at D = 128 its MUFU
time equals its tensor time at peak, so it needs the two to overlap almost perfectly).

One CTA per SM, three warpgroups, each a role (fa3's shape): warpgroup 0 issues wgmma
m64n128k16 groups back to back (8 k-steps, one group in flight while the next is issued), from
shared memory (SS, like S = Q K^T) or with A in registers (RS, like O += P V); warpgroups 1 and 2
run tanh.approx chains with the FMA-pipe work composite has per MUFU op (an FMUL before, an
FFMA after). A mode times one role for a fixed amount of work while the others run as
background (MUFU until the timed one sets a flag in shared memory; tensor for 8x the timed
count), so each rate is measured entirely under contention. Rates use the SM's own clock (clock64): MUFU as clocks per warp
instruction per sub-partition (8 = peak), tensor as dense FLOPs per clock per SM (4096 = peak).
Operands are random bf16, never zeros.

    python experiments/mufu_tensor_overlap.py --out $OUT/mufu_tensor_overlap.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import cupy as cp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = ROOT / "ref_kernels" / "fa3_sm90"
CHAINS = 32
SMEM_BYTES = 48 * 1024 + 1024 + 16   # A 64x128 + B 128x128 bf16, 1 KB alignment slack, the flag

SOURCE = r"""
#define DTYPE_BF16 1
#include <cuda.h>
#include <stdint.h>
#include "wgmma.cuh"
#include "hopper_ptx.cuh"
using namespace fa3;

// wgmma groups of 8 k-steps (m64n128k16) back to back, one group in flight while the next is
// issued; kRS: A from registers (O += P V's form), else from shared memory (S = Q K^T's form).
template <bool kRS>
__device__ __forceinline__ long long tensor_loop(uint32_t a, uint32_t b, const uint32_t* src, int t,
                                                 bool is_timed, int groups, float* sink) {
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  uint32_t p[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) p[i] = src[(t * 32 + i) % 4096];
  long long done = 0;
  // A background tensor loop runs a fixed count (8x the timed one): wgmma is warpgroup-aligned,
  // and a flag read per warp could let one warp leave the loop while the others issue.
  for (int g = 0; g < (is_timed ? groups : 8 * groups); ++g) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      if constexpr (kRS) {
        WgmmaRS<128, TagBf16>::mma(d, &p[4 * kk], make_desc(b + kk * 2048, 16384, 1024));
      } else {
        WgmmaSS<128, TagBf16>::mma(d, make_desc(a + (kk / 4) * 8192 + (kk % 4) * 32, 16, 1024),
                                   make_desc(b + (kk / 4) * 16384 + (kk % 4) * 32, 16, 1024), 1);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();
    ++done;
  }
  wgmma_wait<0>();
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) acc += d[i];
  if (acc == 1234.5f) sink[t] = acc;
  return done;
}

// Roles: bit 0 tensor SS, bit 1 tensor RS, bit 2 MUFU in warpgroup 1, bit 3 MUFU in warpgroup 2.
// timed: which warpgroup runs a fixed amount of work (the others loop until it sets the flag).
// kKind: the MUFU warpgroups' loop (0 composite's FMUL + MUFU + FFMA, 1 MUFU only, 2 FFMAs only).
template <int kKind>
__device__ __forceinline__ void overlap(int roles, int timed, int tensor_groups, int mufu_steps,
                                        const uint32_t* __restrict__ init, long long* __restrict__ cycles,
                                        long long* __restrict__ work, float* __restrict__ sink) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  volatile int* flag = reinterpret_cast<volatile int*>(smem + 48 * 1024);
  const uint32_t* src = init + blockIdx.x * 64;
  for (int i = threadIdx.x; i < 48 * 1024 / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = src[i % 4096] ^ (i * 2654435761u);
  if (threadIdx.x == 0) *flag = 0;
  fence_async_smem();
  __syncthreads();
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const bool is_timed = wg == timed;
  long long done = 0;
  const long long t0 = clock64();
  if (wg == 0 && (roles & 3)) {
    const uint32_t a = smem_addr(smem), b = a + 16 * 1024;
    done = (roles & 1) ? tensor_loop<false>(a, b, src, t, is_timed, tensor_groups, sink)
                       : tensor_loop<true>(a, b, src, t, is_timed, tensor_groups, sink);
  } else if ((wg == 1 && (roles & 4)) || (wg == 2 && (roles & 8))) {
    float x[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) x[c] = 0.1f * (c + 1) + 1e-3f * t;
    for (int s = 0; is_timed ? s < mufu_steps : *flag == 0; ++s) {
#pragma unroll
      for (int c = 0; c < CHAINS; ++c) {
        if constexpr (kKind == 0) {   // composite's mix: FMUL, MUFU, FFMA
          float y = x[c] * 0.75f, z;
          asm volatile("tanh.approx.f32 %0, %1;" : "=f"(z) : "f"(y));
          x[c] = fmaf(z, 0.9f, 0.05f);
        } else if constexpr (kKind == 1) {   // MUFU only
          asm volatile("tanh.approx.f32 %0, %0;" : "+f"(x[c]));
        } else {                    // FMA pipe only: three dependent FFMAs
          float y = fmaf(x[c], 0.75f, 0.01f);
          y = fmaf(y, 0.9f, 0.05f);
          x[c] = fmaf(y, 0.5f, 0.02f);
        }
      }
      ++done;
    }
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) acc += x[c];
    if (acc == 1234.5f) sink[threadIdx.x] = acc;
  }
  const long long t1 = clock64();
  if (is_timed) {
    asm volatile("bar.sync 1, 128;" ::: "memory");   // the timed warpgroup's four warps are done
    if (t == 0) *flag = 1;
  }
  if (t == 0) {
    cycles[blockIdx.x * 3 + wg] = t1 - t0;
    work[blockIdx.x * 3 + wg] = done;
  }
}
#define OVERLAP_KERNEL(K)                                                                          \
  extern "C" __global__ void __launch_bounds__(384, 1) overlap_##K(                               \
      int roles, int timed, int tensor_groups, int mufu_steps, const uint32_t* __restrict__ init,  \
      long long* __restrict__ cycles, long long* __restrict__ work, float* __restrict__ sink) {    \
    overlap<K>(roles, timed, tensor_groups, mufu_steps, init, cycles, work, sink);               \
  }
OVERLAP_KERNEL(0)
OVERLAP_KERNEL(1)
OVERLAP_KERNEL(2)
""".replace("CHAINS", str(CHAINS))

# (label, roles, timed warpgroup, kind of the MUFU warpgroups' loop: 0 composite's FMUL + MUFU +
# FFMA, 1 MUFU only, 2 three FFMAs; for kind 2 the "clk per MUFU" column is clocks per step)
MODES = [
    ("MUFU alone (1 warp / SMSP)", 4, 1, 0),
    ("MUFU alone (2 warps / SMSP)", 4 | 8, 1, 0),
    ("tensor SS alone", 1, 0, 0),
    ("tensor RS alone", 2, 0, 0),
    ("MUFU under tensor SS", 1 | 4, 1, 0),
    ("MUFU under tensor RS", 2 | 4, 1, 0),
    ("MUFU (2 warps / SMSP) under tensor RS", 2 | 4 | 8, 1, 0),
    ("tensor SS under MUFU", 1 | 4, 0, 0),
    ("tensor RS under MUFU", 2 | 4, 0, 0),
    ("tensor RS under MUFU (2 warps / SMSP)", 2 | 4 | 8, 0, 0),
    ("MUFU-only alone (2 warps / SMSP)", 4 | 8, 1, 1),
    ("MUFU-only (2 warps / SMSP) under tensor RS", 2 | 4 | 8, 1, 1),
    ("FFMA-only alone (2 warps / SMSP)", 4 | 8, 1, 2),
    ("FFMA-only (2 warps / SMSP) under tensor RS", 2 | 4 | 8, 1, 2),
]


def build(workdir: Path) -> cp.RawModule:
    src, cubin = workdir / "overlap.cu", workdir / "overlap.cubin"
    src.write_text(SOURCE)
    subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", "-arch=sm_90a", f"-I{KERNEL_DIR}", "-o", str(cubin),
                    str(src)], check=True)
    return cp.RawModule(path=str(cubin))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tensor-groups", type=int, default=2000)
    ap.add_argument("--mufu-steps", type=int, default=4000)
    args = ap.parse_args()
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    with tempfile.TemporaryDirectory() as tmp:
        module = build(Path(tmp))
        fns = [module.get_function(f"overlap_{k}") for k in range(3)]
        for fn in fns:
            fn.max_dynamic_shared_size_bytes = SMEM_BYTES
        rng = np.random.default_rng(0)
        bf16 = (rng.standard_normal(4096 * 2 + sms * 64 * 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
        init = cp.asarray((bf16[0::2] | (bf16[1::2] << 16)).astype(np.uint32))
        cycles = cp.zeros(sms * 3, dtype=cp.int64)
        work = cp.zeros(sms * 3, dtype=cp.int64)
        sink = cp.zeros(384, dtype=cp.float32)
        rows = []
        for label, roles, timed, kind in MODES:
            for _ in range(2):   # the first launch warms up clocks; the second is recorded
                fns[kind]((sms,), (384,), (np.int32(roles), np.int32(timed), np.int32(args.tensor_groups),
                                    np.int32(args.mufu_steps), init, cycles, work, sink),
                   shared_mem=SMEM_BYTES)
            cp.cuda.runtime.deviceSynchronize()
            c = cycles.get().reshape(sms, 3)[:, timed].astype(np.float64)
            w = work.get().reshape(sms, 3)[:, timed].astype(np.float64)
            row = {"mode": label, "roles": roles, "timed_warpgroup": timed, "kind": kind, "cycles_median": float(np.median(c))}
            if timed == 0:
                flops = w * 8 * 2 * 64 * 128 * 16
                row["tensor_flops_per_clk_per_sm"] = float(np.median(flops / c))
                row["vs_peak_4096"] = round(row["tensor_flops_per_clk_per_sm"] / 4096, 3)
            else:
                # per sub-partition: one warp of the timed warpgroup issues w * CHAINS MUFU ops
                row["clk_per_mufu_per_smsp"] = float(np.median(c / (w * CHAINS)))
            rows.append(row)
            print(f"{label:<42} " + (f"tensor {row['tensor_flops_per_clk_per_sm']:7.0f} FLOP/clk/SM ({row['vs_peak_4096']:.2f} of peak)"
                                      if timed == 0 else f"MUFU {row['clk_per_mufu_per_smsp']:6.2f} clk per warp op per SMSP"),
                  flush=True)
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    result = {"device": dev, "date": str(date.today()),
              "versions": {"cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                           "python": sys.version.split()[0]},
              "what": __doc__.strip().split("\n\n")[0], "baseline": "each role alone, same run (the first four modes)",
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
