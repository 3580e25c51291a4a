"""Issue 18, item 3: where ours and FlashAttention-4 spend their cycles, under ncu, at causal (or,
with --variant full, full) D128 (Llama2-7B heads, 16k tokens) N = 8k and 1k. One JSON with a small
set of metrics per kernel.

    python experiments/ncu_compare.py --out $OUT/ncu.json [--n 8192 1024] [--systems ours fa4] [--variant full]
    python experiments/ncu_compare.py --direction backward [--option bulk_overlap_lse] --n 8192 ...

--direction backward profiles the backward instead (issue 17): ours = fa3_bwd_sm90's fa3_backward
with `--option`, FA4 = torch.autograd.grad through flash_attn_func, as experiments/
bench_bwd_options.py calls them; the longest kernel of the call is each one's main kernel.

Each (system, N) runs in its own process under `ncu --profile-from-start off`: the worker warms up
(FA4's JIT compile, our cubin load) outside the profiled window and opens it (cudaProfilerStart)
around one call, so ncu sees only that call's kernels; the longest one is kept. Sections, not raw
metric names, are requested (the raw names differ between ncu versions); the raw page is then
filtered by the patterns in KEEP.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "LaunchStats", "Occupancy",
            "MemoryWorkloadAnalysis"]
KEEP = [r"^gpu__time_duration\.sum$", r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$",
        r"pipe_tensor.*pct_of_peak_sustained_(active|elapsed)$", r"^sm__inst_executed_pipe_.*pct",
        r"^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$",
        r"^smsp__average_warp_latency_per_inst_issued\.ratio$",
        r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$", r"^smsp__inst_executed\.sum$",
        r"^launch__(registers_per_thread|grid_size|block_size|shared_mem_per_block_dynamic)$",
        r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$", r"^sm__cycles_elapsed\.avg$",
        r"^sm__cycles_active\.avg$", r"^dram__bytes_(read|write)\.sum$", r"^lts__t_sector_hit_rate\.pct$",
        r"^gpc__cycles_elapsed\.avg\.per_second$"]
TOKENS, HEADS, D = 16384, 32, 128


def backward_call(system: str, n: int, causal: bool, option: str):
    """One backward of ours or FA4 (expkit.peers.ours_backward / fa4_backward, as bench_bwd_options.py
    times them; FA4's gradients left BSHD)."""
    import torch
    from expkit.peers import fa4_backward, ours_backward
    b = TOKENS // n
    q, k, v, dout = (torch.randn(b, HEADS, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if system == "ours":
        return ours_backward(option, causal, q, k, v, dout)
    return fa4_backward(causal, q, k, v, dout, bhnd=False)


def worker(system: str, n: int, variant: str = "causal", direction: str = "forward", option: str = "") -> None:
    """Run inside ncu: warm up, then one profiled call."""
    import torch
    import expkit  # noqa: E402,F401 - cubridge importable from a bare checkout
    from expkit.peers import make_fa4, make_ours
    b = TOKENS // n
    if direction == "backward":
        fn = backward_call(system, n, variant == "causal", option)
    else:
        q, k, v = (torch.randn(b, HEADS, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fn, _ = make_ours(variant, q, k, v, None) if system == "ours" else make_fa4(variant, q, k, v)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"worker {system} N={n} {variant} {direction}: profiled one call", flush=True)


def profile(system: str, n: int, ncu: str, timeout: int, variant: str = "causal", direction: str = "forward",
            option: str = "") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "rep"
        cmd = [ncu, "--profile-from-start", "off", "--target-processes", "all", "-f", "-o", str(rep)]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", system, str(n), "--variant", variant,
                "--direction", direction, "--option", option]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if not (rep.with_suffix(".ncu-rep")).exists():
            return {"error": f"ncu rc={run.returncode}: {(run.stdout + run.stderr)[-600:]}"}
        raw = subprocess.run([ncu, "-i", str(rep.with_suffix(".ncu-rep")), "--page", "raw", "--csv",
                              "--print-units", "base"], capture_output=True, text=True, timeout=120)
        return pick(raw.stdout) or {"error": f"no kernel rows in the report: {raw.stderr[-300:]}"}


def pick(csv_text: str) -> dict | None:
    """The longest kernel's kept metrics from `ncu --page raw --csv` (header, units, rows)."""
    rows = list(csv.reader(io.StringIO(csv_text)))
    if len(rows) < 3:
        return None
    header, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    dur = col.get("gpu__time_duration.sum")

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return x
    best = max(data, key=lambda r: num(r[dur]) if dur is not None and isinstance(num(r[dur]), float) else 0.0)
    out = {"kernel": best[col["Kernel Name"]] if "Kernel Name" in col else None,
           "kernels_in_window": len(data)}
    keep = [re.compile(p) for p in KEEP]
    for h, i in col.items():
        if any(p.search(h) for p in keep):
            out[h] = {"value": num(best[i]), "unit": units[i]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 1024])
    ap.add_argument("--systems", nargs="+", default=["ours", "fa4"], choices=["ours", "fa4"])
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per profiled process")
    ap.add_argument("--variant", choices=["causal", "full"], default="causal")
    ap.add_argument("--direction", choices=["forward", "backward"], default="forward")
    ap.add_argument("--option", default="", help="ours' backward option (--direction backward; default: the "
                    "product's DEFAULT_OPTION)")
    args = ap.parse_args(argv)
    if not args.option:
        import expkit  # noqa: F401 - cubridge importable from a bare checkout
        from cubridge.runtime.fa3_bwd_sm90 import DEFAULT_OPTION
        args.option = DEFAULT_OPTION
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.variant, args.direction, args.option)
        return 0
    shape = f"{args.variant} D128 32/32 heads, 16k tokens" + (
        f", backward (ours: {args.option})" if args.direction == "backward" else "")
    result = {"date": datetime.now(timezone.utc).isoformat(), "shape": shape, "sections": SECTIONS, "runs": []}
    for n in args.n:
        for system in args.systems:
            try:
                got = profile(system, n, args.ncu, args.timeout, args.variant, args.direction, args.option)
            except subprocess.TimeoutExpired:
                got = {"error": f"ncu timed out after {args.timeout} s"}
            result["runs"].append({"system": system, "N": n, **got})
            short = {k.split(".")[0]: v["value"] for k, v in got.items() if isinstance(v, dict)}
            print(f"ncu {system:<5} N={n:<6} " + (got.get("error", "")[:200] or
                  f"{got.get('kernel', '')[:60]} " + ", ".join(f"{k}={v}" for k, v in list(short.items())[:8])),
                  flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


def print_table(result) -> None:
    names = ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
             "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.pct_of_peak_sustained_active",
             "launch__registers_per_thread", "launch__grid_size", "dram__bytes_read.sum"]
    tensor = lambda run: next((v["value"] for k, v in run.items() if "pipe_tensor" in k and "active" in k
                               and isinstance(v, dict)), None)
    print(f"\n{'system':<6} {'N':>6} {'us':>9} {'sm%':>6} {'issue%':>7} {'occ%':>6} {'regs':>5} {'grid':>6} "
          f"{'dramMB':>8} {'tensor%':>8}")
    for run in result["runs"]:
        if "error" in run:
            print(f"{run['system']:<6} {run['N']:>6} error: {run['error'][:80]}")
            continue
        vals = [run.get(nm, {}).get("value") for nm in names]
        fmt = lambda x, w, s=1.0: f"{x / s:{w}.1f}" if isinstance(x, float) else f"{'-':>{w}}"
        print(f"{run['system']:<6} {run['N']:>6} {fmt(vals[0], 9, 1e3)} {fmt(vals[1], 6)} {fmt(vals[2], 7)} "
              f"{fmt(vals[3], 6)} {fmt(vals[4], 5)} {fmt(vals[5], 6)} {fmt(vals[6], 8, 1e6)} {fmt(tensor(run), 8)}")


if __name__ == "__main__":
    sys.exit(main())
