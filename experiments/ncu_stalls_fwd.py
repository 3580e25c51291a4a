"""Issues 18 / 19: where the warps of ours' and FlashAttention-4's SM90 forward wait, per SASS
instruction (bf16, B 2, 16 heads, 8k; D 256 dense causal by default, --d 128 / 64 and --full since session
15). ncu's SourceCounters (warp-state sampling and instructions executed per PC), WarpStateStats and
SpeedOfLight / MemoryWorkloadAnalysis of one launch each, reduced by expkit.sass_stalls(_fwd) to: stall
reasons and step phases (QK wait, P V wait, softmax, rescale, K/V mbarrier waits, turns, epilogue) as shares
of the samples, the top stalled PCs with their SASS, the executed instructions per KV step per consumer
warp by opcode class (each kernel's own tile: ours from its config, FA4's from its SASS and block size),
the same per 128 keys (tiles of other widths compare there), and cycles per KV step per SM
(gpc__cycles_elapsed.max x 132 / steps: ncu's clocks differ between kernels, so cycles, not us).

    python experiments/ncu_stalls_fwd.py --out $OUT/ncu_fwd.json [--systems ours fa4] [--rows 128x80 128x80fr]
    python experiments/ncu_stalls_fwd.py --d 128 --full --rows dflt dfltz --out $OUT/ncu_d128.json
        (dflt = default_config at that shape; flags z = mbar_sleep, d = desc_once, then eM = exp2_emu=M: dflte2)
    python experiments/ncu_stalls_fwd.py --table $OUT/ncu_fwd.json

Each profile runs in its own process under `ncu --profile-from-start off -k KERNEL --launch-count 1`:
the worker builds / JIT-compiles and warms up outside the window and opens it around one call. The
JSON is rewritten after each profile (a call cut short keeps the finished ones) and keeps every
executed PC (index, SASS, samples, executed), so FA4's step can be read again without a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import re
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
FA4_TILE = {256: (128, 80), 128: (128, 128), 64: (192, 128)}   # where its SASS does not say (fa4_tile)
DFLT_FLAGS = {"z": "mbar_sleep", "d": "desc_once"}             # dflt rows: default_config + these options
SMS = 132
# Raw-page columns kept beside expkit.sass_stalls.raw_metrics' list: any whose name holds one of these (from
# the sections above; no --metrics list, whose one unknown name would fail the whole profile).
MORE_RAW = ("pipe_tensor", "lts__t_sector_hit_rate", "lts__t_sectors_srcunit_tex_lookup_hit", "dram__throughput",
            "lts__throughput", "dram__bytes_read.sum", "sm__throughput", "smsp__inst_executed.sum",
            "sm__cycles_elapsed.avg", "l1tex__throughput", "gpc__cycles_elapsed.max", "sm__cycles_active",
            # (session 17) the MUFU's pipe (xu) beside the tensor pipe and the FMA / ALU pipes, and issue slots
            "pipe_xu", "pipe_fma", "pipe_alu", "issue_active", "inst_issued")


def shape_args(args) -> list[str]:
    return ["--d", str(args.d), "--n", str(args.n), "--heads", str(args.heads)] + ["--full"] * args.full


def our_config(row: str, d: int, causal: bool, n: int):
    """'dflt[z][d]': default_config(d, causal, n) with DFLT_FLAGS' options; else bench_d256's row syntax at d."""
    from dataclasses import replace

    from cubridge.runtime.fa3_sm90 import Fa3Config, default_config
    if row.startswith("dflt"):
        m = re.fullmatch(r"([a-z]*?)(?:e(\d))?", row[4:])
        if m is None or any(f not in DFLT_FLAGS for f in m.group(1)):
            raise SystemExit(f"error: --rows {row}: flags after dflt are {sorted(DFLT_FLAGS)}, then eM (exp2_emu=M)")
        emu = {"exp2_emu": int(m.group(2))} if m.group(2) else {}
        return replace(default_config(d, causal, True, n), persistent=True, **{DFLT_FLAGS[f]: True for f in m.group(1)},
                       **emu)
    from expkit.d256 import parse_row
    bm, bn, options = parse_row(row)
    return Fa3Config(**{**dict(head_dim=d, block_m=bm, block_n=bn, stages=2, causal=causal, bf16=True,
                               persistent=True), **options})


def worker(system: str, row: str, d: int, causal: bool, n: int, heads: int) -> None:
    """Inside ncu: build / compile, warm up, then one call inside cudaProfilerStart / Stop."""
    import torch
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if system == "ours":
        from cubridge.runtime.fa3_sm90 import fa3_forward
        cfg = our_config(row, d, causal, n)
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        fn = lambda: fa3_forward(q, k, v, causal=causal, config=cfg, out=out, lse=lse)[0]   # noqa: E731
    elif d == 256 and causal:
        from expkit.d256 import fa4
        fn = fa4(q, k, v)
    else:
        from expkit.peers import make_fa4
        fn, _ = make_fa4("causal" if causal else "full", q, k, v)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"worker {system} {row}: profiled one call", flush=True)


def kv_steps(n: int, bm: int, bn: int, heads: int, causal: bool) -> int:
    if causal:
        return fwd.tile_model(n, bm, bn, heads)["steps"]
    return math.ceil(n / bm) * math.ceil(n / bn) * heads


def sass_tile(out: dict, default: tuple[int, int]) -> tuple[int, int]:
    """A kernel's tile from its profile: BLOCK_N from the QK's HGMMA (both operands in shared memory:
    HGMMA.64xNx16 ... gdesc as A), BLOCK_M from the block size (one producer warpgroup, 64 rows per
    consumer warpgroup)."""
    bn = next((int(m.group(1)) for pc in out.get("pcs", []) if (m := re.match(r"HGMMA\.64x(\d+)x16\.\S+ R\d+, gdesc", pc[1]))),
              default[1])
    block = out.get("launch__block_size")
    bm = int(block // 128 - 1) * 64 if isinstance(block, float) and block >= 256 else default[0]
    return bm, bn


def per_step(out: dict, steps: int, warps: int, bn: int) -> None:
    """Executed warp instructions per KV step per consumer warp (and per 128 keys), cycles per step per SM."""
    by_class = out["executed_by_class"]
    out["per_step_per_warp"] = {c: round(v / (steps * warps), 1) for c, v in by_class.items()}
    out["per_step_per_warp"]["all"] = round(sum(by_class.values()) / (steps * warps), 1)
    out["per_128_keys_per_warp"] = round(sum(by_class.values()) / (steps * warps * bn / 128), 1)
    cycles = out.get("raw", {}).get("gpc__cycles_elapsed.max")
    # the SMs' share of the elapsed cycles with a CTA on them (session 16: ours 0.943, FA4 0.986 at causal 8k,
    # the tail of the head-by-head tile order): the tensor pipe's busy share of elapsed over that of active cycles
    raw = out.get("raw", {})
    el, ac = (raw.get(f"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_{w}") for w in ("elapsed", "active"))
    if isinstance(el, float) and isinstance(ac, float) and ac > 0:
        out["sm_active_share"] = round(el / ac, 4)
    if isinstance(cycles, float):
        out["cycles_per_step_per_sm"] = round(cycles * SMS / steps, 1)
        out["cycles_per_128_keys_per_sm"] = round(cycles * SMS / (steps * bn / 128), 1)


def reduce(page: str, raw: str, steps: int, warps: int = 8) -> dict:
    rows = sass_stalls.read_page(page)
    sass_stalls.annotate(rows, fwd.phase_of)
    fwd.fmul_runs(rows)                                  # O's rescale apart from the other FMUL
    out = {**raw_metrics(raw), **sass_stalls.summarize(rows, top=40, annotated=True)}
    by_class = fwd.executed_by_class(rows)
    out["executed_by_class"] = by_class
    # warp instructions per KV step per consumer warp (`warps` consumer warps a CTA; the producer's few
    # instructions included): comparable between two kernels that run the same steps
    out["per_step_per_warp"] = {c: round(v / (steps * warps), 1) for c, v in by_class.items()}
    out["per_step_per_warp"]["all"] = round(sum(by_class.values()) / (steps * warps), 1)
    out["pcs"] = [[r["index"], r["sass"][:96], r["samples"], r["executed"], r["phase"][:24]]
                  for r in rows if r["executed"] or r["samples"]]
    return out


def profile(system: str, row: str, ncu: str, timeout: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "rep"
        cmd = [ncu, "--profile-from-start", "off", "-k", KERNEL[system], "--launch-count", "1", "-f", "-o", str(rep)]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--rows", row, *shape_args(args)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        path = rep.with_suffix(".ncu-rep")
        if not path.exists():
            return {"error": f"ncu rc={run.returncode}: {(run.stdout + run.stderr)[-600:]}"}
        page = subprocess.run([ncu, "-i", str(path), "--page", "source", "--csv", "--print-source", "sass"],
                              capture_output=True, text=True, timeout=120)
        raw = subprocess.run([ncu, "-i", str(path), "--page", "raw", "--csv", "--print-units", "base"],
                             capture_output=True, text=True, timeout=120)
    try:
        out = reduce(page.stdout, raw.stdout, 1, 1)
    except ValueError as e:
        return {"error": f"{e}: {(page.stdout[:300] + page.stderr[-300:])}"}
    out["raw"] = raw_matching(raw.stdout, MORE_RAW)
    if system == "ours":
        cfg = our_config(row, args.d, not args.full, args.n)
        bm, bn = cfg.block_m, cfg.block_n
    else:
        bm, bn = sass_tile(out, FA4_TILE[args.d])
    steps = kv_steps(args.n, bm, bn, B * args.heads, not args.full)
    out["tile"], out["steps"] = f"{bm}x{bn}", steps
    per_step(out, steps, bm // 64 * 4, bn)
    return out


def raw_matching(text: str, parts, limit: int = 240) -> dict:
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
    print(f"   tile {run.get('tile')}, {run.get('steps')} KV steps; per 128 keys per consumer warp "
          f"{run.get('per_128_keys_per_warp')} instructions, {run.get('cycles_per_128_keys_per_sm')} cycles per SM; "
          f"{run.get('cycles_per_step_per_sm')} cycles per step per SM; SMs active {run.get('sm_active_share')} of the time")
    print("   per KV step per consumer warp: " + ", ".join(f"{k} {v}" for k, v in run["per_step_per_warp"].items()))
    print("   " + ", ".join(f"{k.replace('.avg.pct_of_peak_sustained', '%')[:48]} {v:.1f}"
                           for k, v in run.get("raw", {}).items() if isinstance(v, float) and "pct" in k)[:900])


def print_tables(result: dict, each: bool = True) -> None:
    print(f"tile model ({result['shape']}): {result['tile_model']}")
    for run in result["runs"] if each else []:
        print_run(run)
    print("\nsystem row      tile     us  inst/step/warp  inst/128k/warp  cyc/128k/SM  active  top phases (share of samples)")
    for run in result["runs"]:
        if "error" in run:
            continue
        us = run.get("gpu__time_duration.sum")
        phases = ", ".join(f"{k.split(' (')[0]} {v / run['samples']:.0%}" for k, v in list(run["phases"].items())[:5])
        print(f"{run['system']:<6} {run['row']:<8} {run.get('tile', '?'):>7} {us / 1e3 if isinstance(us, float) else 0:6.0f} "
              f"{run['per_step_per_warp']['all']:14.1f}  {run.get('per_128_keys_per_warp', 0):14.1f}  "
              f"{run.get('cycles_per_128_keys_per_sm', 0):11.1f}  {run.get('sm_active_share', 0):6.3f}  {phases}")
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
    ap.add_argument("--d", type=int, default=D, choices=sorted(FA4_TILE), help="head dim (default 256)")
    ap.add_argument("--full", action="store_true", help="full attention (default causal)")
    ap.add_argument("--n", type=int, default=N, help="sequence length (Nq = Nk)")
    ap.add_argument("--heads", type=int, default=HEADS, help=f"heads (MHA), batch {B}")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--timeout", type=int, default=100, help="seconds per profiled process")
    args = ap.parse_args(argv)
    if args.table:
        print_tables(json.loads(args.table.read_text()))
        return 0
    if args.worker:
        worker(args.worker, args.rows[0], args.d, not args.full, args.n, args.heads)
        return 0
    mask = "full" if args.full else "causal"
    model = ({order: fwd.tile_model(args.n, BM, BN, B * args.heads, order=order)
              for order in ("lpt", "heads", "sections")} if args.d == 256 and not args.full else {})
    result = {"date": datetime.now(timezone.utc).isoformat(), "sections": SECTIONS, "tile_model": model,
              "shape": f"bf16 D{args.d} B{B} {args.heads} heads N {args.n} {mask}", "runs": []}
    todo = [("fa4", "fa4")] * ("fa4" in args.systems) + [("ours", r) for r in args.rows] * ("ours" in args.systems)
    for system, row in todo:                              # FA4 first: the peer is what we read against
        try:
            got = profile(system, row, args.ncu, args.timeout, args)
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
