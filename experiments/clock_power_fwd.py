"""Issue 18 (session 15): the SM clock and board power while ours' and FA4's dense forward run back to back.

Session 15's mid call: under ncu (locked clocks) ours' full D 128 8k default needs 1.0% more cycles per 128 keys
than FA4 (2549.8 vs 2524.5 per SM) while the timed run has FA4 3.8% ahead, and ours issues 6.7% more warp
instructions (497 vs 466 per 128 keys per consumer warp). If the timed gap is a clock gap (more issued work, more
power, a lower boost clock under the power cap), the sustained SM clock of ours is below FA4's. This runs each
system for --seconds of back-to-back calls, twice, alternating, while `nvidia-smi` samples the SM clock, power
and temperature every 100 ms, and reports per window: ms per call, TFLOPS, median SM MHz and W, and
kcycles per call (ms x MHz: the cycles the call took at the clock it ran at).

    python experiments/clock_power_fwd.py [--d 128] [--causal] [--seconds 4] [--options producer_sleep ...] --out $OUT/clock.json

--options (session 16): ours with these Fa3Config options set (ab_peer_patches' form, `a+b`) also runs, as
"ours_<spec>", in the same alternation (ours, each option row, fa4; twice).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import expkit  # noqa: F401 - cubridge importable from a bare checkout

QUERY = "clocks.sm,power.draw,temperature.gpu"


def sampled(fn, seconds: float) -> dict:
    """fn called back to back for `seconds` (batches of 10, events around each) under nvidia-smi sampling."""
    import torch
    try:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100",
                                "-i", str(torch.cuda.current_device())], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    except OSError as e:                                  # no nvidia-smi: the times alone
        smi, out, err = None, "", f"nvidia-smi: {e}"
    times, start = [], time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(10):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 10)
    finally:
        if smi is not None:
            smi.terminate()
            out, err = smi.communicate(timeout=10)
    rows = []
    for line in out.splitlines():
        try:
            rows.append([float(x) for x in line.split(",")])
        except ValueError:
            continue
    rows = rows[len(rows) // 4:]                          # the first quarter: the clock settling
    got = {"ms": round(statistics.median(times[len(times) // 4:]), 4), "calls": 10 * len(times), "samples": len(rows)}
    if rows:
        for i, name in enumerate(("sm_mhz", "watts", "temp_c")):
            got[name] = round(statistics.median(r[i] for r in rows), 1)
        got["kcycles_per_call"] = round(got["ms"] * got["sm_mhz"], 1)   # ms x MHz = thousands of cycles
    else:
        got["smi_error"] = (err or out)[-300:]
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128, choices=(64, 128))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--options", nargs="*", default=[], help="also ours with these Fa3Config options (a+b)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
    from expkit.peers import make_fa4
    b, h, n, d = 16384 // args.n, 32, args.n, args.d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cfg = default_config(d, args.causal, True, n)
    out = torch.empty_like(q)
    from dataclasses import replace
    systems = {"ours": lambda: fa3_forward(q, k, v, causal=args.causal, config=cfg, out=out)[0]}
    for spec in args.options:
        opt = replace(cfg, **{name.partition("=")[0]: name.partition("=")[2] != "0" for name in spec.split("+")})
        systems[f"ours_{spec}"] = lambda opt=opt: fa3_forward(q, k, v, causal=args.causal, config=opt, out=out)[0]
    systems["fa4"] = make_fa4("causal" if args.causal else "full", q, k, v)[0]
    ref = systems["ours"]().float()
    diff = (systems["fa4"]().float() - ref).abs().max().item()   # same inputs, same attention: bf16 apart
    option_diffs = {name: (fn().float() - ref).abs().max().item() for name, fn in systems.items()
                    if name.startswith("ours_")}   # an option is the same arithmetic: 0 expected
    flops = 4 * b * h * n * n * d / (2 if args.causal else 1)
    result = {"date": datetime.now(timezone.utc).isoformat(), "gpu": torch.cuda.get_device_name(),
              "shape": f"bf16 D{d} B{b} {h} heads N {n} {'causal' if args.causal else 'full'}",
              "ours_config": " ".join(cfg.defines()), "max_abs_diff_ours_fa4": diff,
              "max_abs_diff_options": option_diffs, "windows": []}
    for name in list(systems) * 2:
        got = sampled(systems[name], args.seconds)
        got.update(system=name, tflops=round(flops / got["ms"] / 1e9, 1))
        result["windows"].append(got)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    print(f"{result['shape']}; ours {result['ours_config']}; max |ours - fa4| {diff:.2e}")
    print(f"{'system':<30}      ms  TFLOPS  SM MHz      W  temp  kcycles/call  samples")
    for w in result["windows"]:
        print(f"{w['system']:<30} {w['ms']:7.3f} {w['tflops']:7.1f} {w.get('sm_mhz', 0):7.0f} {w.get('watts', 0):6.0f} "
              f"{w.get('temp_c', 0):5.0f} {w.get('kcycles_per_call', 0):13.1f} {w['samples']:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
