"""Registers and spill bytes of fa2_sm80's kernels, the reference and every built-in variant lowered
onto it, from nvcc's --resource-usage (no GPU): issue 19 item 7 wants D = 128 spill-free.

    python experiments/fa2_spills.py [--d 128 64] [--configs 128x64s2w4 64x64s2w4] [--arch sm_80 sm_90]
                                     [--out fa2_spills.json]

Each row: kernel (causal / full reference, or a variant at the op's causal=False launch), config,
arch, dtype, registers, spill stores / loads (bytes). Exit 1 when any row spills.
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor

import expkit  # noqa: F401 - makes the checkout's cubridge importable

import torch

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.paths import ref_kernel_dir
from cubridge.runtime.build import compile_cubin
from cubridge.runtime.fa2_sm80 import Config, Fa2Sm80, default_config
from cubridge.spec import builtin_specs, load_spec
from cubridge.transfer.rules import transfer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def usage(log: str) -> dict:
    """registers and spill bytes of the one kernel in an nvcc --resource-usage log."""
    regs = re.findall(r"(?:Used|REG:)\s*(\d+)", log)
    st = re.findall(r"(\d+) bytes spill stores", log) or re.findall(r"STACK:\d+.*?SPILL_ST:(\d+)", log)
    ld = re.findall(r"(\d+) bytes spill loads", log) or re.findall(r"SPILL_LD:(\d+)", log)
    return {"regs": max(map(int, regs)) if regs else None, "spill_st": max(map(int, st)) if st else None,
            "spill_ld": max(map(int, ld)) if ld else None}


def sources(names) -> dict[str, tuple[str, bool]]:
    """{label: (kernel source, causal launch)}: the reference both ways, each variant lowered."""
    fa2 = Fa2Sm80(compiler="nvcc")
    out = {"reference causal": (fa2.source, True), "reference full": (fa2.source, False)}
    prog = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")
    for name in names:
        out[name] = (lower(transfer(prog, load_spec(name)).program, "fa2_sm80").source, False)
    return out


def measure(srcs, configs, dims, archs, dtypes, defines=(), workers=2):
    cache = tempfile.mkdtemp(prefix="fa2_spills_")
    jobs = [(label, cfg, d, arch, dt) for label in srcs for cfg in configs for d in dims
            for arch in archs for dt in dtypes]

    def one(job):
        label, cfg, d, arch, dt = job
        cfg = default_config(d) if cfg == "default" else Config.parse(cfg)
        source, causal = srcs[label]
        opts = ["-std=c++17", *cfg.defines(d, DTYPES[dt], causal), *defines, "--resource-usage"]
        try:
            log = compile_cubin(source, arch=arch, options=opts, compiler="nvcc", cache_dir=cache).log
            res = usage(log)
        except Exception as e:       # noqa: BLE001 - an invalid config for this D is a row too
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        return {"kernel": label, "config": str(cfg), "D": d, "arch": arch, "dtype": dt, **res}
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[128])
    ap.add_argument("--configs", nargs="+", default=["default"])
    ap.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    ap.add_argument("--specs", nargs="+", default=builtin_specs())
    ap.add_argument("--define", nargs="*", default=[], help="more -D flags, e.g. KV_SPLIT=2")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = measure(sources(args.specs), args.configs, args.d, args.arch, args.dtype, [f"-D{d}" for d in args.define])
    print(f"{'kernel':<24} {'config':<12} {'D':>4} {'arch':<6} {'dtype':<5} {'regs':>5} {'spill st/ld':>12}")
    for r in rows:
        cell = r.get("error") or f"{r['regs']:>5} {r['spill_st']:>5} / {r['spill_ld']:<5}"
        print(f"{r['kernel']:<24} {r['config']:<12} {r['D']:>4} {r['arch']:<6} {r['dtype']:<5} {cell}")
    spilling = [r for r in rows if r.get("spill_st") or r.get("spill_ld")]
    print(f"{len(spilling)}/{len(rows)} spill")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    raise SystemExit(1 if spilling else 0)


if __name__ == "__main__":
    main()
