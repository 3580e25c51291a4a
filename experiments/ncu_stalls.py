"""Issue 17: where the warps of ours' and FlashAttention-4's SM90 backward wait, per SASS instruction.
ncu's SourceCounters (warp-state sampling per PC) and WarpStateStats of each main backward kernel,
bf16 D 128, 32 heads, 16k tokens, one profiled call each, reduced by expkit.sass_stalls to: stall
reasons and phases of the step (S/dP wait, P pass, named barrier, dQ store / bulk wait, mbarrier
wait, epilogue) as shares of the kernel's samples, and the top stalled PCs with their SASS.

    python experiments/ncu_stalls.py --out $OUT/ncu_stalls.json [--n 8192] [--variants causal full]
        [--systems ours fa4] [--option OPTION] [--keep 0.001]
    python experiments/ncu_stalls.py --table $OUT/ncu_stalls.json

Each (system, variant) runs in its own process under `ncu --profile-from-start off -k KERNEL
--launch-count 1`: the worker warms up (FA4's JIT, our build) outside the window and opens it
around one call; only the main kernel (ours fa3_bwd_sm90, FA4's FlashAttentionBackwardSm90) is
profiled. The JSON is rewritten after each profile (a call cut short keeps the finished ones); it
keeps every PC with at least --keep of its kernel's samples, for a re-reading later.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from expkit import sass_stalls
from expkit.sass_stalls import raw_metrics

KERNEL = {"ours": "regex:fa3_bwd_sm90", "fa4": "regex:FlashAttentionBackwardSm90"}
SECTIONS = ["SourceCounters", "WarpStateStats"]
TOKENS, HEADS, D = 16384, 32, 128


def worker(system: str, n: int, variant: str, option: str) -> None:
    """Inside ncu: build / compile, warm up, then one call inside cudaProfilerStart / Stop."""
    import torch
    from expkit.peers import fa4_backward, ours_backward
    b = TOKENS // n
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, HEADS, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    causal = variant == "causal"
    fn = ours_backward(option, causal, q, k, v, dout) if system == "ours" else \
        fa4_backward(causal, q, k, v, dout, bhnd=False)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"worker {system} N={n} {variant}: profiled one call", flush=True)


def profile(system: str, n: int, variant: str, option: str, ncu: str, timeout: int, keep: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "rep"
        cmd = [ncu, "--profile-from-start", "off", "-k", KERNEL[system], "--launch-count", "1",
               "-f", "-o", str(rep)]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", system, str(n),
                "--variants", variant, "--option", option]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        path = rep.with_suffix(".ncu-rep")
        if not path.exists():
            return {"error": f"ncu rc={run.returncode}: {(run.stdout + run.stderr)[-600:]}"}
        page = subprocess.run([ncu, "-i", str(path), "--page", "source", "--csv", "--print-source", "sass"],
                              capture_output=True, text=True, timeout=120)
        raw = subprocess.run([ncu, "-i", str(path), "--page", "raw", "--csv", "--print-units", "base"],
                             capture_output=True, text=True, timeout=120)
    try:
        rows = sass_stalls.read_page(page.stdout)
    except ValueError as e:
        return {"error": f"{e}: {(page.stdout[:300] + page.stderr[-300:])}"}
    out = {**raw_metrics(raw.stdout), **sass_stalls.summarize(rows, top=40)}
    total = out["samples"]
    out["pcs"] = [[r["index"], r["sass"][:80], r["samples"], r["stalls"]] for r in rows
                  if r["samples"] >= keep * total]
    return out


def print_run(run: dict) -> None:
    name = f"{run['system']} {run['variant']} {run['N']}"
    if "error" in run:
        print(f"== {name}: error: {run['error'][:300]}", flush=True)
        return
    us = run.get("gpu__time_duration.sum")
    head = f"{name}" + (f" ({us / 1e3:.0f} us" if isinstance(us, float) else " (") + \
        f", {run.get('launch__registers_per_thread', '?')} regs)"
    print(sass_stalls.table(head, run), flush=True)


def print_tables(result: dict, each: bool = True) -> None:
    for run in result["runs"] if each else []:
        print_run(run)
    print("\nsystem variant  us      samples  top phases (share of samples)")
    for run in result["runs"]:
        if "error" in run:
            continue
        us = run.get("gpu__time_duration.sum")
        phases = ", ".join(f"{k.split(' (')[0]} {v / run['samples']:.0%}" for k, v in list(run["phases"].items())[:4])
        print(f"{run['system']:<6} {run['variant']:<7} {us / 1e3 if isinstance(us, float) else 0:7.0f} "
              f"{run['samples']:8d}  {phases}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("SYSTEM", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="print the tables of an earlier --out JSON and stop")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--variants", nargs="+", default=["causal", "full"], choices=["causal", "full"])
    ap.add_argument("--systems", nargs="+", default=["ours", "fa4"], choices=["ours", "fa4"])
    ap.add_argument("--option", default="", help="ours' backward option (default: the product's DEFAULT_OPTION)")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per profiled process")
    ap.add_argument("--keep", type=float, default=0.001, help="PCs kept in the JSON: share of samples at least")
    args = ap.parse_args(argv)
    if args.table:
        print_tables(json.loads(args.table.read_text()))
        return 0
    if not args.option:
        from cubridge.runtime.fa3_bwd_sm90 import DEFAULT_OPTION
        args.option = DEFAULT_OPTION
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.variants[0], args.option)
        return 0
    result = {"date": datetime.now(timezone.utc).isoformat(), "sections": SECTIONS, "option": args.option,
              "shape": f"bf16 D{D} {HEADS} heads, {TOKENS} tokens, N {args.n}", "runs": []}
    for variant in args.variants:            # causal pairs first: a call cut short keeps them
        for system in args.systems:
            try:
                got = profile(system, args.n, variant, args.option, args.ncu, args.timeout, args.keep)
            except subprocess.TimeoutExpired:
                got = {"error": f"ncu timed out after {args.timeout} s"}
            result["runs"].append({"system": system, "variant": variant, "N": args.n, **got})
            print_run(result["runs"][-1])   # each kernel's table as it comes: a call cut short keeps them
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    print_tables(result, each=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
