"""Per-SASS-instruction warp-stall samples from `ncu -i REP --page source --csv --print-source sass`
(SourceCounters), reduced to what a person reads: each instruction's phase of the backward step and
the kernel's top stalled PCs. Used by experiments/ncu_stalls.py; tests/cpu/test_sass_stalls.py
checks it on a hand-made page.

The page's rows are the kernel's SASS in address order with columns Address, Source (the
instruction), "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)" (in
newer ncu), "Instructions Executed" and one stall_<reason> column each (the layout session 8's
composite_sass_top200.csv shows). A phase comes from the instruction itself and the landmarks before
it (the last HGMMA group, barrier, mbarrier wait): the samples of a warp parked on an mbarrier are
taken on its try-wait / retry branch, those of a warpgroup waiting for its wgmma on the
WARPGROUP.DEPBAR (or the first instruction reading the result), of a named barrier on BAR.
"""
from __future__ import annotations

import csv
import io

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_page(text: str) -> list[dict]:
    """The rows of a source page (CSV); lines before the header (ncu's ==PROF== notes) skipped.
    Raises ValueError naming what is missing when the page has no instruction rows."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(('"Address"', "Address,"))), None)
    if start is None:
        raise ValueError("no 'Address,Source,...' header in the source page: was SourceCounters collected "
                         "and --print-source sass given?")
    rows = []
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not r.get("Source") or r.get("Address", "").startswith("Address"):
            continue
        rows.append({"address": r["Address"], "sass": " ".join(r["Source"].split()),
                     "samples": _num(r.get(SAMPLES)), "executed": _num(r.get(EXECUTED)),
                     "stalls": {k[len("stall_"):]: _num(v) for k, v in r.items()
                                if k and k.startswith("stall_") and "Not Issued" not in k and _num(v)}})
    if not rows:
        raise ValueError("the source page has a header but no instruction rows")
    return rows


def _num(x) -> int:
    try:
        return int(float(str(x).replace(",", "")))
    except ValueError:
        return 0


def opcode(sass: str) -> str:
    """'@!P0 BRA 0x..' -> 'BRA'; 'HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], ...' -> 'HGMMA.64x64x16.F32.BF16'."""
    words = sass.replace(";", "").split()
    while words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def _landmark(op: str) -> str | None:
    if op.startswith("HGMMA"):
        return "hgmma"
    if op.startswith("SYNCS") and ("TRYWAIT" in op or "PHASECHK" in op):
        return "mbar_wait"
    if op.startswith("SYNCS.ARRIVE"):
        return "mbar_arrive"
    if op.startswith(("BAR.SYNC", "BAR.RED", "BAR.ARV")):
        return "bar"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "wgmma_wait"
    if op.startswith(("UBLKRED", "UBLKCP", "UTMASTG", "UTMAREDG", "UBLKPF")):
        return "bulk"
    if op.startswith("MUFU.EX2"):
        return "exp2"
    if op.startswith("STSM"):
        return "stsm"
    if op.startswith(("EXIT", "RET")):
        return "exit"
    return None


def phase_of(op: str, recent: list[str]) -> str:
    """The step phase of an instruction, from its opcode and the landmarks seen before it (newest
    last). The labels are the brief's: S/dP wait, P pass, dS pass, ds_ready / named barrier, dQ
    store / bulk wait, q_full (mbarrier) wait, epilogue, other."""
    own = _landmark(op)
    last = recent[-1] if recent else None
    if own == "mbar_wait" or (op == "BRA" and last == "mbar_wait"):
        return "mbarrier wait (q_full / kv_full / q_empty / dQ handoff)"
    if own == "bar":
        return "named barrier (ds_ready / wg sync / dQ handoff)"
    if own == "wgmma_wait":
        return "wgmma wait (S/dP or dV/dK/dQ result)"
    if own == "hgmma":
        return "HGMMA issue"
    if own == "bulk" or op.startswith("DEPBAR"):
        return "bulk copy / reduce / wait_group"
    if own == "exp2" or (last == "exp2" and op.startswith(("FFMA", "FMUL", "FADD", "F2FP", "FSEL", "FMNMX"))):
        return "P pass (exp2)"
    if own == "stsm" or op.startswith("STS"):
        return "shared store (dS^T / dQ slot / epilogue)"
    if op.startswith(("STG", "REDG", "RED.")) or "exit" in recent[-2:]:
        return "epilogue / global store"
    if last == "wgmma_wait" and op.startswith(("FFMA", "FMUL", "FADD", "F2FP", "FSEL", "FMNMX", "FSETP")):
        return "after a wgmma wait (first use of its result)"
    if op.startswith(("LDS", "LDSM")):
        return "shared load (LSE / Dvec / dQ)"
    return "other"


def annotate(rows: list[dict], phase_fn=None) -> list[dict]:
    """Adds 'phase', 'index' (position in the SASS) and 'context' (the last four landmarks before the
    instruction, newest last, with the HGMMA run lengths) to every row. phase_fn(op, recent, sass):
    another kernel's phases (expkit.sass_stalls_fwd.phase_of for the forward); default the backward's."""
    recent: list[str] = []
    trail: list[str] = []
    for i, r in enumerate(rows):
        op = opcode(r["sass"])
        r["index"] = i
        r["opcode"] = op
        r["phase"] = phase_fn(op, recent, r["sass"]) if phase_fn else phase_of(op, recent)
        r["context"] = " > ".join(trail[-4:])
        mark = _landmark(op)
        if mark:
            recent = (recent + [mark])[-3:]
            if mark == "hgmma" and trail and trail[-1].startswith("HGMMA x"):
                trail[-1] = f"HGMMA x{int(trail[-1][7:]) + 1}"
            else:
                trail = (trail + ["HGMMA x1" if mark == "hgmma" else op])[-8:]
    return rows


def summarize(rows: list[dict], top: int = 12, phase_fn=None, annotated: bool = False) -> dict:
    """The kernel's totals (samples per stall reason and per phase) and its `top` most-sampled PCs."""
    rows = rows if annotated else annotate(rows, phase_fn)   # annotated: phases already set
    total = sum(r["samples"] for r in rows) or 1
    reasons: dict[str, int] = {}
    phases: dict[str, int] = {}
    for r in rows:
        phases[r["phase"]] = phases.get(r["phase"], 0) + r["samples"]
        for k, v in r["stalls"].items():
            reasons[k] = reasons.get(k, 0) + v
    best = sorted(rows, key=lambda r: -r["samples"])[:top]
    return {"samples": total, "instructions": len(rows),
            "hgmma": sum(1 for r in rows if r["opcode"].startswith("HGMMA")),
            "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
            "phases": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
            "top": [{"index": r["index"], "sass": r["sass"][:90], "phase": r["phase"], "context": r["context"],
                     "samples": r["samples"], "share": round(r["samples"] / total, 4), "executed": r["executed"],
                     "stalls": dict(sorted(r["stalls"].items(), key=lambda kv: -kv[1])[:3])} for r in best]}


def table(name: str, s: dict, top: int = 8) -> str:
    """A short text table of one kernel's summary."""
    out = [f"== {name}: {s['samples']} samples, {s['instructions']} SASS, {s['hgmma']} HGMMA",
           "   phases: " + ", ".join(f"{k} {v / s['samples']:.0%}" for k, v in list(s["phases"].items())[:6]),
           "   reasons: " + ", ".join(f"{k} {v / s['samples']:.0%}" for k, v in list(s["reasons"].items())[:6])]
    for t in s["top"][:top]:
        why = "/".join(f"{k}:{v}" for k, v in t["stalls"].items())
        out.append(f"   {t['share']:6.1%} #{t['index']:<5} {t['sass'][:48]:<48} {t['phase'][:34]:<34} {why}")
        out.append(f"          after: {t['context'][-90:]}")
    return "\n".join(out)


# ncu's raw page (--page raw --csv --print-units base): the whole-kernel numbers the stall tables print
RAW_KEEP = ("gpu__time_duration.sum", "smsp__average_warp_latency_per_inst_issued.ratio",
            "smsp__issue_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
            "launch__grid_size", "launch__block_size")


def raw_metrics(text: str) -> dict:
    """A few whole-kernel numbers (duration, issue rate, registers, grid) and every
    smsp__average_warps_issue_stalled_*_per_issue_active ratio from the raw page."""
    rows = list(csv.reader(io.StringIO(text[text.find('"ID"'):] if '"ID"' in text else text)))
    if len(rows) < 3:
        return {}
    head, row = rows[0], rows[2]
    got = {}
    for h, v in zip(head, row):
        if h in RAW_KEEP or (h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("per_issue_active.ratio")):
            try:
                got[h] = float(v.replace(",", ""))
            except ValueError:
                got[h] = v
        elif h == "Kernel Name":
            got["kernel"] = v[:120]
    return got
