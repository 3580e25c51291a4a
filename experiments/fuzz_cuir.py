"""Fuzz the verifier with seeded mutants of both reference programs (issue 20, the fuzz bar).

Each mutant (one small edit of fa2_sm80 or fa3_sm90: a constant +-1, a comparison or arithmetic
operator swapped, a statement dropped, min/max swapped, a ring slot shifted, -inf replaced) goes
through what screening does - parse, static check, interpreter verification on the default cases
plus verify.deep_cases at the default tile config - and then, independently, through checks the
screen never saw: two other tile configs of the kernel's search space (deep cases at each), larger
and differently shaped cases, and the non-causal spec with CAUSAL=0. A mutant that passes the screen
and fails only at another tile config is caught by the check every trial's config gets before it
is timed (jobs.verify_at_config: the same deep cases at that config); one that fails at other
shapes or specs is an ESCAPE: the bar is none.

    PYTHONPATH=. python3 experiments/fuzz_cuir.py --n 220 --seed 0 --out experiments/results/fuzz_cuir.json

Runs on CPU (the interpreter); a few minutes per hundred mutants on a free core.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

from cubridge.cuir.checker import check
from cubridge.cuir.parser import parse
from cubridge.errors import CubridgeError
from cubridge.paths import ref_kernel_dir
from cubridge.search.space import SPACES
from cubridge.spec import load_spec
from cubridge.verify import Case, deep_cases, default_cases, verify_program

D = 16          # the interpreter's cost grows with D; tiles, rings and masks do not depend on it
SWAPS = [("<=", "<"), ("<", "<="), (">=", ">"), (">", ">="), ("==", "!="), (" + ", " - "), (" - ", " + "),
         ("min(", "max("), ("max(", "min("), ("maximum(", "minimum("), ("-inf", "0.0"), (" // ", " % ")]


def body_lines(text: str) -> list[int]:
    """Indices of lines a mutant may edit: code after the docstring, not kernel(...) / param(...)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("kernel("))
    return [i for i in range(start + 1, len(lines))
            if lines[i].strip() and not lines[i].startswith(("param(", "kernel(")) and not lines[i].strip().startswith("#")]


def mutate(text: str, rng: random.Random) -> tuple[str, str, int] | None:
    lines = text.splitlines()
    i = rng.choice(body_lines(text))
    ln = lines[i]
    op = rng.choice(["const", "swap", "drop", "slot"])
    if op == "const":
        nums = list(re.finditer(r"(?<![\w.])(\d+)(?![\w.])", ln))
        if not nums:
            return None
        m = rng.choice(nums)
        new = str(max(0, int(m.group(1)) + rng.choice((-1, 1))))
        lines[i] = ln[:m.start()] + new + ln[m.end():]
        what = f"constant {m.group(1)} -> {new}"
    elif op == "swap":
        options = [(a, b) for a, b in SWAPS if a in ln]
        if not options:
            return None
        a, b = rng.choice(options)
        at = rng.choice([m.start() for m in re.finditer(re.escape(a), ln)])
        lines[i] = ln[:at] + b + ln[at + len(a):]
        what = f"{a.strip()} -> {b.strip()}"
    elif op == "drop":
        if ln.rstrip().endswith(":"):
            return None
        del lines[i]
        what = f"dropped: {ln.strip()}"
    else:
        if "[st]" not in ln:
            return None
        lines[i] = ln.replace("[st]", "[(st + 1) % STAGES]", 1)
        what = "slot st -> (st + 1) % STAGES"
    out = "\n".join(lines) + "\n"
    return (out, what, i + 1) if out != text else None


def verdict(prog, spec, params, cases):
    rep = verify_program(prog, spec, params=params, cases=cases)
    bad = rep.first_failure
    return None if bad is None else f"{bad.case}: {(bad.error or bad.verdict.reason).splitlines()[0][:300]}"


def extra_checks(prog, name: str, rng: random.Random) -> list[dict]:
    """What the screen never ran: other tile configs, other shapes, the non-causal spec."""
    space, base = SPACES[name], prog.params()
    out = []
    points = [p for p in space.points(64, space.arches[-1])]
    for pt in rng.sample(points, 2):
        params = space.to_cuir(pt)
        out.append({"check": f"config {params}", "failure": verdict(prog, load_spec("causal"), params,
                                                                  deep_cases({**base, **params}, D))})
    # Nq <= Nk: the spec format refuses more queries than keys (a case with Nq > Nk made every
    # mutant, and the unmutated programs, fail here: see the control in main)
    shapes = [Case(1, 2, 2, 517, 517, D, 21), Case(1, 3, 1, 191, 1000, D, 22), Case(1, 2, 1, 600, 1000, D, 23)]
    out.append({"check": "shapes " + "; ".join(map(str, shapes)),
                "failure": verdict(prog, load_spec("causal"), {}, shapes)})
    out.append({"check": "spec full with CAUSAL=0", "failure": verdict(prog, load_spec("full"), {"CAUSAL": 0},
                                                                      [Case(1, 2, 1, 300, 450, D, 24)])})
    return out


def classify(extra: list[dict]) -> str:
    """A mutant past the screen: wrong only at another tile config is caught before that config is
    timed (jobs.verify_at_config runs the same deep cases there); wrong at other shapes or specs is
    an ESCAPE."""
    bad = [e["check"] for e in extra if e["failure"]]
    if not bad:
        return "verified_everywhere"
    return "caught_by_config_check" if all(b.startswith("config ") for b in bad) else "ESCAPE"


def run_one(name: str, text: str, what: str, line: int, rng: random.Random) -> dict:
    rec = {"reference": name, "mutation": what, "line": line}
    t0 = time.monotonic()
    try:
        prog = parse(text, source=f"<{name} mutant>")
        check(prog, dims={"D": D})
    except CubridgeError as e:
        rec.update(stage="rejected_static", reason=str(e).splitlines()[0][:300])
        return rec
    screen_cases = default_cases(D, quick=True) + deep_cases(prog.params(), D)
    failure = verdict(prog, load_spec("causal"), {}, screen_cases)
    if failure:
        rec.update(stage="rejected_screen", reason=failure)
    else:
        extra = extra_checks(prog, name, rng)
        rec.update(stage=classify(extra), extra=extra)
    rec["seconds"] = round(time.monotonic() - t0, 2)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=220, help="mutants in all (half per reference program)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="experiments/results/fuzz_cuir.json")
    ap.add_argument("--reclassify", action="store_true", help="re-derive the stages of --out's records, run nothing")
    a = ap.parse_args(argv)
    if a.reclassify:
        doc = json.loads(Path(a.out).read_text())
        for r in doc["mutants"]:
            if "extra" in r:
                r["stage"] = classify(r["extra"])
        return write(a, doc["mutants"], final=doc.get("complete", False))
    for name in ("fa2_sm80", "fa3_sm90"):       # control: the unmutated programs pass every check
        prog = parse((ref_kernel_dir(name) / "kernel.cuir").read_text())
        bad = [e for e in extra_checks(prog, name, random.Random(a.seed)) if e["failure"]]
        if bad:
            raise SystemExit(f"the unmutated {name} fails an extra check, so the harness is wrong: {bad[0]}")
    rng = random.Random(a.seed)
    records, seen = [], set()
    for name in ("fa2_sm80", "fa3_sm90"):
        original = (ref_kernel_dir(name) / "kernel.cuir").read_text()
        made = 0
        while made < a.n // 2:
            m = mutate(original, rng)
            if m is None or m[0] in seen:
                continue
            seen.add(m[0])
            made += 1
            rec = run_one(name, *m, rng)
            records.append(rec)
            print(f"{len(records):4d} {name} line {rec['line']:3d} {rec['mutation'][:60]:<60} {rec['stage']}",
                  flush=True)
            if len(records) % 10 == 0:
                write(a, records)        # partial results survive an interrupted run
    return write(a, records, final=True)


def write(a, records, final=False) -> int:
    stages = {}
    for r in records:
        stages[r["stage"]] = stages.get(r["stage"], 0) + 1
    doc = {"seed": a.seed, "n": len(records), "complete": final, "D": D, "stages": stages,
           "escapes": [r for r in records if r["stage"] == "ESCAPE"], "mutants": records}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    if final:
        print(json.dumps(stages))
    return 1 if doc["escapes"] else 0


if __name__ == "__main__":
    sys.exit(main())
