"""Throughput of the special-function unit (MUFU) per SM, by operation and precision: the f32
ex2 that softmax uses (the baseline) beside tanh, rcp, and the 16-bit forms (f16 / bf16, which
nvcc issues as one MUFU op per half, also for the packed x2 PTX forms). Answers whether a
normalisation that needs tanh (sigmoid, softcap) pays more per MUFU op than softmax's exp2, and
whether 16-bit operands run faster.

One CTA of 1024 threads per SM, each thread 8 independent chains of the same op; the kernel reads
clock64 around the loop, and the rate is ops per clock per SM (the SM's own clock, so the number
does not depend on the boost clock).

    python experiments/mufu_rates.py [--out $OUT/mufu_rates.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import cupy as cp
import numpy as np

ITERS = 512
CHAINS = 8
THREADS = 1024

# name -> (register type, PTX of one step "y = f(x)" on %0 <- %1, initial value, an op-count multiplier)
OPS = {
    "ex2.approx.ftz.f32": ("f", "ex2.approx.ftz.f32 %0, %1;", "-0.5f", 1),
    "tanh.approx.f32": ("f", "tanh.approx.f32 %0, %1;", "0.5f", 1),
    # rcp(rcp(x)) = x: a chain of rcp alone is folded by ptxas, so each step adds 1 (FADD pipe)
    "rcp.approx.ftz.f32": ("f", "rcp.approx.ftz.f32 %0, %1; add.f32 %0, %0, 1.0;", "1.5f", 1),
    "ex2.approx.f16": ("h", "ex2.approx.f16 %0, %1;", "0xB800", 1),
    "tanh.approx.f16": ("h", "tanh.approx.f16 %0, %1;", "0x3800", 1),
    "ex2.approx.ftz.bf16": ("h", "ex2.approx.ftz.bf16 %0, %1;", "0xBF00", 1),
    "tanh.approx.bf16": ("h", "tanh.approx.bf16 %0, %1;", "0x3F00", 1),
    "tanh.approx.f16x2": ("r", "tanh.approx.f16x2 %0, %1;", "0x38003800u", 2),
    "ex2.approx.f16x2": ("r", "ex2.approx.f16x2 %0, %1;", "0xB800B800u", 2),
}
CTYPE = {"f": "float", "h": "unsigned short", "r": "unsigned int"}

SOURCE = r"""
extern "C" __global__ void run_{name}(long long* cycles, {ctype}* sink) {{
  {ctype} x[{chains}];
#pragma unroll
  for (int c = 0; c < {chains}; ++c) x[c] = ({ctype})({init});
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 4
  for (int i = 0; i < {iters}; ++i) {{
#pragma unroll
    for (int c = 0; c < {chains}; ++c) asm volatile("{ptx}" : "={cons}"(x[c]) : "{cons}"(x[c]));
  }}
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  {ctype} acc = x[0];
#pragma unroll
  for (int c = 1; c < {chains}; ++c) acc ^= x[c];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}}
"""


# How many warps it takes to keep MUFU busy, and what FFMA work between MUFU ops costs: an
# attention consumer runs its softmax on one warp per sub-partition while the other consumer's
# warps wait for their GEMMs. ex2.approx.ftz.f32 with `ffma` independent FFMAs after each.
MIX_CHAINS = (8, 32)
MIX_FFMA = (0, 4, 8, 15)
MIX_THREADS = (128, 256, 512)   # 32 chains need more than 64 registers: no 1024
MIX_ITERS = 128
MIX_SOURCE = r"""
extern "C" __global__ void mix_{chains}_{ffma}_{mufu}(long long* cycles, float* sink) {{
  float x[{chains}], y[{chains}];
#pragma unroll
  for (int c = 0; c < {chains}; ++c) {{ x[c] = -0.5f; y[c] = 0.25f * c; }}
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 2
  for (int i = 0; i < {iters}; ++i) {{
#pragma unroll
    for (int c = 0; c < {chains}; ++c) {{
      if ({mufu}) asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(x[c]) : "f"(-x[c]));
#pragma unroll
      for (int f = 0; f < {ffma}; ++f) asm volatile("fma.rn.f32 %0, %0, 0f3F7FFFFF, 0f3E800000;" : "+f"(y[c]));
    }}
  }}
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < {chains}; ++c) acc += x[c] + y[c];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}}
"""


def mix_source() -> str:
    return "\n".join(MIX_SOURCE.format(chains=c, ffma=f, iters=MIX_ITERS, mufu=m)
                     for c in MIX_CHAINS for f in MIX_FFMA for m in (0, 1) if m or f)


def kernel_source() -> str:
    parts = []
    for name, (kind, ptx, init, _) in OPS.items():
        cons = {"f": "f", "h": "h", "r": "r"}[kind]
        body = SOURCE.format(name=name.replace(".", "_"), ctype=CTYPE[kind], chains=CHAINS,
                             init=init, iters=ITERS, ptx=ptx, cons=cons)
        if kind == "f":   # xor on floats: through the bits
            body = body.replace("acc ^= x[c]", "acc += x[c]")
        parts.append(body)
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    sms = props["multiProcessorCount"]
    mod = cp.RawModule(code=kernel_source(), options=("-arch=sm_90a", "-std=c++17"))
    rows = []
    for name, (kind, _, _, per_op) in OPS.items():
        fn = mod.get_function("run_" + name.replace(".", "_"))
        cycles = cp.zeros(sms, dtype=cp.int64)
        sink = cp.zeros(sms * THREADS, dtype=cp.float32 if kind == "f" else
                        (cp.uint16 if kind == "h" else cp.uint32))
        for _ in range(3):                                  # warm up, then keep the last
            fn((sms,), (THREADS,), (cycles, sink))
        cp.cuda.runtime.deviceSynchronize()
        c = float(np.median(cycles.get()))
        results = THREADS * ITERS * CHAINS * per_op
        rows.append({"op": name, "results_per_clk_per_sm": results / c,
                     "clk_per_warp_instruction": c / (THREADS // 32 * ITERS * CHAINS) * 4})
    mix_mod = cp.RawModule(code=mix_source(), options=("-arch=sm_90a", "-std=c++17"))
    mix = []
    for chains, ffma, mufu in [(c, f, m) for c in MIX_CHAINS for f in MIX_FFMA for m in (1, 0) if m or f]:
        if True:
            fn = mix_mod.get_function(f"mix_{chains}_{ffma}_{mufu}")
            for threads in MIX_THREADS:
                cycles = cp.zeros(sms, dtype=cp.int64)
                sink = cp.zeros(sms * threads, dtype=cp.float32)
                for _ in range(3):
                    fn((sms,), (threads,), (cycles, sink))
                cp.cuda.runtime.deviceSynchronize()
                c = float(np.median(cycles.get()))
                warps_per_smsp = threads // 32 // 4
                mix.append({"chains": chains, "ffma_per_mufu": ffma, "mufu": bool(mufu),
                            "warps_per_smsp": warps_per_smsp,
                            "clk_per_mufu_per_smsp": c / (warps_per_smsp * MIX_ITERS * chains)})
    base = rows[0]["results_per_clk_per_sm"]
    for r in rows:
        r["vs_ex2_f32"] = r["results_per_clk_per_sm"] / base
    doc = {"device": props["name"].decode(), "date": date.today().isoformat(),
           "versions": {"cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                        "python": platform.python_version()},
           "what": "MUFU results per clock per SM (SM clock64), one 1024-thread CTA per SM, "
                   f"{CHAINS} independent chains x {ITERS} steps per thread; baseline ex2.approx.ftz.f32 "
                   "measured in the same run; clk_per_warp_instruction is per SM sub-partition "
                   "(4 per SM), x2 forms counted as two results per instruction",
           "rows": rows,
           "mix_what": "ex2.approx.ftz.f32 with ffma_per_mufu independent FFMAs after each, warps_per_smsp "
                       "warps per SM sub-partition, chains independent ex2 chains per thread: SMSP clocks "
                       "per MUFU warp instruction (8 = the unit's peak of 4 results per clock); mufu false: the "
                       "same loop without the ex2 (clocks per step: the FFMA-only baseline)",
           "mix": mix}
    print(f"{'op':24s} {'results/clk/SM':>15s} {'vs ex2 f32':>11s} {'clk/warp-inst/SMSP':>19s}")
    for r in rows:
        print(f"{r['op']:24s} {r['results_per_clk_per_sm']:15.2f} {r['vs_ex2_f32']:11.2f} "
              f"{r['clk_per_warp_instruction']:19.2f}")
    print(f"\n{'chains':>6s} {'ffma/mufu':>9s} " + " ".join(f"{w:>3d} warp/SMSP" for w in
                                                          sorted({m['warps_per_smsp'] for m in mix})))
    for chains, ffma, mufu in dict.fromkeys((m["chains"], m["ffma_per_mufu"], m["mufu"]) for m in mix):
        cells = [m for m in mix if (m["chains"], m["ffma_per_mufu"], m["mufu"]) == (chains, ffma, mufu)]
        print(f"{chains:6d} {ffma:9d}{'' if mufu else ' (no ex2)'} "
              + " ".join(f"{m['clk_per_mufu_per_smsp']:12.2f}" for m in cells))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    sys.exit(main())
