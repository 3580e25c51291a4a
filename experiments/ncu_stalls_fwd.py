"""Issue 19 (D 256): where the warps of ours' and FlashAttention-4's SM90 forward wait, per SASS
instruction, at head dim 256 dense causal (bf16, B 2, 16 heads, 8k). ncu's SourceCounters (warp-state
sampling and instructions executed per PC), WarpStateStats and SpeedOfLight / MemoryWorkloadAnalysis
of one launch each, reduced by expkit.sass_stalls(_fwd) to: stall reasons and step phases (QK wait,
P V wait, softmax, rescale, K/V mbarrier waits, turns, epilogue) as shares of the samples, the top
stalled PCs with their SASS, the executed instructions per KV step by opcode class, and the tile
model's steps (the same for both: tile 128 x 80).

    python experiments/ncu_stalls_fwd.py --out $OUT/ncu_fwd.json [--systems ours fa4] [--rows 128x80 128x80fr]
    python experiments/ncu_stalls_fwd.py --table $OUT/ncu_fwd.json

Each profile runs in its own process under `ncu --profile-from-start off -k KERNEL --launch-count 1`:
the worker builds / JIT-compiles and warms up outside the window and opens it around one call. The
JSON is rewritten after each profile (a call cut short keeps the finished ones) and keeps every
executed PC (index, SASS, samples, executed), so FA4's step can be read again without a GPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from expkit import sass_stalls, sass_stalls_fwd as fwd
from expkit.sass_stalls import raw_metrics

KERNEL = {"ours": "regex:fa3_sm90_fwd", "fa4": "regex:FlashAttentionForwardSm90"}
SECTIONS = ["SourceCounters", "WarpStateStats", "SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis"]
B, HEADS, N, D = 2, 16, 8192, 256
BM, BN = 128, 80                       # ours' product tile and FA4's at D 256 (both)
# Raw-page columns kept beside expkit.sass_stalls.raw_metrics' list: any whose name holds one of these (from
# the sections above; no --metrics list, whose one unknown name would fail the whole profile).
MORE_RAW = ("pipe_tensor", "lts__t_sector_hit_rate", "lts__t_sectors_srcunit_tex_lookup_hit", "dram__throughput",
            "lts__throughput", "dram__bytes_read.sum", "sm__throughput", "smsp__inst_executed.sum",
            "sm__cycles_elapsed.avg", "l1tex__throughput", "gpc__cycles_elapsed.max")


def worker(system: str, row: str) -> None:
    """Inside ncu: build / compile, warm up, then one call inside cudaProfilerStart / Stop."""
    import torch
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, HEADS, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    from expkit.d256 import fa4, ours_dense, parse_row
    if system == "ours":
        bm, bn, options = parse_row(row)
        fn = ours_dense(q, k, v, bm, bn, options)
    else:
        fn = fa4(q, k, v)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"worker {system} {row}: profiled one call", flush=True)


def reduce(page: str, raw: str, steps: int) -> dict:
    rows = sass_stalls.read_page(page)
    sass_stalls.annotate(rows, fwd.phase_of)
    fwd.fmul_runs(rows)                                  # O's rescale apart from the other FMUL
    out = {**raw_metrics(raw), **sass_stalls.summarize(rows, top=40, annotated=True)}
    by_class = fwd.executed_by_class(rows)
    out["executed_by_class"] = by_class
    # warp instructions per KV step per consumer warp (8 consumer warps a CTA; the producer's few
    # instructions included): comparable between the two kernels, which run the same steps
    out["per_step_per_warp"] = {c: round(v / (steps * 8), 1) for c, v in by_class.items()}
    out["per_step_per_warp"]["all"] = round(sum(by_class.values()) / (steps * 8), 1)
    out["pcs"] = [[r["index"], r["sass"][:96], r["samples"], r["executed"], r["phase"][:24]]
                  for r in rows if r["executed"] or r["samples"]]
    return out


def profile(system: str, row: str, ncu: str, timeout: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "rep"
        cmd = [ncu, "--profile-from-start", "off", "-k", KERNEL[system], "--launch-count", "1", "-f", "-o", str(rep)]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--rows", row]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        path = rep.with_suffix(".ncu-rep")
        if not path.exists():
            return {"error": f"ncu rc={run.returncode}: {(run.stdout + run.stderr)[-600:]}"}
        page = subprocess.run([ncu, "-i", str(path), "--page", "source", "--csv", "--print-source", "sass"],
                              capture_output=True, text=True, timeout=120)
        raw = subprocess.run([ncu, "-i", str(path), "--page", "raw", "--csv", "--print-units", "base"],
                             capture_output=True, text=True, timeout=120)
    try:
        out = reduce(page.stdout, raw.stdout, steps)
    except ValueError as e:
        return {"error": f"{e}: {(page.stdout[:300] + page.stderr[-300:])}"}
    out["raw"] = raw_matching(raw.stdout, MORE_RAW)
    return out


def raw_matching(text: str, parts, limit: int = 60) -> dict:
    """{column: value} of the raw page's first kernel row, for columns whose name holds one of `parts`."""
    import csv
    import io
    rows = list(csv.reader(io.StringIO(text[text.find('"ID"'):] if '"ID"' in text else text)))
    if len(rows) < 3:
        return {}
    got = {}
    for h, v in zip(rows[0], rows[2]):
        if any(p in h for p in parts) and len(got) < limit:
            try:
                got[h] = float(v.replace(",", ""))
            except ValueError:
                got[h] = v
    return got


def print_run(run: dict) -> None:
    name = f"{run['system']} {run['row']}"
    if "error" in run:
        print(f"== {name}: error: {run['error'][:300]}", flush=True)
        return
    us = run.get("gpu__time_duration.sum")
    head = name + (f" ({us / 1e3:.0f} us" if isinstance(us, float) else " (") + \
        f", {run.get('launch__registers_per_thread', '?')} regs, grid {run.get('launch__grid_size', '?')})"
    print(sass_stalls.table(head, run, top=12), flush=True)
    print("   per KV step per consumer warp: " + ", ".join(f"{k} {v}" for k, v in run["per_step_per_warp"].items()))
    print("   " + ", ".join(f"{k.replace('.avg.pct_of_peak_sustained', '%')[:48]} {v:.1f}"
                           for k, v in run.get("raw", {}).items() if isinstance(v, float) and "pct" in k)[:900])


def print_tables(result: dict, each: bool = True) -> None:
    print(f"tile model ({result['shape']}): {result['tile_model']}")
    for run in result["runs"] if each else []:
        print_run(run)
    # cycles per KV step per CTA (gpc__cycles_elapsed.max over the tile model's steps per CTA): ncu's clocks
    # differ between kernels (session 14: FA4 1.45 GHz, ours 1.58), so cycles compare where us do not
    print("\nsystem row         us  cyc/step  samples  inst/step/warp  top phases (share of samples)")
    for run in result["runs"]:
        if "error" in run:
            continue
        us = run.get("gpu__time_duration.sum")
        cycles = run.get("raw", {}).get("gpc__cycles_elapsed.max")
        per_step = cycles / result["tile_model"]["steps_per_cta"] if isinstance(cycles, float) else 0
        phases = ", ".join(f"{k.split(' (')[0]} {v / run['samples']:.0%}" for k, v in list(run["phases"].items())[:5])
        print(f"{run['system']:<6} {run['row']:<10} {us / 1e3 if isinstance(us, float) else 0:7.0f} {per_step:9.0f} "
              f"{run['samples']:8d}  {run['per_step_per_warp']['all']:14.1f}  {phases}")
    print("\n" + phase_us(result))


def phase_us(result: dict) -> str:
    """Each phase's share of a run's samples times the run's duration (us under ncu's locked clocks):
    where the kernels differ in time, not in share, side by side."""
    runs = [r for r in result["runs"] if "error" not in r and isinstance(r.get("gpu__time_duration.sum"), float)]
    if not runs:
        return ""
    phases = sorted({p for r in runs for p in r["phases"]}, key=lambda p: -max(r["phases"].get(p, 0) / r["samples"]
                                                                            * r["gpu__time_duration.sum"] for r in runs))
    head = f"{'phase (us = share x duration)':46}" + "".join(f"{r['system'] + ' ' + r['row']:>14}" for r in runs)
    lines = [head]
    for p in phases:
        lines.append(f"{p[:46]:46}" + "".join(
            f"{r['phases'].get(p, 0) / r['samples'] * r['gpu__time_duration.sum'] / 1e3:14.1f}" for r in runs))
    lines.append(f"{'kernel':46}" + "".join(f"{r['gpu__time_duration.sum'] / 1e3:14.1f}" for r in runs))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="SYSTEM", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="print the tables of an earlier --out JSON and stop")
    ap.add_argument("--systems", nargs="+", default=["ours", "fa4"], choices=["ours", "fa4"])
    ap.add_argument("--rows", nargs="+", default=["128x80"],
                    help="our configs profiled, bench_d256.py's row syntax (128x80, 128x80fr, 128x80fk, ...)")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--timeout", type=int, default=100, help="seconds per profiled process")
    args = ap.parse_args(argv)
    if args.table:
        print_tables(json.loads(args.table.read_text()))
        return 0
    if args.worker:
        worker(args.worker, args.rows[0])
        return 0
    model = fwd.tile_model(N, BM, BN, B * HEADS)
    result = {"date": datetime.now(timezone.utc).isoformat(), "sections": SECTIONS, "tile_model": model,
              "shape": f"bf16 D{D} B{B} {HEADS} heads N {N} causal, tile {BM}x{BN}", "runs": []}
    todo = [("fa4", "fa4")] * ("fa4" in args.systems) + [("ours", r) for r in args.rows] * ("ours" in args.systems)
    for system, row in todo:                              # FA4 first: the peer is what we read against
        try:
            got = profile(system, row, args.ncu, args.timeout, model["steps"])
        except subprocess.TimeoutExpired:
            got = {"error": f"ncu timed out after {args.timeout} s"}
        result["runs"].append({"system": system, "row": row, **got})
        print_run(result["runs"][-1])
        if args.out:
            args.out.write_text(json.dumps(result, indent=0))
    print_tables(result, each=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
