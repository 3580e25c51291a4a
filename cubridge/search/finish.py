"""The end of a tuning run: compile-only pass (no GPU), side-by-side bench, and every artifact.

Split from tuner.py, which owns the loop; the formats and the pure choices live in artifacts.py.
Whatever happened (tuned, screened only, nothing verified, no trial timed), the output directory
gets a manifest and a report.md that say so.
"""
from __future__ import annotations

import hashlib
import logging
import platform
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cubridge.search import artifacts
from cubridge.vocab import Job, TrialState
from cubridge.search.space import SPACES


def compile_population(cfg, verified, runner, say) -> dict:
    """Lower and compile each verified candidate at its first measured-default config (no GPU needed)."""
    from cubridge.search.messages import payload, run_jobs
    jobs, labels = [], {}
    for c in verified:
        space = SPACES[c.reference]
        valid = [p for p in space.best_known(cfg.shapes.head_dim) if not space.problems(p, cfg.shapes.head_dim, cfg.arch)]
        point = (valid or space.points(cfg.shapes.head_dim, cfg.arch))[0]
        labels[c.id] = space.label(point)
        jobs.append(Job("compile", payload(cfg, c, point), cfg.runner.timeout_s, needs_gpu=False))
    say(f"compiling {len(jobs)} verified candidate(s) at one config each")
    done = run_jobs(runner, jobs)
    out = {}
    for cid, res in done.items():
        out[cid] = {"config": labels[cid], **res.outcome.to_json()}
        state = "compiled" if res.outcome.state == TrialState.VERIFIED else res.outcome.state.value
        say(f"  {cid} {labels[cid]}: {state}: {res.outcome.reason.splitlines()[0] if res.outcome.reason else ''}")
    return out


def _bench(cfg, pop, dispatch, runner, say) -> dict:
    from cubridge.search.messages import payload, run_jobs
    by_id = {c.id: c for c in pop}
    entries = [{**payload(cfg, by_id[e["candidate"]], e["config"]),
                "shape": {"key": e["shape"], "batch": e["batch"], "seqlen": e["seqlen"],
                          "query_len": e.get("query_len", e["seqlen"])}} for e in dispatch]
    body = {**payload(cfg, by_id[dispatch[0]["candidate"]]), "candidate": "bench", "entries": entries}
    say(f"timing the chosen kernel(s) beside the baselines at {len(entries)} shape(s)")
    res = run_jobs(runner, [Job("bench", body, 2 * cfg.runner.timeout_s, needs_gpu=True)])["bench"]
    if res.outcome.state != TrialState.OK:
        say(f"side-by-side bench: {res.outcome.state.value}: {_first(res.outcome.reason)}")
    return {"outcome": res.outcome.to_json(), **res.data}


def _race(cfg, pop, front, runner, say) -> dict:
    """The final race (artifacts.finalists): one GPU job times each shape's finalists round-robin.
    {} where no shape has two finalists; on failure the search's own times decide (said here and
    in the report)."""
    from cubridge.search.messages import payload, run_jobs
    by_shape = artifacts.finalists(front, cfg.shapes.targets)
    raced = [k for k, v in by_shape.items() if len(v) >= 2]
    if not raced:
        return {}
    by_id, by_num = {c.id: c for c in pop}, {r.number: r for r in front}
    nums = sorted({n for k in raced for n in by_shape[k]})
    fin = {str(n): payload(cfg, by_id[by_num[n].proposal_id], by_num[n].point) for n in nums}
    body = {**payload(cfg, by_id[by_num[nums[0]].proposal_id]), "candidate": "race", "finalists": fin,
               "by_shape": {k: by_shape[k] for k in raced}}
    say(f"final race: {len(nums)} finalist config(s) timed round-robin at {len(raced)} shape(s)")
    res = run_jobs(runner, [Job("race", body, 2 * cfg.runner.timeout_s, needs_gpu=True)])["race"]
    if res.outcome.state != TrialState.OK:
        say(f"final race: {res.outcome.state.value}: {_first(res.outcome.reason)}; the search's own times decide")
        return {"outcome": res.outcome.to_json(), "by_shape": by_shape, "shapes": {}}
    return {"outcome": res.outcome.to_json(), "by_shape": by_shape, **res.data}


@dataclass
class RunSummary:
    """Everything the end of a run writes (manifest.json, report.md, dispatch.json) in one place:
    what was screened, measured, raced, chosen and benched, and how the run ended. The tuner
    fills the first fields (up to `notes`); finish_run the rest."""
    cfg: object                       # TuneConfig
    out: Path
    pop: list                         # Candidate
    verdicts: dict                    # candidate id -> Outcome of its screening
    records: list = field(default_factory=list)     # TrialRecord (trials.jsonl)
    compiled: dict = field(default_factory=dict)    # compile-only pass (no GPU): candidate id -> result
    status: str | None = None         # None until decided: tuned / no_trial_ok from the records
    message: str = ""
    stop_reason: str = ""
    notes: tuple = ()                 # proposers that proposed nothing, and why
    front: list = field(default_factory=list)       # the Pareto front's records
    race: dict = field(default_factory=dict)
    dispatch: list = field(default_factory=list)
    bench: dict = field(default_factory=dict)
    backward: dict = field(default_factory=dict)    # backward tuning (search/backward.py), when asked for
    rows: list = field(default_factory=list)        # report rows: ours beside the baselines per shape
    device: dict | None = None
    files: dict = field(default_factory=dict)       # (candidate, label) -> written kernel files


def finish_run(run: RunSummary, *, runner, say=None):
    """Choose (front, race, dispatch, bench), write every artifact of `run`, return its TuneResult."""
    from cubridge.search.messages import TuneResult
    say = say or logging.getLogger("cubridge.tune").info
    cfg, out = run.cfg, run.out
    run.records = sorted(run.records, key=lambda r: r.number)
    _choose(run, runner, say)
    run.files = _write_kernels(run)
    run.rows = artifacts.report_rows(cfg.shapes.targets, run.dispatch, run.bench.get("shapes") or {})
    run.device = run.bench.get("device") or next((r.device for r in run.records if r.device), None) \
        or getattr(runner, "device", None) or None
    if run.dispatch:
        artifacts.write_json(out / "dispatch.json", _dispatch_doc(cfg, run.dispatch, run.files))
    manifest = _manifest(run)
    manifest["trials"]["log"] = "trials.jsonl" if (out / "trials.jsonl").is_file() else None
    manifest["race"] = run.race or None
    manifest["backward"] = run.backward or None
    manifest["proposer_notes"] = list(run.notes)
    artifacts.write_json(out / "manifest.json", manifest)
    plot_note = artifacts.plot_tflops(run.rows, out / "tflops.png", f"{cfg.name} ({cfg.dtype}, D={cfg.shapes.head_dim})")
    report = _report(run, plot_note)
    if run.notes:
        report += "\n## Proposers\n\n" + "\n".join(f"- {n}" for n in run.notes) + "\n"
    (out / "report.md").write_text(report)
    say(f"{run.message}\nreport: {out / 'report.md'}")
    return TuneResult(run.status, run.message, out, run.dispatch, list(run.records))


def _choose(run: RunSummary, runner, say) -> None:
    """Front, race, dispatch table and bench of a run that searched; its status and message."""
    cfg, records = run.cfg, run.records
    targets = cfg.shapes.targets
    run.front = artifacts.pareto_front(records, [t.key for t in targets])
    run.race = _race(cfg, run.pop, run.front, runner, say) if run.status is None and run.front else {}
    run.dispatch = artifacts.choose_dispatch(run.front, targets, run.race.get("shapes"))
    if run.status is not None:
        return
    if run.dispatch:
        run.bench = _bench(cfg, run.pop, run.dispatch, runner, say)
        if cfg.backward:
            from cubridge.search import backward
            cand = next(c for c in run.pop if c.id == run.dispatch[0]["candidate"])
            run.backward = backward.tune(cfg, cand, runner, say)
            backward.choose(run.backward, run.dispatch)
        measured = sum(r.state != TrialState.CONFIG_INVALID for r in records)
        run.status, run.message = "tuned", (f"tuned: {measured} trials measured ({len(records) - measured} invalid "
                                            f"configs skipped unbuilt), {len(run.front)} on the Pareto front")
    else:
        run.status, run.message = "no_trial_ok", "no trial was timed successfully (see the failures in report.md)"


def _first(text: str, n: int = 300) -> str:
    return (text.splitlines() or [""])[0][:n]


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _write_kernels(run: RunSummary) -> dict:
    """CuIR of every verified candidate, CUDA and cubins of the dispatch entries (where built),
    and a copy of the spec; returns paths relative to the output by (candidate, label)."""
    from cubridge.runtime.build import portable_options, resolve_cache_dir
    from cubridge.search.building import lower_kernel
    from cubridge.search.messages import kernel_job
    from cubridge.spec import load_spec
    cfg, out, pop, verdicts = run.cfg, run.out, run.pop, run.verdicts
    spec = load_spec(cfg.spec)
    if Path(spec.path).is_file():
        shutil.copyfile(spec.path, out / "spec.py")
    kdir, cdir = out / "kernel", out / "cubins"
    kdir.mkdir(exist_ok=True)
    for c in pop:
        if verdicts[c.id].state == TrialState.VERIFIED:
            (kdir / f"{c.id}.cuir").write_text(c.proposal.text)
    by_id, by_num = {c.id: c for c in pop}, {r.number: r for r in run.records}
    files = {}
    for e in run.dispatch:
        name = f"{e['candidate']}_{e['label']}"
        entry = {"cuir": f"kernel/{e['candidate']}.cuir", "cuda": None, "cubin": None}
        try:
            lowered, options = lower_kernel(kernel_job(cfg, by_id[e["candidate"]], e["config"]))
            entry["nvcc_options"] = portable_options(options)
            (kdir / f"{name}.cu").write_text(lowered.source)
            entry["cuda"] = f"kernel/{name}.cu"
        except Exception as ex:   # noqa: BLE001 - the artifact says what is missing
            entry["cuda_error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        key = by_num[e["trial"]].cubin_key
        cached = resolve_cache_dir() / f"{key}.cubin" if key else None      # the workers' compile cache
        if cached is not None and cached.is_file():
            cdir.mkdir(exist_ok=True)
            shutil.copyfile(cached, cdir / f"{name}.cubin")
            entry["cubin"] = f"cubins/{name}.cubin"
        files[(e["candidate"], e["label"])] = entry
    return files


def _dispatch_doc(cfg, dispatch, files) -> dict:
    s = cfg.shapes
    return {"arch": cfg.arch, "dtype": cfg.dtype, "head_dim": s.head_dim, "heads_q": s.heads_q, "heads_kv": s.heads_kv,
            "spec": "spec.py", "spec_name": cfg.spec if "/" not in cfg.spec else Path(cfg.spec).stem,
            "spec_params": cfg.spec_params,
            "buckets": [{**e, **files.get((e["candidate"], e["label"]), {})} for e in dispatch]}


def _versions() -> dict:
    import optuna
    import torch
    from cubridge.version import __version__
    v = {"cubridge": __version__, "python": platform.python_version(), "torch": torch.__version__,
         "optuna": optuna.__version__, "cuda_runtime_of_torch": torch.version.cuda}
    try:
        from cubridge.runtime.build import compiler_version
        v["nvcc"] = compiler_version("nvcc")
    except Exception as e:   # noqa: BLE001 - informative only
        v["nvcc"] = f"not available ({str(e).splitlines()[0]})"
    from cubridge.runtime.build import available_compiler, compiler_version
    if available_compiler() == "nvrtc":      # no nvcc: the compile jobs build with NVRTC
        v["nvrtc"] = compiler_version("nvrtc")
    return v


def _manifest(run: RunSummary) -> dict:
    cfg, pop, verdicts, records, dispatch, files = run.cfg, run.pop, run.verdicts, run.records, run.dispatch, run.files
    from cubridge.runtime.kernels import reference_kernel
    from cubridge.spec import load_spec
    spec = load_spec(cfg.spec)
    dirs = {r: reference_kernel(r).directory for r in cfg.references}
    refs = {r: {f: _sha((d / f).read_bytes()) for f in ("kernel.cu", "kernel.cuir") if (d / f).is_file()}
            for r, d in dirs.items()}
    return {"status": run.status, "message": run.message, "name": cfg.name, "search_key": cfg.search_key,
            "config": artifacts.portable_config(cfg.to_json()), "spec": {"name": spec.name, "source": Path(cfg.spec).name, "sha256": _sha(spec.source)},
            "references": refs, "host": _versions(), "device": run.device,
            "candidates": [{"id": c.id, "reference": c.reference, "origin": c.proposal.origin,
                            "notes": list(c.proposal.notes), **verdicts[c.id].to_json()} for c in pop],
            "compile": run.compiled,
            "gpu_checks": {str(e["trial"]): next((r.gpu_check for r in records if r.number == e["trial"]), None)
                           for e in dispatch},
            "trials": {"total": len(records), "by_state": dict(Counter(r.state.value for r in records)),
                       "pareto": [r.number for r in run.front], "stop_reason": run.stop_reason,
                       "log": "trials.jsonl"},
            "dispatch": "dispatch.json" if run.front else None,
            "timings": {"protocol": "CUDA events, warm-up, median, L2 flushed; ours and baselines in one job",
                        "bench_outcome": run.bench.get("outcome"), "rows": run.rows},
            "kernels": {f"{c}_{lab}": v for (c, lab), v in files.items()}}


def _race_section(race: dict, records, dispatch) -> str:
    by_num = {r.number: r for r in records}
    chosen = {e["shape"]: e["trial"] for e in dispatch}
    lines = [f"Each shape's finalists (front trials within {artifacts.RACE_WINDOW:.0%} of its best search time, at "
             f"most {artifacts.RACE_MAX}) timed again round-robin in one job; the race decides among them."]
    outcome = race.get("outcome") or {}
    if outcome.get("state") not in (None, TrialState.OK.value):
        lines.append(f"The race did not run ({outcome.get('state')}: {_first(outcome.get('reason') or '', 200)}); "
                     "the search's own times decided.")
    lines += ["", "| shape | trial | config | search ms | race ms | chosen |", "| --- | --- | --- | --- | --- | --- |"]
    for key, nums in (race.get("by_shape") or {}).items():
        times = (race.get("shapes") or {}).get(key, {})
        errs = (race.get("errors") or {}).get(key, {})
        for n in nums:
            r = by_num.get(n)
            rt = times.get(str(n))
            cell = f"{rt:.3f}" if rt is not None else (_first(errs.get(str(n), "-"), 80))
            lines.append(f"| {key} | #{n} | {r.label if r else '?'} | "
                         f"{r.times_ms.get(key, float('nan')) if r else float('nan'):.3f} | {cell} | "
                         f"{'yes' if chosen.get(key) == n else ''} |")
    return "\n".join(lines)


STATUS_LINES = {
    "tuned": "Tuned on a GPU; the numbers below come from one job that timed ours and the baselines side by side.",
    "screened": "Dry run: the population was screened on CPU (and compiled where nvcc and lowering exist); "
                "nothing was timed.",
    "no_gpu": "**Timing needs a GPU.** The population was screened on CPU (and compiled where possible); nothing was timed.",
    "nothing_verified": "**No candidate passed the CPU stages**, so nothing was compiled or timed.",
    "no_trial_ok": "**No trial was timed successfully**; the failures are listed below.",
}


def _report(run: RunSummary, plot_note: str) -> str:
    cfg, out, pop, verdicts, records, dispatch = run.cfg, run.out, run.pop, run.verdicts, run.records, run.dispatch
    status, device, race, front = run.status, run.device, run.race, run.front
    title = f"cubridge-tune {cfg.name}: spec {Path(cfg.spec).stem}, {', '.join(cfg.references)} -> {cfg.arch} {cfg.dtype}"
    dev = f"Device: {device.get('name', device)}." if isinstance(device, dict) and device else "Device: none (CPU only)."
    status_line = f"{STATUS_LINES.get(status, status)} {run.message}. {dev}"
    cands = ["| candidate | reference | origin | CPU verdict | reason |", "| --- | --- | --- | --- | --- |"]
    for c in pop:
        v = verdicts[c.id]
        cands.append(f"| {c.id} | {c.reference} | {c.proposal.origin} | {v.state.value} | "
                     f"{(v.reason.splitlines() or [''])[0][:120]} |")
    for cid, comp in run.compiled.items():
        cands.append(f"| {cid} | compile {comp['config']} | | {comp['state']} | {_first(comp['reason'], 160)} |")
    states = Counter(r.state.value for r in records)
    reasons = Counter((r.state.value, (r.outcome.reason.splitlines() or [""])[0][:140])
                      for r in records if r.state.failed)
    search = [f"{len(records)} trials ({', '.join(f'{k} {v}' for k, v in sorted(states.items())) or 'none'}); "
              f"Pareto front: {', '.join('#' + str(r.number) for r in front) or 'empty'}."
              + (f" Stopped: {run.stop_reason}." if run.stop_reason else "")]
    search += [f"- {n} x {s}: {why}" for (s, why), n in reasons.most_common(8)]
    raced = any("race_ms" in e for e in dispatch)
    table = ["| N from | N to | config | candidate | trial | search time (ms) |" + (" race time (ms) |" if raced else ""),
             "| --- | --- | --- | --- | --- | --- |" + (" --- |" if raced else "")]
    table += [f"| {e['min_seqlen']} | {e['max_seqlen'] or 'any'} | {e['label']} | {e['candidate']} | #{e['trial']} | "
              f"{e['time_ms']:.3f} |" + (f" {e['race_ms']:.3f} |" if "race_ms" in e else (" - |" if raced else ""))
              for e in dispatch]
    sections = [("Candidates", "\n".join(cands)), ("Search", "\n".join(search))]
    if race:
        sections.append(("Final race", _race_section(race, records, dispatch)))
    if dispatch:
        sections.append(("Dispatch table (dispatch.json)", "\n".join(table)))
    if run.backward:
        from cubridge.search import backward
        sections.append(("Backward", backward.report_section(run.backward, dispatch)))
    # Only a tuned run has a kernel to load; after a dry run, without a GPU or after failures the
    # report must not promise one.
    load = ("`cubridge.load(\"" + str(out) + "\")` runs the tuned kernel." if status == "tuned" and dispatch
            else f"there is no tuned kernel to load ({status}).")
    sections.append(("Reproduce", f"`cubridge-tune {cfg.path} --out {out} --resume` continues this run; {load}"))
    return artifacts.render_report(title, status_line, run.rows, sections, plot_note)
