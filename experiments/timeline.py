"""Where a consumer warpgroup's time goes, phase by phase: the fa3 kernel built with timeline marks
(experiments/patches/knobs/timeline.patch adds them to consumer.cuh; CUIR_TIMELINE_PTR, the address
of a buffer allocated here, is compiled in; the product kernel has no marks), run once at one shape, and the clock64 stamps of thread 0 of each consumer of the
first CTAs summed per transition (turn wait, GEMM issue, waiting for S, softmax, waiting for
P V, the rest of an iteration, epilogue). The dense causal kernel and lowered variants side by
side, at the same tile config (128 x 128, the variants' default), so the phases compare.

    python experiments/timeline.py --n 8192 --systems causal composite sigmoid --out $OUT/timeline.json
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch

from expkit import D, TOKENS, NoArgs, Ours, inline_headers, patched_files, patched_source, versions  # noqa: E402
from cubridge.lower import Launchable  # noqa: E402
from cubridge.runtime.fa3_sm90 import default_config, fa3_forward  # noqa: E402

CTAS, LEN = 4, 4096      # CUIR_TIMELINE_CTAS / CUIR_TIMELINE_LEN of the timeline patch
PATCH = "knobs/timeline"
EVENTS = {1: "tile", 2: "turn_wait", 3: "turn_got", 4: "issued", 5: "scores", 6: "softmax", 7: "pv",
          8: "epilogue", 9: "epilogue_done", 10: "k_ready", 11: "qk_issued", 12: "v_ready"}
# What the time between two marks is (from -> to).
PHASES = {("turn_wait", "turn_got"): "wait for the turn", ("turn_got", "issued"): "issue GEMMs (first tile)",
          ("turn_got", "k_ready"): "wait for K (TMA)", ("k_ready", "qk_issued"): "issue QK wgmma",
          ("qk_issued", "v_ready"): "wait for V (TMA)", ("v_ready", "issued"): "issue P V wgmma",
          ("issued", "scores"): "wait for S (QK)", ("scores", "softmax"): "mask + softmax",
          ("softmax", "pv"): "wait for P V", ("pv", "turn_wait"): "rescale O, convert P",
          ("softmax", "turn_wait"): "convert P (first tile)", ("issued", "epilogue"): "wait for last P V",
          ("epilogue", "epilogue_done"): "epilogue", ("epilogue_done", "scores"): "zero O, wait for S",
          ("tile", "turn_wait"): "tile start", ("epilogue_done", "tile"): "to next tile"}


def with_timeline(buf: torch.Tensor):
    """A source edit: the timeline patch's headers inlined, the buffer's address compiled in."""
    changed = patched_files(PATCH)
    def fn(source: str) -> str:
        return f"#define CUIR_TIMELINE_PTR {buf.data_ptr():#x}ull\n" + inline_headers(source, changed)
    return fn


def run(system: str, n: int) -> dict:
    b, h = max(1, TOKENS // n), 32
    q, k, v = (torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    buf = torch.zeros(CTAS * 3 * LEN, dtype=torch.int64, device="cuda")
    if system == "causal":     # the dense kernel, at the variants' tile so the phases compare
        cfg = default_config(D, True, True, n, variant=True)
        launch = Launchable(with_timeline(buf)(patched_source(PATCH)), NoArgs(0), [])
        fa3_forward(q, k, v, causal=True, config=cfg, variant=launch)
        consumers = cfg.block_m // 64
    else:
        fn = Ours(with_timeline(buf)).fn(system, q, k, v)
        fn()
        consumers = default_config(D, False, True, n, variant=True).block_m // 64
    torch.cuda.synchronize()
    stamps = buf.view(CTAS * 3, LEN)[: CTAS * consumers].cpu().tolist()
    totals, counts, span = defaultdict(int), defaultdict(int), 0
    # Softmax phases ("scores" -> "softmax") of the consumers of one CTA (one SM clock): how much
    # of them runs while another consumer of the same CTA is in its softmax too (ping-pong wants 0).
    overlap = shared = 0
    for cta in range(CTAS):
        phases = []
        for c in range(consumers):
            marks = [(s >> 8, EVENTS.get(s & 0xFF, "?")) for s in stamps[cta * consumers + c] if s]
            phases.append([(t0, t1) for (t0, e0), (t1, e1) in zip(marks, marks[1:])
                           if (e0, e1) == ("scores", "softmax")])
        for c, mine in enumerate(phases):
            others = [iv for o, ivs in enumerate(phases) if o != c for iv in ivs]
            for a0, a1 in mine:
                shared += a1 - a0
                overlap += sum(max(0, min(a1, b1) - max(a0, b0)) for b0, b1 in others)
    for row in stamps:
        marks = [(s >> 8, EVENTS.get(s & 0xFF, "?")) for s in row if s]
        if len(marks) < 2:
            continue
        span += marks[-1][0] - marks[0][0]
        for (t0, e0), (t1, e1) in zip(marks, marks[1:]):
            name = PHASES.get((e0, e1), f"{e0} -> {e1}")
            totals[name] += t1 - t0
            counts[name] += 1
    return {"system": system, "N": n, "span_cycles": span,
            "softmax_overlap": round(overlap / shared, 4) if shared else 0.0,
            "phases": {name: {"cycles": totals[name], "share": round(totals[name] / span, 4) if span else 0.0,
                              "mean": round(totals[name] / counts[name], 1), "count": counts[name]}
                       for name in sorted(totals, key=lambda x: -totals[x])}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--systems", nargs="+", default=["causal", "composite", "sigmoid"])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [run(s, args.n) for s in args.systems]
    names = list(dict.fromkeys(p for r in rows for p in r["phases"]))
    print(f"{'phase (mean cycles / share of the span)':40s}" + "".join(f"{r['system']:>24s}" for r in rows))
    for name in names:
        cells = []
        for r in rows:
            p = r["phases"].get(name)
            cells.append(f"{p['mean']:>12.0f} / {p['share']:5.1%}" if p else f"{'-':>24s}")
        print(f"{name:40s}" + "".join(f"{c:>24s}" for c in cells))
    print(f"{'softmax while another consumer is in its softmax':40s}"
          + "".join(f"{r['softmax_overlap']:>24.1%}" for r in rows))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "date": str(date.today()), "versions": versions(),
            "what": "per-transition clock64 cycles of thread 0 of each consumer warpgroup, first "
                    f"{CTAS} CTAs, one launch; fa3 built with CUIR_TIMELINE_PTR (experiment build); "
                    "the dense causal kernel at the variants' 128 x 128 tile beside lowered variants",
            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
