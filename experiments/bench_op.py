"""The tuned op's overhead over its bare kernel, all ten built-in variants at N = 1k and 8k (H100).

For each variant a run directory is built from default tile configs (cubridge.op.build: no Optuna
on the device), loaded with cubridge.load, and measured three ways:

    host_us_per_call  wall time per op call while the GPU is kept busy (a long torch.cuda._sleep is
                      enqueued first, so the calls only enqueue: no launch waits for the GPU), each
                      call timed alone with Python's GC off (one GC pass inside the window made
                      causal_blockwise 8k read 96 us as a mean in session 7), in windows of CALLS
                      calls; every row is timed in ROUNDS (3) rounds, the rows interleaved in a different
                      order each round (expkit.hosttime), and the row's number is the median of its
                      round medians (session 12's single window per row read 16 or 25 us at random);
                      host_us_rounds / host_us_spread give the rounds, host_us_mean the mean of every
                      call; host_launch_us the bare prepared launch's host time in the same rounds
                      (the floor the op's path sits on); the issue's bar is <= 25 us
    op_ms             the op call attn(q, k, v) (allocation + checks + launch) and
    kernel_ms         the same prepared launch with preallocated out / lse (what the tuner times),
                      both timed round-robin with L2 flushed and the GPU held busy (HOLD_CYCLES of
                      torch.cuda._sleep) before the start event, so each measures what the call adds
                      to the GPU's time (extra kernels, memsets), as in a model where the host runs
                      ahead; bar: op_ms within 5% of kernel_ms
    op_ms_idle,       the same two through runtime.timing.bench_round_robin (GPU idle at the start
    kernel_ms_idle    event: the op's longer host path shows up as GPU idle time at 1k; session 7's
                      op / kernel 1.03-1.35x at 1k was this, see cubridge/op/NOTES.md)

Writes one JSON (rows with system, variant, N, B, host_us_per_call, op_ms, kernel_ms, gpu) and
prints a table. Usage: python3 experiments/bench_op.py --out results.json [--variants a,b]
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import cubridge
from cubridge.op import build
from cubridge.runtime.timing import bench_round_robin
from cubridge.spec import builtin_specs
from expkit import CALLS, gpu_ms, host_us_per_call
from expkit.hosttime import host_info, rounds

HQ, HKV, D = 16, 4, 128
TOKENS = 16384                      # B * N: B = 16 at 1k, 2 at 8k
ROUNDS = 3                          # host-time rounds: 79 s for the whole bench on the H100 (session 12 mid)


def inputs(attn, n: int):
    """q, k, v at N = n (B = TOKENS // n), the shape's prepared launch and an output for it."""
    b = TOKENS // n
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(b, HQ, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    attn(q, k, v)
    prep = attn._prepared[(q.shape, k.shape, q.device, 1.0 / math.sqrt(D))]
    return q, k, v, prep, torch.empty_like(q)


def measure(attn, n: int, gpu: str, case) -> dict:
    """The row's GPU numbers (its host time comes from host_rounds, over every row)."""
    q, k, v, prep, out = case
    fns = [lambda: attn(q, k, v), lambda: prep.launch(q, k, v, out, prep.lse_scratch)]
    op_ms, kernel_ms = gpu_ms(fns)
    t_op, t_kernel = bench_round_robin(fns, reps=50)
    return {"system": "cubridge_op", "variant": attn.dispatch["spec_name"], "N": n, "B": TOKENS // n, "Hq": HQ,
            "Hkv": HKV, "D": D, "config": attn.select(n)["label"], "op_ms": round(op_ms, 4),
            "kernel_ms": round(kernel_ms, 4), "op_over_kernel": round(op_ms / kernel_ms, 4),
            "op_ms_idle": round(t_op.median_ms, 4), "kernel_ms_idle": round(t_kernel.median_ms, 4),
            "op_over_kernel_idle": round(t_op.median_ms / t_kernel.median_ms, 4), "gpu": gpu}


def host_rounds(cases: dict, n_rounds: int, pin: bool) -> dict:
    """{(variant, N): host fields, or {"error": ...}}: every row's op call and bare launch timed in
    n_rounds interleaved rounds (expkit.hosttime.rounds)."""
    fns = {}
    for key, (attn, (q, k, v, prep, out)) in cases.items():
        fns[(key, "op")] = lambda attn=attn, q=q, k=k, v=v: attn(q, k, v)
        fns[(key, "launch")] = lambda prep=prep, q=q, k=k, v=v, out=out: prep.launch(q, k, v, out, prep.lse_scratch)
    table = rounds(fns, n_rounds=n_rounds, pin=pin)
    fields = {}
    for key in cases:
        op, launch = table[(key, "op")], table[(key, "launch")]
        if op["median_us"] is None or launch["median_us"] is None:
            fields[key] = {"error": op["error"] or launch["error"]}
            continue
        fields[key] = {"host_us_per_call": op["median_us"], "host_us_mean": op["mean_us"],
                       "host_us_rounds": op["rounds_us"], "host_us_spread": op["spread_us"],
                       "host_us_p10": op["p10_us"], "host_us_p90": op["p90_us"],
                       "host_launch_us": launch["median_us"], "host_launch_us_rounds": launch["rounds_us"],
                       "host_calib_us": op["calib_us"], "host_cpu": op["cpu"], "host_mhz": op["mhz"],
                       "host_pinned_cpu": op["pinned"]}
    return fields


def warm_up(attns: dict) -> None:
    """Every variant's host path once through its timing loop before any row is kept: in session 11
    the first row timed (full 1k) read 39.8 us per call and the same call 14-17 us elsewhere, the
    process's first timed Python loop paying for what later rows found warm (allocator, code paths,
    the host's clock)."""
    for attn in attns.values():
        for n in (1024, 8192):
            b = TOKENS // n
            q = torch.randn(b, HQ, n, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, HKV, n, D, device="cuda", dtype=torch.bfloat16)
            try:
                host_us_per_call(lambda: attn(q, k, k))
            except Exception:   # noqa: BLE001 - measure() records this variant's error in its row
                pass
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=",".join(builtin_specs()))
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="host-time rounds per row (rows interleaved)")
    ap.add_argument("--pin", action="store_true", help="hold the process on one CPU while host time is measured")
    ap.add_argument("--runs", default=None, help="folder for the run directories (default: a temporary one)")
    args = ap.parse_args()
    names = args.variants.split(",")
    root = Path(args.runs or tempfile.mkdtemp(prefix="bench_op_"))
    t0 = time.time()
    with ThreadPoolExecutor(8) as pool:
        dirs = dict(zip(names, pool.map(lambda s: build(s, root / s, heads_q=HQ, heads_kv=HKV, head_dim=D), names)))
    print(f"built {len(dirs)} run directories in {time.time() - t0:.0f} s", flush=True)
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "torch": torch.__version__, "calls": CALLS, "rounds": args.rounds, "pinned": args.pin,
              "host": host_info(),
              "rows": [], "errors": []}
    attns = {name: cubridge.load(dirs[name]) for name in names}
    warm_up(attns)
    cases, rows = {}, {}
    for name in names:
        for n in (1024, 8192):
            try:
                cases[(name, n)] = (attns[name], inputs(attns[name], n))
                rows[(name, n)] = measure(attns[name], n, gpu, cases[(name, n)][1])
            except Exception as e:   # noqa: BLE001 - one variant's failure is recorded, the rest still run
                cases.pop((name, n), None)
                result["errors"].append({"variant": name, "N": n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{name} N={n}: {type(e).__name__}: {e}", flush=True)
    for key, fields in host_rounds(cases, args.rounds, args.pin).items():
        if "error" in fields:
            result["errors"].append({"variant": key[0], "N": key[1], "error": fields["error"]})
        else:
            result["rows"].append({**rows[key], **fields})
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'variant':<22} {'N':>5} {'config':<11} {'host us':>8} {'spread':>6} {'launch':>6} {'mean us':>8} "
          f"{'op ms':>8} {'kernel ms':>9} {'op/kern':>7} {'idle o/k':>8}")
    for r in result["rows"]:
        print(f"{r['variant']:<22} {r['N']:>5} {r['config']:<11} {r['host_us_per_call']:8.2f} "
              f"{r['host_us_spread']:6.2f} "
              f"{r['host_launch_us']:6.2f} {r['host_us_mean']:8.2f} {r['op_ms']:8.4f} {r['kernel_ms']:9.4f} "
              f"{r['op_over_kernel']:7.3f} {r['op_over_kernel_idle']:8.3f}")
    worst = max((r["host_us_per_call"] for r in result["rows"]), default=float("nan"))
    ratio = max((r["op_over_kernel"] for r in result["rows"]), default=float("nan"))
    spread = max((r["host_us_spread"] for r in result["rows"]), default=float("nan"))
    print(f"bars: host <= 25 us: worst {worst:.2f} us (median of {args.rounds} rounds; widest spread {spread:.2f}); "
          f"op within 5% of kernel: worst {ratio:.3f}x; errors {len(result['errors'])}")


if __name__ == "__main__":
    main()
