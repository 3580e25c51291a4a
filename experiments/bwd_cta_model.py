"""A list-scheduling model of the Hopper variant backward's grid (issue 17; ref_kernels/fa3_bwd_sm90/NOTES.md
"Session 13 (variant backward)"): each CTA's steps counted on the host (the JSON of
experiments/bwd_visit_counts.py --out: the lowered q_range compiled with g++), CTA time = F + steps x T (session 12's fit to session 10's
TILE_ORDER 0 times: T = 2.6 us, F = 20 us), one CTA per SM on 132 SMs, each CTA starting on the first SM
free in launch order (the hardware's block dispatch). Orders: TILE_ORDER 0 (tile fastest, then head,
batch), TILE_ORDER 2 with sections of S pairs (tile the slow index inside a section: the long tiles of a
section first), all CTAs longest-first, and splitting every tile longer than --split-above into two
CTAs of half its query tiles each (+ --reduce-us for the dK / dV partial-sum reduction). Prints the
makespan (us) per order against the ideal (total work / 132). CPU only.

    PYTHONPATH=. python3 experiments/bwd_visit_counts.py --n 8192 --out visits.json
    python3 experiments/bwd_cta_model.py visits.json [--pairs 32]
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

SMS, F_US, T_US = 132, 20.0, 2.6


def makespan(costs) -> float:
    free = [0.0] * SMS
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def in_sections(steps, pairs, section, cost):
    """Launch order of TILE_ORDER 2 (section = pairs: one section; section = 1: TILE_ORDER 0's order)."""
    out = []
    for s0 in range(0, pairs, section):
        for n in range(len(steps)):
            out += [c for _ in range(min(section, pairs - s0)) for c in cost(steps[n])]
    return out


def orders(steps, pairs, split_above, reduce_us) -> dict[str, float]:
    one = lambda s: [F_US + T_US * s]   # noqa: E731

    def split(s):
        if s <= split_above:
            return one(s)
        return [F_US + reduce_us + T_US * (s - s // 2), F_US + reduce_us + T_US * (s // 2)]
    return {"tile_order_0": makespan(in_sections(steps, pairs, 1, one)),
            "l2lpt_4": makespan(in_sections(steps, pairs, 4, one)),
            "l2lpt_16": makespan(in_sections(steps, pairs, 16, one)),
            "one_section": makespan(in_sections(steps, pairs, pairs, one)),
            "longest_first": makespan(sorted(in_sections(steps, pairs, 1, one), reverse=True)),
            f"split_{split_above}_l2lpt_4": makespan(in_sections(steps, pairs, 4, split)),
            f"split_{split_above}_longest_first": makespan(sorted(in_sections(steps, pairs, 1, split), reverse=True))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("visits", type=Path, help="bwd_visit_counts.py's --out JSON (its cta_steps per variant)")
    ap.add_argument("--pairs", type=int, default=32, help="(batch, kv head) pairs: bench shapes B x H = 16384 / N x 16")
    ap.add_argument("--split-above", type=int, default=64)
    ap.add_argument("--reduce-us", type=float, default=5.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for visit in json.loads(args.visits.read_text()):
        steps = visit["cta_steps"]
        ideal = (sum(steps) * T_US + len(steps) * F_US) * args.pairs / SMS
        r = orders(steps, args.pairs, args.split_above, args.reduce_us)
        rows.append({"variant": visit["variant"], "n": visit["n"], "pairs": args.pairs, "ctas": len(steps) * args.pairs,
                     "ideal_us": round(ideal), "fixed_share": round(len(steps) * F_US * args.pairs / SMS / ideal, 3),
                     **{k: round(v) for k, v in r.items()}})
    keys = [k for k in rows[0] if k not in ("variant", "n", "pairs")]
    print("| variant | N | " + " | ".join(keys) + " |\n|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['variant']} | {r['n']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
