"""Where a persistent CTA's time goes outside the KV loop (issue 18, session 13): the dense fa3 kernel
at its default tile, built with experiments/patches/knobs/cta_timeline.patch (CUIR_CTA_TIMELINE_PTR,
the address of a buffer allocated here, compiled in; the product kernel has no marks), run through
the product's own launch (fa3_forward with the built cubin: same grid, same tile order), once per
recorded run with L2 flushed. Every CTA's producer thread and consumer warpgroups stamp clock64 at
each tile's edges and globaltimer at entry and exit, from which, per case:

- step: the steady KV loop's cycles per KV tile (consumer 0; median over its longest tiles)
- startup: CTA entry -> the first tile's S ready (cycles; in steps), producer entry -> first K issued
- boundary: per tile, first-S-to-first-S minus kv x step (what a tile hand-over costs beyond the loop)
- epilogue: cycles in epilogue() (runs under the next tile's first QK where O has its own stage)
- drain: the last tile's loop end -> CTA exit
- head / tail idle: the mean share of the kernel's span an SM spends before its CTA starts / after
  it exits (globaltimer, all CTAs): launch skew and the last wave's imbalance
- overhead: 1 - (tiles' kv x step) / CTA busy cycles, i.e. all of the above per CTA

The timeline build's output is compared bitwise with the product's, and both are timed round-robin
(`marks_cost`: timeline / product ms, the marks' own cost).

    python experiments/cta_timeline.py --out $OUT/cta_timeline.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from expkit import gpu_ms, patched_source, versions
from cubridge.runtime.fa3_sm90 import Fa3Config, build_cubin, default_config, fa3_forward

PATCH = "knobs/cta_timeline"
CTAS, ROWS, LEN = 256, 4, 512          # CUIR_CTA_TIMELINE_CTAS / rows per CTA / CUIR_CTA_TIMELINE_LEN
EV = {1: "g_entry", 2: "entry", 3: "tile", 4: "kv", 5: "first_turn", 6: "first_s", 7: "loop_end",
      8: "epilogue", 9: "epilogue_done", 10: "exit", 11: "g_exit", 12: "first_k"}
# (label, D, causal, Hq, Hkv, N); B = 16384 // N as in the peer benchmarks
CASES = [("full_d128_8k", 128, False, 32, 32, 8192), ("causal_d128_8k", 128, True, 32, 32, 8192),
         ("full_d64_8k", 64, False, 32, 32, 8192), ("causal_d64_8k", 64, True, 32, 32, 8192),
         ("full_d128_8k_gqa", 128, False, 64, 8, 8192),
         # 1k (session 17: where cuDNN leads; B 16 x 32 heads, 31 / 23 tiles per CTA at D 64 causal / full)
         ("causal_d64_1k", 64, True, 32, 32, 1024), ("full_d64_1k", 64, False, 32, 32, 1024),
         ("causal_d128_1k", 128, True, 32, 32, 1024)]
DEFAULT_CASES = ["full_d128_8k", "causal_d128_8k", "full_d64_8k"]


def timeline_source(address: int) -> str:
    return f"#define CUIR_CTA_TIMELINE_PTR {address:#x}ull\n" + patched_source(PATCH)


def parse(row: list[int]) -> list[tuple[str, int]]:
    # (torch's int64: a globaltimer stamp may set bit 63; read the word unsigned)
    return [(EV.get(s & 0xFF, "?"), (s % (1 << 64)) >> 8) for s in row if s]


def consumer_tiles(marks):
    """[(kv, first_turn, first_s, loop_end)] of one consumer's tiles, its epilogue lengths, entry, exit."""
    tiles, epis, cur, epi0 = [], [], None, None
    entry = exit_ = None
    for ev, v in marks:
        if ev == "entry":
            entry = v
        elif ev == "exit":
            exit_ = v
        elif ev == "tile":
            cur = {"start": v}
            tiles.append(cur)
        elif ev in ("kv", "first_turn", "first_s", "loop_end") and cur is not None:
            cur[ev] = v
        elif ev == "epilogue":
            epi0 = v
        elif ev == "epilogue_done" and epi0 is not None:
            epis.append(v - epi0)
    return [t for t in tiles if "loop_end" in t], epis, entry, exit_


def analyse(rows: list[list[int]], ctas: int, consumers: int) -> dict:
    """Per-case numbers from one launch's buffer (rows: CTAS * ROWS lists of stamps)."""
    per_cta, truncated = [], 0
    for cta in range(ctas):
        prod = parse(rows[cta * ROWS])
        cons = [parse(rows[cta * ROWS + 1 + c]) for c in range(consumers)]
        truncated += sum(len([s for s in rows[cta * ROWS + r] if s]) >= LEN for r in range(1 + consumers))
        tiles, epis, entry, exit_ = consumer_tiles(cons[0])
        g = dict((ev, v) for ev, v in cons[0] if ev in ("g_entry", "g_exit"))
        p = dict((ev, v) for ev, v in reversed(prod) if ev in ("entry", "first_k"))   # first of each
        last = consumer_tiles(cons[-1])
        per_cta.append({"tiles": tiles, "epis": epis, "entry": entry, "exit": exit_, "g": g, "prod": p,
                        "last_first_s": last[0][0]["first_s"] - last[2] if last[0] else None})
    ok = [c for c in per_cta if c["tiles"] and c["entry"] is not None and c["exit"] is not None
          and "g_entry" in c["g"] and "g_exit" in c["g"]]
    if not ok:
        return {"error": "no complete CTA timeline in the buffer"}
    max_kv = max(t["kv"] for c in ok for t in c["tiles"])
    steps = [(t["loop_end"] - t["first_s"]) / (t["kv"] - 1) for c in ok for t in c["tiles"]
             if t["kv"] >= max(2, 0.75 * max_kv)]
    step = statistics.median(steps)
    g0, g1 = min(c["g"]["g_entry"] for c in ok), max(c["g"]["g_exit"] for c in ok)
    span_ns = g1 - g0
    ghz = statistics.median((c["exit"] - c["entry"]) / max(1, c["g"]["g_exit"] - c["g"]["g_entry"]) for c in ok)
    bound, startup, drain, overhead, loop, prod_k = [], [], [], [], [], []
    for c in ok:
        ts = c["tiles"]
        startup.append(ts[0]["first_s"] - c["entry"])
        drain.append(c["exit"] - ts[-1]["loop_end"])
        bound += [b["first_s"] - a["first_s"] - a["kv"] * step for a, b in zip(ts, ts[1:])]
        loop.append(sum(t["kv"] for t in ts) * step)
        overhead.append(1 - loop[-1] / (c["exit"] - c["entry"]))
        if "entry" in c["prod"] and "first_k" in c["prod"]:
            prod_k.append(c["prod"]["first_k"] - c["prod"]["entry"])
    ntiles = [len(c["tiles"]) for c in ok]
    head = statistics.fmean((c["g"]["g_entry"] - g0) / span_ns for c in ok)
    tail = statistics.fmean((g1 - c["g"]["g_exit"]) / span_ns for c in ok)
    epis = [e for c in ok for e in c["epis"]]
    last_s = [c["last_first_s"] for c in ok if c["last_first_s"] is not None]
    med = lambda xs: round(statistics.median(xs), 1) if xs else None   # noqa: E731
    return {"ctas": ctas, "ctas_read": len(ok), "truncated_rows": truncated, "span_us": round(span_ns / 1e3, 2),
            "sm_ghz": round(ghz, 3), "tiles_per_cta": [min(ntiles), max(ntiles), round(statistics.fmean(ntiles), 2)],
            "max_kv": max_kv, "step_cycles": round(step, 1),
            "startup_cycles": med(startup), "startup_steps": round(statistics.median(startup) / step, 2),
            "startup_last_consumer_cycles": med(last_s), "producer_first_k_cycles": med(prod_k),
            "boundary_cycles": med(bound), "boundary_mean_cycles": round(statistics.fmean(bound), 1) if bound else None,
            "boundary_steps": round(statistics.median(bound) / step, 3) if bound else None,
            "epilogue_cycles": med(epis), "drain_cycles": med(drain),
            "head_idle": round(head, 4), "tail_idle": round(tail, 4),
            "overhead": round(statistics.fmean(overhead), 4),
            # the kernel with nothing but steady KV steps, perfectly balanced over the CTAs
            "loop_ideal_us": round(statistics.fmean(loop) / ghz / 1e3, 2),
            "what_each_costs": {   # shares of the SMs' time over the span, each the most its fix buys
                "startup": round(statistics.fmean(startup) / ghz / span_ns, 4),
                "boundaries": round(sum(bound) / len(ok) / ghz / span_ns, 4),
                "drain": round(statistics.fmean(drain) / ghz / span_ns, 4),
                "head_idle": round(head, 4), "tail_idle": round(tail, 4)}}


def case_config(case, args):
    """The case's default config with --options set."""
    return replace(default_config(case[1], case[2], True, case[5]), **{o: True for o in args.options})


def run_case(case, cubins, args):
    import torch
    from cubridge.runtime.timing import _flush_buffer
    label, d, causal, hq, hkv, n = case
    cfg, (prod_cubin, tl_cubin, buf) = case_config(case, args), cubins[label]
    b = 16384 // n
    g = torch.Generator(device="cuda").manual_seed(1300 + n + d)
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out_p, out_t = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    prod = lambda: fa3_forward(q, k, v, causal=causal, config=cfg, out=out_p, cubin=prod_cubin)   # noqa: E731
    tl = lambda: fa3_forward(q, k, v, causal=causal, config=cfg, out=out_t, cubin=tl_cubin)       # noqa: E731
    prod()
    tl()
    torch.cuda.synchronize()
    same = bool(torch.equal(out_p, out_t)) and not bool(torch.isnan(out_p).any())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = min(math.ceil(n / cfg.block_m) * hq * b, sms)
    assert ctas <= CTAS, f"{ctas} CTAs: raise CUIR_CTA_TIMELINE_CTAS"
    flush = _flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    runs = []
    for r in range(args.runs):
        buf.zero_()
        flush.fill_(r & 0xFF)
        torch.cuda._sleep(1_000_000)     # the launch queued behind it: no host gap inside the span
        tl()
        torch.cuda.synchronize()
        runs.append(analyse(buf.view(CTAS * ROWS, LEN).cpu().tolist(), ctas, cfg.block_m // 64))
    fns, fa4 = [prod, tl], None
    try:   # FA4 as a user calls it, timed beside ours: is its whole kernel under our loop's ideal?
        from expkit.peers import make_fa4
        fn, _ = make_fa4("causal" if causal else "full", q, k, v)
        fa4_err = float((fn().float() - out_p.float()).abs().max())
        fa4 = fn
        fns.append(fa4)
    except Exception as e:  # noqa: BLE001 (FA4 missing: the timeline stands without it)
        fa4_err = f"{type(e).__name__}: {str(e)[:200]}"
    ms = gpu_ms(fns, reps=args.reps)
    ms_prod, ms_tl = ms[0], ms[1]
    good = [r for r in runs if "error" not in r] or runs[:1]
    keys = [key for key, val in good[0].items() if isinstance(val, (int, float))]
    summary = {key: round(statistics.median(r[key] for r in good), 4)
               for key in keys if all(r.get(key) is not None for r in good)}
    summary["what_each_costs"] = {k: round(statistics.median(r["what_each_costs"][k] for r in good), 4)
                                  for k in good[0].get("what_each_costs", {})}
    return {"case": label, "D": d, "causal": causal, "Hq": hq, "Hkv": hkv, "N": n, "B": b,
            "config": f"{cfg.block_m}x{cfg.block_n}s{cfg.stages}{'P' if cfg.persistent else 'G'}"
                      + "".join(f"+{o}" for o in args.options),
            "bitwise_equal_product": same, "ms_product": round(ms_prod, 4), "ms_timeline": round(ms_tl, 4),
            "marks_cost": round(ms_tl / ms_prod, 4), "ms_fa4": round(ms[2], 4) if fa4 else None,
            "fa4_max_abs_diff_vs_ours": fa4_err, "median_of_runs": summary, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, choices=[c[0] for c in CASES])
    ap.add_argument("--runs", type=int, default=3, help="recorded launches per case (median of their numbers)")
    ap.add_argument("--reps", type=int, default=20, help="timing reps of product vs timeline build")
    ap.add_argument("--options", nargs="*", default=[],
                    help="Fa3Config bool fields set on every case's default config (e.g. o_half): the "
                         "timeline of an option, beside its own product build")
    args = ap.parse_args(argv)
    from dataclasses import fields
    flags = {f.name for f in fields(Fa3Config) if f.type in ("bool", bool)} - {"causal", "bf16", "persistent"}
    if any(o not in flags for o in args.options):
        ap.error(f"--options: one of {args.options} is not a bool field of Fa3Config ({', '.join(sorted(flags))})")
    import torch
    cases = [c for c in CASES if c[0] in args.cases]
    bufs = {c[0]: torch.zeros(CTAS * ROWS * LEN, dtype=torch.int64, device="cuda") for c in cases}

    def build(c):
        cfg = case_config(c, args)
        return c[0], (build_cubin(cfg), build_cubin(cfg, source=timeline_source(bufs[c[0]].data_ptr())),
                      bufs[c[0]])
    with ThreadPoolExecutor(max_workers=8) as pool:
        cubins = dict(pool.map(build, cases))
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
              "versions": versions(), "patch": PATCH, "rows": []}
    for case in cases:
        result["rows"].append(run_case(case, cubins, args))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    print_table(result["rows"])
    return 0 if all(r["bitwise_equal_product"] for r in result["rows"]) else 1


COLUMNS = [("loop_ideal_us", "ideal_us"), ("step_cycles", "step"), ("startup_steps", "start/st"),
           ("boundary_cycles", "bound"), ("boundary_steps", "bnd/st"), ("epilogue_cycles", "epi"), ("drain_cycles", "drain"),
           ("head_idle", "head"), ("tail_idle", "tail"), ("overhead", "ovh"), ("sm_ghz", "GHz")]


def print_table(rows):
    print("\ncase              config     span_us tiles/CTA  " + " ".join(f"{h:>8}" for _, h in COLUMNS)
          + "  marks_cost ours_ms fa4_ms bitwise")
    for r in rows:
        s = r["median_of_runs"]
        tiles = r["runs"][0].get("tiles_per_cta", ["?"] * 3)
        print(f"{r['case']:<17} {r['config']:<10} {s.get('span_us', float('nan')):8.1f} {tiles[0]:>3}-{tiles[1]:<3}    "
              + " ".join(f"{s.get(k, float('nan')):8.4g}" for k, _ in COLUMNS)
              + f"  {r['marks_cost']:9.3f} {r['ms_product']:7.3f} {r['ms_fa4'] or float('nan'):6.3f}"
              f" {r['bitwise_equal_product']}")


if __name__ == "__main__":
    raise SystemExit(main())
