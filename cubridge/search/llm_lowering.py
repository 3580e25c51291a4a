"""LLM lowering inside the tuner: a verified candidate whose CuIR the deterministic generators
cannot lower (cubridge.lower raises LowerError) is handed to the LLM lower task, which patches
the marked regions of the reference kernel. A patch is accepted only after it compiles and passes
the GPU half of the verification rule on a runner worker (a `measure` job with no timing shapes);
the accepted source is saved in <output>/lowered/<candidate>.cu and used by every later job.

Without an LLM proposer, or without a GPU to accept a patch, such a candidate stays unlowerable
and the run says so (its trials end as COMPILE_ERROR with the generator's reason).
"""
from __future__ import annotations

import logging
from pathlib import Path

from cubridge.cuir.parser import parse, parse_file
from cubridge.errors import CubridgeError
from cubridge.runtime.kernels import reference_kernel
from cubridge.vocab import Job, Outcome, TrialState

LLM_KINDS = ("vllm", "openai")


def lowering_overrides(cfg, verified, runner, out: Path, say=None, *, backend=None) -> dict:
    """candidate id -> patched CUDA source, for the candidates that need (and got) an LLM lowering."""
    from cubridge.lower import LowerError, lower
    say = say or logging.getLogger("cubridge.tune").info
    overrides, need = {}, []
    for c in verified:
        saved = out / "lowered" / f"{c.id}.cu"
        if saved.is_file():
            overrides[c.id] = saved.read_text()
            continue
        try:
            lower(parse(c.proposal.text), c.reference)
        except LowerError as e:
            need.append((c, e))
    if not need:
        return overrides
    if cfg.proposer.kind not in LLM_KINDS and backend is None:
        for c, e in need:
            say(f"  {c.id}: no deterministic lowering ({e.message}); an LLM proposer could patch the kernel")
        return overrides
    if runner.num_gpus == 0:
        say(f"{len(need)} candidate(s) need an LLM lowering, which is accepted only after a GPU check: "
            "skipped (this runner has no GPU)")
        return overrides
    if backend is None:
        from cubridge.llm.options import parse_options
        from cubridge.llm.proposer import make_backend
        from cubridge.search.messages import proposer_options
        backend = make_backend(cfg.proposer.kind, parse_options(cfg.proposer.kind, proposer_options(cfg, out)))
    from cubridge.llm.lower import lower as llm_lower
    for c, why in need:
        say(f"  {c.id}: no deterministic lowering ({why.message}); asking the model for a patch")
        kernel_cu = reference_kernel(c.reference).source()
        reference = parse_file(reference_kernel(c.reference).cuir_path())
        try:
            sol = llm_lower(kernel_cu, reference, parse(c.proposal.text), backend, acceptor(cfg, c, runner),
                            out_dir=out / "llm", reference_name=c.reference)
        except CubridgeError as e:
            say(f"  {c.id}: LLM lowering failed: {e.message}")
            continue
        if sol.accepted:
            path = out / "lowered" / f"{c.id}.cu"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(sol.candidate.source)
            overrides[c.id] = sol.candidate.source
            say(f"  {c.id}: LLM lowering accepted after the GPU check")
        else:
            say(f"  {c.id}: no LLM patch passed the GPU check ({len(sol.records)} tried)")
    return overrides


def acceptor(cfg, cand, runner):
    """accept(LowerCandidate) -> Outcome: compile the patched kernel and run the GPU verification
    on a runner worker at the reference's default tile config (no timing)."""
    from cubridge.search.space import SPACES
    from cubridge.search.messages import payload, run_jobs
    space = SPACES[cand.reference]
    valid = [p for p in space.best_known(cfg.shapes.head_dim) if not space.problems(p, cfg.shapes.head_dim, cfg.arch)]
    point = (valid or space.points(cfg.shapes.head_dim, cfg.arch))[0]

    def accept(candidate) -> Outcome:
        body = payload(cfg, cand, point, cuda_source=candidate.source, shapes=())   # check only: the GPU half of the rule
        res = run_jobs(runner, [Job("measure", body, cfg.runner.timeout_s, needs_gpu=True)])[cand.id]
        if res.outcome.state == TrialState.OK:
            return Outcome(TrialState.OK, res.outcome.reason)
        return res.outcome
    return accept
