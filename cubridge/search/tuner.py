"""`cubridge-tune`: the ask-and-tell loop from a validated config to an artifact directory.

    proposers --ask--> population --screen jobs (CPU, once per candidate, cached)--> verified
    Optuna (TPE, one objective per target shape, warm-started with the kernels' measured
    defaults) --ask--> (candidate, tile config) --constraints--> measure job on a Runner
    (lower -> compile -> GPU check -> time) --tell--> study + trials.jsonl
    Pareto front -> dispatch table -> bench job (ours beside the baselines) -> artifacts

Failures are trial states: CONFIG_INVALID (pruned in Optuna, never compiled), COMPILE_ERROR,
WRONG_ANSWER, CRASH, TIMEOUT (failed in Optuna); each keeps its reason in trials.jsonl and in the
trial's user_attrs. Without a GPU (or with dry_run) the population is screened and, where nvcc
exists, compiled at one config each, and the run says plainly that timing needs a GPU.

Example:
    >>> from cubridge.config import load_config
    >>> result = tune(load_config("configs/h100_prefixlm.yaml"), dry_run=True)   # doctest: +SKIP
    >>> result.status                                                             # doctest: +SKIP
    'screened'
"""
from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

from cubridge.config import ConfigError, TuneConfig
from cubridge.runtime.build import available_compiler
from cubridge.search import artifacts
from cubridge.vocab import CUIR_TYPE, Job, Outcome, Proposal, TrialRecord, TrialState
from cubridge.search.messages import Candidate, TuneResult, payload, proposer_options, run_jobs
from cubridge.search.space import SPACES

LOG = logging.getLogger("cubridge.tune")
PROPOSAL_ROUNDS = 3        # ask -> screen -> tell rounds: an LLM proposer repairs its rejects
MAX_IDLE_ASKS = 200        # consecutive asks that measure nothing (duplicates, invalid) before stopping


# ------------------------------------------------------------------ output directory
def prepare_output(cfg: TuneConfig, resume: bool) -> Path:
    out = cfg.output
    run = out / "run.json"
    if run.is_file() and (out / "population.json").is_file():      # a run that did some work
        prev = artifacts.read_json(run, where=f"{cfg.path}: output")
        if not resume:
            raise ConfigError(f"{out} already holds a run ({prev.get('name')})", where=f"{cfg.path}: output",
                              hint="pass --resume to continue it, or --out DIR for a fresh one")
        if prev.get("search_key") != cfg.search_key:
            raise ConfigError(f"{out} holds a run of a different search (spec, references, shapes, dtype, arch "
                              "or objectives changed)", where=f"{cfg.path}: output",
                              hint="resume with the config it was started with, or use --out DIR")
        artifacts.TrialLog(out / "trials.jsonl").read()     # a damaged log refuses the resume before any work
    out.mkdir(parents=True, exist_ok=True)
    artifacts.write_json(run, {"name": cfg.name, "search_key": cfg.search_key,
                              "config": artifacts.portable_config(cfg.to_json())})
    return out


# ------------------------------------------------------------------ population and screening
def load_population(out: Path) -> list[Candidate]:
    path = out / "population.json"
    if not path.is_file():
        return []
    return [Candidate(Proposal((out / "candidates" / f"{c['id']}.cuir").read_text(), c["origin"], c["attempt"],
                               c["parent"], tuple(c["notes"]), c.get("binding")), c["reference"])
            for c in artifacts.read_json(path, where="--resume")]


def _save_population(out: Path, pop: list[Candidate]) -> None:
    for c in pop:
        p = out / "candidates" / f"{c.id}.cuir"
        if not p.is_file():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(c.proposal.text)
    artifacts.write_json(out / "population.json", [
        {"id": c.id, "origin": c.proposal.origin, "attempt": c.proposal.attempt, "parent": c.proposal.parent,
         "notes": list(c.proposal.notes), "reference": c.reference, "binding": c.proposal.binding} for c in pop])


def build_population(cfg: TuneConfig, runner, out: Path, *, quick: bool, say) -> tuple[list, dict, list]:
    """Ask every reference's proposer, screen, tell, repeat (bounded); candidates and verdicts
    persist in the output directory, so a resumed run screens nothing twice. Returns the
    population, its verdicts, and notes on proposers that proposed nothing."""
    from cubridge.registry import make_proposer
    from cubridge.search.screen import ScreenContext
    pop = load_population(out)
    verdicts = {k: Outcome.from_json(v) for k, v in _read(out / "screen.json", {}).items()}
    proposers, notes = {}, []
    # An LLM population also holds the rules transfer where the spec's hooks trace: the model's
    # candidates compete with it rather than replace it.
    kinds = [cfg.proposer.kind] + (["rules"] if cfg.proposer.kind in ("vllm", "openai") else [])
    if not pop:
        for ref in cfg.references:
            ctx = ScreenContext.build(ref, cfg.spec, spec_params=cfg.spec_params, quick=True,
                                      head_dims=(cfg.shapes.head_dim,))
            for kind in kinds:
                options = proposer_options(cfg, out) if kind == cfg.proposer.kind else {}
                proposers[(ref, kind)] = make_proposer(kind, ctx, options)
    for round_ in range(PROPOSAL_ROUNDS if proposers else 1):
        for (ref, kind), prop in proposers.items():
            verified = sum(c.reference == ref and c.id in verdicts and verdicts[c.id].state == TrialState.VERIFIED
                           for c in pop)
            asked = prop.ask(cfg.proposer.population - verified) if verified < cfg.proposer.population else []
            if round_ == 0 and not asked:
                notes.append(f"{kind} proposer for {ref}: no proposal "
                             f"({getattr(prop, 'error', None) or 'nothing to propose'})")
                say(notes[-1])
            pop += [Candidate(p, ref) for p in asked if p.id not in {c.id for c in pop}]
        _save_population(out, pop)
        todo = [c for c in pop if c.id not in verdicts]
        if not todo:
            break
        say(f"screening {len(todo)} candidate(s) on CPU (parse, check, taxonomy, interpreter)")
        results = run_jobs(runner, [Job("screen", payload(cfg, c, quick=quick), cfg.runner.timeout_s, needs_gpu=False)
                                    for c in todo])
        for c in todo:
            verdicts[c.id] = results[c.id].outcome
            kind = "rules" if c.proposal.origin == "rules" else cfg.proposer.kind
            if (c.reference, kind) in proposers:
                proposers[(c.reference, kind)].tell(c.proposal, verdicts[c.id])
        artifacts.write_json(out / "screen.json", {k: v.to_json() for k, v in verdicts.items()})
    return pop, verdicts, notes


def _read(path: Path, default):
    return artifacts.read_json(path, where="--resume") if path.is_file() else default


# ------------------------------------------------------------------ the search
class Search:
    """Optuna ask / tell over (candidate, tile config); one measure job per new point."""

    def __init__(self, cfg: TuneConfig, verified: list[Candidate], runner, out: Path, progress=None):
        self.cfg, self.runner, self.progress = cfg, runner, progress
        self.targets = cfg.shapes.targets
        self.cands = {c.id: c for c in verified}
        self.log = artifacts.TrialLog(out / "trials.jsonl")
        self.records: dict[int, TrialRecord] = {r.number: r for r in self.log.read()}
        self.seen = {(r.proposal_id, _key(r.point)): r.number for r in self.records.values()}
        self.inflight: dict[int, tuple] = {}
        self.study = open_study(cfg)
        self.grid = sum(math.prod(len(p.choices) for p in SPACES[c.reference].params) for c in verified)
        self._checked: dict = {}
        self.stop_reason = ""

    # ---- budget
    @property
    def measured(self) -> int:
        return sum(r.state != TrialState.CONFIG_INVALID for r in self.records.values())

    def run(self) -> None:
        self.reconcile()
        self.warm_start()
        end, idle = time.monotonic() + 60 * self.cfg.budget.minutes, 0
        while True:
            while len(self.inflight) < self.runner.num_workers and not self._exhausted(end, idle):
                idle = 0 if self._ask_one() else idle + 1
            if not self.inflight:
                break
            for res in self.runner.results(timeout_s=1.0):
                self._finish(res)
            self._show()
        self._show(force=True)

    def _exhausted(self, end: float, idle: int) -> bool:
        b = self.cfg.budget
        reasons = [(self.measured + len(self.inflight) >= b.trials, f"trial budget ({b.trials}) reached"),
                   (time.monotonic() >= end, f"time budget ({b.minutes:g} min) reached"),
                   (len(self.seen) >= self.grid, "every point of the search space was tried"),
                   (idle >= MAX_IDLE_ASKS, f"the sampler proposed {MAX_IDLE_ASKS} explored or invalid points in a row")]
        hit = [why for cond, why in reasons if cond]
        if hit and not self.stop_reason:
            self.stop_reason = hit[0]
        return bool(hit)

    # ---- optuna bookkeeping
    def reconcile(self) -> None:
        """After a kill: a trial logged but not told is told from the log; one neither logged nor
        told was interrupted: failed, and its point enqueued again."""
        from optuna.trial import TrialState as OS
        for t in self.study.get_trials(deepcopy=False, states=(OS.RUNNING,)):
            rec = self.records.get(t.number)
            if rec is not None:         # its user attrs were set before it was logged (_record)
                self._tell(t.number, rec)
            else:                       # its "state" attr still says "interrupted" (_ask_one)
                self.study.tell(t.number, state=OS.FAIL)
                self.study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})

    def warm_start(self) -> None:
        """Enqueue the kernels' measured defaults for every candidate (once per study)."""
        have = {json.dumps(t.params, sort_keys=True) for t in self.study.get_trials(deepcopy=False)}
        for cid, cand in sorted(self.cands.items()):
            space = SPACES[cand.reference]
            for pt in space.best_known(self.cfg.shapes.head_dim):
                params = {"candidate": cid, **{f"{space.kernel}.{k}": v for k, v in pt.items()}}
                valid = not space.problems(pt, self.cfg.shapes.head_dim, self.cfg.arch)
                if valid and json.dumps(params, sort_keys=True) not in have:
                    self.study.enqueue_trial(params, user_attrs={"warm_start": True})

    def _ask_one(self) -> bool:
        """Ask one trial; True when it became a measure job."""
        trial = self.study.ask()
        cand = self.cands[trial.suggest_categorical("candidate", sorted(self.cands))]
        space = SPACES[cand.reference]
        point = {p.name: trial.suggest_categorical(f"{space.kernel}.{p.name}", p.choices) for p in space.params}
        key = (cand.id, _key(point))
        if key in self.seen:
            trial.set_user_attr("duplicate_of", self.seen[key])
            self.study.tell(trial, state=_optuna_state(TrialState.CONFIG_INVALID))
            return False
        self.seen[key] = trial.number
        problems = space.problems(point, self.cfg.shapes.head_dim, self.cfg.arch) or self._candidate_problems(cand, point)
        if problems:
            self._record(trial, cand, point, Outcome(TrialState.CONFIG_INVALID, "; ".join(problems)))
            self._tell(trial, self.records[trial.number])
            return False
        # What a trial killed mid-measurement keeps: its record overwrites it (_record).
        trial.set_user_attr("state", "interrupted")
        body = payload(self.cfg, cand, point, trial=trial.number)
        self.runner.submit([Job("measure", body, self.cfg.runner.timeout_s, needs_gpu=True)])
        self.inflight[trial.number] = (cand, point, trial)
        return True

    def _candidate_problems(self, cand: Candidate, point: dict) -> list[str]:
        """The candidate's own static check at this config (its buffers may differ from the reference's)."""
        from cubridge.cuir.checker import check
        from cubridge.cuir.parser import parse
        from cubridge.errors import CubridgeError
        key = (cand.id, _key(point))
        if key not in self._checked:
            try:
                check(parse(cand.proposal.text), params=SPACES[cand.reference].to_cuir(point),
                      dims={"D": self.cfg.shapes.head_dim}, arch=self.cfg.arch,
                      dtype=CUIR_TYPE[self.cfg.dtype])
                self._checked[key] = []
            except CubridgeError as e:
                self._checked[key] = [f"candidate check: {str(e).splitlines()[0]}"]
        return self._checked[key]

    def _finish(self, res) -> None:
        number = res.job.payload["trial"]
        cand, point, trial = self.inflight.pop(number)
        outcome = res.outcome
        if outcome.state == TrialState.OK and self._values(outcome.times_ms) is None:
            missing = [t.key for t in self.targets if t.key not in outcome.times_ms]
            outcome = Outcome(TrialState.CRASH, f"measured no time at {', '.join(missing)}")
        elif outcome.state == TrialState.VERIFIED:
            outcome = Outcome(TrialState.CRASH, f"not timed: {outcome.reason}")
        self._record(trial, cand, point, outcome, res)
        self._tell(trial, self.records[number])
        LOG.debug("trial #%d %s %s: %s %s", number, cand.id, SPACES[cand.reference].label(point), outcome.state.value,
                  outcome.times_ms or (outcome.reason.splitlines() or [""])[0][:200])

    def _values(self, times: dict):
        try:
            ms = [float(times[t.key]) for t in self.targets]
        except KeyError:
            return None
        return ms if self.cfg.objectives == "per_shape" else [math.exp(sum(map(math.log, ms)) / len(ms))]

    def _record(self, trial, cand: Candidate, point: dict, outcome: Outcome, res=None) -> None:
        """Log the trial (the Trial from ask()); its user attrs first, so that a kill between the
        log and the tell leaves Optuna nothing to learn but the tell (reconcile)."""
        number, space = trial.number, SPACES[cand.reference]
        trial.set_user_attr("state", outcome.state.value)
        trial.set_user_attr("reason", outcome.reason[:2000])
        data = res.data if res else {}
        rec = TrialRecord(number, cand.id, cand.proposal.origin, cand.reference, space.label(point), dict(point),
                          outcome, worker=res.worker if res else "", cubin_key=data.get("cubin_key"),
                          gpu_check=data.get("check"), device=data.get("device"), finished_at=time.time())
        self.log.append(rec)        # durable before Optuna hears of it: a kill in between is reconciled
        self.records[number] = rec

    def _tell(self, trial, rec: TrialRecord) -> None:
        """Tell Optuna a logged trial's result; `trial`: the Trial from ask(), or a trial number
        (a trial asked before a kill, reconciled from the log)."""
        state = rec.state
        values = self._values(rec.times_ms) if state == TrialState.OK else None
        if values is not None:
            self.study.tell(trial, values)
        else:
            self.study.tell(trial, state=_optuna_state(state))

    def _show(self, force: bool = False) -> None:
        if self.progress is None:
            return
        recs = list(self.records.values())
        fails = Counter(r.state.value for r in recs if r.state.failed)
        ok = [(self._values(r.times_ms), r) for r in recs if r.state == TrialState.OK]
        best = None
        if ok:
            v, r = min(ok, key=lambda x: math.prod(x[0]))
            best = f"{math.exp(sum(map(math.log, v)) / len(v)):.3f} ms geomean ({r.label}, #{r.number})"
        self.progress.update(self.measured, best, fails, force=force)


def _key(point: dict) -> str:
    return json.dumps(point, sort_keys=True)


def _optuna_state(state: TrialState):
    from optuna.trial import TrialState as OS
    return OS.PRUNED if state == TrialState.CONFIG_INVALID else OS.FAIL


def open_study(cfg: TuneConfig):
    """The run's study: one objective per target shape (or the geomean), named so that
    optuna-dashboard shows "N=8192,B=2 ms"; the search's shapes and config as study attrs."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = ([f"{t.key} ms" for t in cfg.shapes.targets] if cfg.objectives == "per_shape" else ["geomean ms"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # TPE, not NSGA-II: budgets here are tens of trials, under one NSGA-II generation.
        sampler = optuna.samplers.TPESampler(seed=0, multivariate=True, group=True, constant_liar=True,
                                             n_startup_trials=max(4, cfg.budget.trials // 4))
        study = optuna.create_study(study_name=f"{cfg.name}-{cfg.search_key}", storage=cfg.storage_url,
                                    directions=["minimize"] * len(names), sampler=sampler, load_if_exists=True)
        study.set_metric_names(names)
    for key, value in (("spec", cfg.spec), ("spec_params", cfg.spec_params), ("references", list(cfg.references)),
                       ("arch", cfg.arch), ("dtype", cfg.dtype),
                       ("shapes", [{"key": t.key, "batch": t.batch, "seqlen": t.seqlen} for t in cfg.shapes.targets]),
                       ("heads", [cfg.shapes.heads_q, cfg.shapes.heads_kv, cfg.shapes.head_dim])):
        study.set_user_attr(key, value)
    return study


# ------------------------------------------------------------------ the whole run
def tune(cfg: TuneConfig, *, runner=None, resume: bool = False, dry_run: bool = False, quick_screen: bool = False,
         progress=None, say=None) -> TuneResult:
    """Run one config end to end; returns what happened (never raises for a bad candidate or trial).
    `say` gets the run's messages (default: the `cubridge.tune` logger at INFO)."""
    say = say or LOG.info
    from cubridge.search.lock import RunLock
    # One run per output directory: taken before anything there is read, held to the end.
    with RunLock(cfg.output, where=f"{cfg.path}: output"):
        return _tune_locked(cfg, runner, resume, dry_run, quick_screen, progress, say)


def _tune_locked(cfg, runner, resume, dry_run, quick_screen, progress, say) -> TuneResult:
    from cubridge.search.finish import RunSummary, compile_population, finish_run
    own = runner is None
    if own:
        from cubridge.search.runners import make_runner
        runner = make_runner(cfg.runner.kind, address=cfg.runner.address, replay=cfg.runner.replay,
                             **_runner_options(cfg))
    try:
        out = prepare_output(cfg, resume)
        say(f"{cfg.name}: spec {cfg.spec}, reference {', '.join(cfg.references)}, {cfg.arch} {cfg.dtype}, "
            f"{len(cfg.shapes.targets)} shapes; runner {runner!r}; output {out}")
        pop, verdicts, notes = build_population(cfg, runner, out, quick=quick_screen, say=say)
        verified = [c for c in pop if verdicts[c.id].state == TrialState.VERIFIED]
        say(f"screened {len(pop)} candidate(s): {len(verified)} verified"
            + "".join(f"\n  {c.id} ({c.reference}, {c.proposal.origin}): {verdicts[c.id].state.value}: "
                      f"{verdicts[c.id].reason.splitlines()[0] if verdicts[c.id].reason else ''}" for c in pop))
        def summary(**kw) -> RunSummary:
            return RunSummary(cfg, out, pop, verdicts, notes=tuple(notes), **kw)
        if not verified:
            return finish_run(summary(status="nothing_verified", message="no candidate passed the CPU stages: "
                                      "nothing to tune"), runner=runner, say=say)
        if dry_run or runner.num_gpus == 0:
            compiler = available_compiler()
            compiled = compile_population(cfg, verified, runner, say) if compiler else {}
            done = "screening and compiling" if compiler else \
                "screening (compile skipped: neither nvcc nor NVRTC is on this machine)"
            why = f"--dry-run: stopped after {done} on purpose" if dry_run else \
                f"timing needs a GPU: this runner has none, so nothing was timed or tuned (stopped after {done})"
            return finish_run(summary(compiled=compiled, status="screened" if dry_run else "no_gpu", message=why),
                              runner=runner, say=say)
        from cubridge.search.llm_lowering import lowering_overrides
        overrides = lowering_overrides(cfg, verified, runner, out, say)
        verified = [replace(c, cuda_source=overrides.get(c.id)) for c in verified]
        search = Search(cfg, verified, runner, out, progress)
        search.run()
        if progress is not None:
            progress.close()
        say(f"search stopped: {search.stop_reason or 'no trial left to run'}")
        return finish_run(summary(records=list(search.records.values()), stop_reason=search.stop_reason),
                          runner=runner, say=say)
    finally:
        if own:
            runner.close()


def _runner_options(cfg) -> dict:
    """The Ray runner is built before the proposer: with the in-process vLLM engine in a Ray actor it
    must leave the engine's GPUs free, or the engine waits for them for ever (issue 20)."""
    o = cfg.proposer.options
    if cfg.runner.kind == "ray" and cfg.proposer.kind == "vllm" and o.get("ray_actor", True):
        return {"reserve_gpus": int(o.get("tensor_parallel_size") or 1)}
    return {}
