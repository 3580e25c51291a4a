"""What a tuning run leaves in its output directory, and the pure functions that choose it.

    trials.jsonl     every finished trial, appended and fsync'd (survives SIGKILL)
    population.json  the candidates (texts in candidates/<id>.cuir); screen.json their CPU verdicts
    study.db         the Optuna study (SQLite, unless `storage` names another database)
    cache/           the compile cache (cubins by source hash, flags, arch, compiler version)
    kernel/          the chosen kernels' CuIR and CUDA;  cubins/  their cubins (when built)
    spec.py          a copy of the spec (cubridge.load rebuilds extra inputs from it)
    dispatch.json    shape bucket -> config;  manifest.json  versions, hashes, verification, timings
    report.md        table + tflops.png (TFLOPS vs sequence length, ours and baselines)

Example:
    >>> ok = lambda n, a, b: TrialRecord(n, "c", "rules", "fa3_sm90", "x", {},
    ...                                  Outcome(TrialState.OK, times_ms={"a": a, "b": b}))
    >>> [r.number for r in pareto_front([ok(0, 1.0, 3.0), ok(1, 2.0, 2.0), ok(2, 2.5, 2.5)], ["a", "b"])]
    [0, 1]
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from cubridge.vocab import Outcome, TrialRecord, TrialState  # noqa: F401 - Outcome: the doctest uses it

# ------------------------------------------------------------------ the trial log
class TrialLog:
    """Append-only JSON lines; each append is flushed and fsync'd before the study hears of it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._repair()

    def _repair(self) -> None:
        """Drop a line torn by a kill in the middle of a write (only the last can be)."""
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                os.fsync(f.fileno())

    def append(self, record: TrialRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record.to_json(), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[TrialRecord]:
        if not self.path.is_file():
            return []
        out = []
        for i, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if line.strip():
                out.append(_json_line(line, f"{self.path}:{i}"))
        return out


def _json_line(line: str, where: str) -> TrialRecord:
    from cubridge.config import ConfigError
    try:
        return TrialRecord.from_json(json.loads(line))
    except json.JSONDecodeError as e:
        why = e.msg
    except ValueError as e:
        why = str(e)
    raise ConfigError(f"not a trial record of this cubridge version ({why}): the trial log was edited, damaged "
                      "or written by another version", where=where,
                      hint="resume with the cubridge version that wrote it, or delete this line (its trial will "
                           "be run again) and --resume")


def read_json(path: Path, where: str):
    """A JSON artifact a resumed run depends on; a torn or edited one is a located error."""
    from cubridge.config import ConfigError
    try:
        return json.loads(Path(path).read_text(errors="replace"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}): the run directory was edited or "
                          "damaged", where=where, hint="restore it, or start a fresh run with --out DIR") from None


def write_json(path: Path, data) -> None:
    """Atomic: a reader (or a resumed run) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def portable_config(config: dict) -> dict:
    """A config's JSON with no absolute path of this machine: the run directory is relocatable
    (moved or copied to another machine, it loads the same), so it records its output as "." and
    the config file by name only.

    >>> portable_config({"output": "/home/u/out/x", "path": "/home/u/configs/x.yaml", "dtype": "bf16"})
    {'output': '.', 'path': 'x.yaml', 'dtype': 'bf16'}
    """
    out = dict(config)
    if "output" in out:
        out["output"] = "."
    if out.get("path"):
        out["path"] = Path(out["path"]).name
    return out


# ------------------------------------------------------------------ front and dispatch
def _times(rec: TrialRecord, keys) -> list[float] | None:
    t = rec.times_ms
    return [float(t[k]) for k in keys] if rec.state == TrialState.OK and all(k in t for k in keys) else None


def pareto_front(records: list[TrialRecord], keys: list[str]) -> list[TrialRecord]:
    """OK trials no other OK trial beats at every shape (and strictly at one), by trial number."""
    pts = [(r, v) for r in records if (v := _times(r, keys)) is not None]

    def dominated(v):
        return any(all(a <= b for a, b in zip(w, v)) and any(a < b for a, b in zip(w, v)) for _, w in pts)
    return sorted((r for r, v in pts if not dominated(v)), key=lambda r: r.number)


# Within this fraction of a shape's best time, prefer a config already chosen for other shapes:
# fewer distinct kernels to ship and load, for a difference under the run-to-run noise (~8% on
# H100, ref_kernels/fa3_sm90/NOTES.md).
SHARE_TOLERANCE = 0.02


# The final race: per shape, the front trials within RACE_WINDOW of the best search time (at most
# RACE_MAX) are timed again round-robin in one job (cubridge.search.measure.race), and the race
# decides among them: trials timed one by one minutes apart moved 5-15% on H100 (session 5: the
# tuner's 8k pick for composite measured 6% ahead of the default in the search and level with
# it round-robin).
RACE_WINDOW = 0.10
RACE_MAX = 4


def finalists(front: list[TrialRecord], targets) -> dict[str, list[int]]:
    """Shape key -> trial numbers of the race finalists, fastest search time first."""
    out = {}
    for t in targets:
        ranked = sorted(front, key=lambda r: (r.times_ms[t.key], r.number))
        if ranked:
            best = ranked[0].times_ms[t.key]
            out[t.key] = [r.number for r in ranked if r.times_ms[t.key] <= best * (1 + RACE_WINDOW)][:RACE_MAX]
    return out


def choose_dispatch(front: list[TrialRecord], targets, race: dict | None = None) -> list[dict]:
    """Shape bucket -> best front trial. Bucket i covers lengths from the geometric midpoint with
    the previous target length to the one with the next; the first starts at 1, the last is open.
    `race` ({shape key: {trial number (str): ms}}, the final race's times): where a shape was
    raced, only its raced trials compete, by their race times."""
    if not front:
        return []
    race = {k: v for k, v in (race or {}).items() if v}

    def ms(r, key):
        if key in race:
            return race[key].get(str(r.number), math.inf)
        return r.times_ms[key]
    lengths = [t.seqlen for t in targets]
    picks = [min(front, key=lambda r: (ms(r, t.key), r.number)) for t in targets]
    entries = []
    for i, t in enumerate(targets):
        best = ms(picks[i], t.key)
        near = [r for r in front if ms(r, t.key) <= best * (1 + SHARE_TOLERANCE)]
        # votes: how many other shapes picked this trial outright
        rec = max(near, key=lambda r: (sum(p.number == r.number for j, p in enumerate(picks) if j != i),
                                       -ms(r, t.key), -r.number))
        lo = 1 if i == 0 else math.floor(math.sqrt(lengths[i - 1] * lengths[i])) + 1
        hi = None if i == len(targets) - 1 else math.floor(math.sqrt(lengths[i] * lengths[i + 1]))
        entry = {"shape": t.key, "seqlen": t.seqlen, "query_len": t.nq, "batch": t.batch, "min_seqlen": lo, "max_seqlen": hi,
                 "trial": rec.number, "candidate": rec.proposal_id, "origin": rec.origin,
                 "reference": rec.reference, "config": rec.point, "label": rec.label,
                 "time_ms": rec.times_ms[t.key]}
        if t.key in race:
            entry["race_ms"] = race[t.key][str(rec.number)]
        entries.append(entry)
    return entries


def select_bucket(entries: list[dict], seqlen: int) -> dict:
    for e in entries:
        if e["min_seqlen"] <= seqlen and (e["max_seqlen"] is None or seqlen <= e["max_seqlen"]):
            return e
    raise LookupError(f"no bucket holds seqlen {seqlen}")


# ------------------------------------------------------------------ report
def report_rows(targets, dispatch: list[dict], bench: dict) -> list[dict]:
    """Per target: ours (config, ms, TFLOPS) and each baseline, from the side-by-side bench when it
    ran, else ours from the search alone."""
    from cubridge.runtime.timing import tflops        # imports torch: only when a report is written
    by_shape = {e["shape"]: e for e in dispatch}
    rows = []
    for t in targets:
        e, b = by_shape.get(t.key), (bench or {}).get(t.key) or {}
        flops = b.get("flops")
        ours_ms = b.get("ours_ms") or (e or {}).get("time_ms")
        row = {"shape": t.key, "seqlen": t.seqlen, "batch": t.batch, "label": (e or {}).get("label", "-"),
               "ours_ms": ours_ms, "ours_tflops": tflops(flops, ours_ms) if flops else None,
               "baselines": {k: {"ms": ms, "tflops": tflops(flops, ms) if flops else None}
                             for k, ms in (b.get("baselines_ms") or {}).items()},
               "notes": {**(b.get("baseline_errors") or {}),
                         **({"ours": f"{b['ours_error']} (time from the search trial)"} if "ours_error" in b else {})}}
        rows.append(row)
    return rows


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def render_report(title: str, status: str, rows: list[dict], sections: list[tuple[str, str]], plot_note: str) -> str:
    names = sorted({k for r in rows for k in r["baselines"]})
    head = ["N", "B", "config", "ours ms", "ours TFLOPS"] + [f"{n} TFLOPS" for n in names] + ["vs best baseline"]
    lines = [f"# {title}", "", status, "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        base = [r["baselines"].get(n, {}).get("tflops") for n in names]
        best = max((b for b in base if b), default=None)
        ratio = f"{r['ours_tflops'] / best:.2f}x" if best and r["ours_tflops"] else "-"
        cells = [str(r["seqlen"]), str(r["batch"]), r["label"], _fmt(r["ours_ms"], ".3f"), _fmt(r["ours_tflops"])]
        lines.append("| " + " | ".join(cells + [_fmt(b) for b in base] + [ratio]) + " |")
    grouped: dict = {}
    for r in rows:
        for k, v in r["notes"].items():
            grouped.setdefault((k, v), []).append(str(r["seqlen"]))
    if grouped:
        lines += ["", "Not timed:"] + [f"- {k} at N = {', '.join(ns)}: {v}" for (k, v), ns in grouped.items()]
    lines += ["", plot_note, ""]
    for heading, body in sections:
        lines += [f"## {heading}", "", body, ""]
    return "\n".join(lines)


def plot_tflops(rows: list[dict], path: Path, title: str) -> str:
    """TFLOPS vs sequence length, ours and each baseline; returns the line report.md shows."""
    if not any(r["ours_tflops"] for r in rows):
        return "No plot: nothing was timed on a GPU in this run."
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not installed (pip install -e '.[plot]' adds it)."
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r["seqlen"] for r in rows]
    ax.plot(xs, [r["ours_tflops"] for r in rows], marker="o", linewidth=2, label="cubridge (ours)")
    for name in sorted({k for r in rows for k in r["baselines"]}):
        ax.plot(xs, [r["baselines"].get(name, {}).get("tflops") for r in rows], marker=".", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOPS (attended pairs only)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"![TFLOPS vs sequence length]({Path(path).name})"
