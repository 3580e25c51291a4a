"""The CPU stages every candidate passes before any GPU work, shared by all proposers:
parse -> static check -> rule taxonomy -> verification in the interpreter.

`screen(proposal, ctx)` never raises for a bad candidate: it returns an Outcome whose state says
which stage rejected it and whose reason is the stage's error message (what an LLM proposer feeds
back on retry).

Example:
    >>> from cubridge.vocab import Proposal
    >>> ctx = ScreenContext.build("fa2_sm80", "causal", quick=True)
    >>> screen(Proposal("kernel('x')\\nimport os\\n", "test"), ctx).state.value
    'rejected_parse'
"""
from __future__ import annotations

from dataclasses import dataclass

from cubridge.cuir import nodes as N
from cubridge.cuir.checker import check
from cubridge.cuir.parser import parse, parse_file
from cubridge.errors import CubridgeError, CuIRCheckError, CuIRSyntaxError
from cubridge.vocab import Outcome, Proposal, TrialState
from cubridge.transfer.taxonomy import StructureError, check_structure


@dataclass
class ScreenContext:
    reference: N.Program
    reference_name: str
    spec: object
    spec_params: dict
    cases: list
    head_dims: tuple = (64,)

    @classmethod
    def build(cls, reference_name: str, spec, *, spec_params=None, quick: bool = False, head_dims=(64,)):
        from cubridge.runtime.kernels import reference_kernel
        from cubridge.spec import load_spec
        from cubridge.verify import default_cases
        ref = parse_file(reference_kernel(reference_name).cuir_path())
        spec = load_spec(spec) if isinstance(spec, str) else spec
        return cls(ref, reference_name, spec, dict(spec_params or {}), default_cases(quick=quick),
                   tuple(head_dims))


def screen(proposal: Proposal, ctx: ScreenContext, binder=None) -> Outcome:
    """Run the CPU stages. `binder(case) -> extra inputs` supplies a candidate's extra kernel inputs
    (scalars, captured tensors, block tables); the rules proposer provides one."""
    from cubridge.verify import run_case, DTYPES
    try:
        prog = parse(proposal.text, source=f"<proposal {proposal.id}>")
    except CuIRSyntaxError as e:
        return Outcome(TrialState.REJECTED_PARSE, str(e))
    try:
        for d in ctx.head_dims:
            check(prog, dims={"D": d})
    except CuIRCheckError as e:
        return Outcome(TrialState.REJECTED_CHECK, str(e))
    except CubridgeError as e:
        return Outcome(TrialState.REJECTED_CHECK, str(e))
    try:
        check_structure(ctx.reference, prog)
    except StructureError as e:
        return Outcome(TrialState.REJECTED_STRUCTURE, str(e))
    for case in ctx.cases:
        try:
            extra = binder(case) if binder else {}
        except CubridgeError as e:
            return Outcome(TrialState.WRONG_ANSWER, f"binding extra inputs at {case}: {e}")
        res = run_case(prog, ctx.spec, case, DTYPES["bf16"], {}, ctx.spec_params,
                        ("in_order", "reverse"), extra=extra)
        if not res.passed:
            why = res.error or res.verdict.reason
            return Outcome(TrialState.WRONG_ANSWER, f"verification failed at {case}: {why}")
    return Outcome(TrialState.VERIFIED, f"{len(ctx.cases)} interpreter cases passed")
