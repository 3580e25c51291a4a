"""The transfer task: reference CuIR + a spec's PyTorch source -> target CuIR, for specs the rules
proposer cannot trace (only a `reference`, Python control flow in a hook, an op it does not know).

The prompt holds the rule taxonomy, the reference program, the spec's source with the parameters
it is verified at, and a worked example: the rules proposer's transfer of another spec from the
same reference, as a diff. The answer is the whole target program in the {"cuir", "notes"}
envelope; the candidate is its text, checked later by the screen like every proposal.

Example:
    >>> from cubridge.search.screen import ScreenContext
    >>> task = TransferTask(ScreenContext.build("fa2_sm80", "causal", quick=True))
    >>> [m["role"] for m in task.messages()]
    ['system', 'user']
    >>> "prefixlm" in task.messages()[1]["content"]       # the worked example
    True
"""
from __future__ import annotations

from cubridge.cuir.printer import to_text
from cubridge.errors import CubridgeError
from cubridge.llm.engine import Rejected, Task
from cubridge.llm.envelope import TRANSFER
from cubridge.llm.prompting import render, render_taxonomy, system_message, unified_diff
from cubridge.vocab import TrialState

# Example specs tried in order when the configured one is the target itself (no answer leaks).
FALLBACK_EXAMPLES = ("prefixlm", "global_sliding_window", "causal")
# Shapes the worked example's shape-dependent inputs are shown at (NQ = NK = N, HQ = 4, HKV = 2).
EXAMPLE_SHAPES = (97, 211)


class TransferTask(Task):
    name = "transfer"
    envelope = TRANSFER
    artifact = "CuIR program"

    def __init__(self, ctx, *, worked_example: bool = True, example_spec: str = "prefixlm"):
        self.ctx = ctx
        self.example = worked_example_text(ctx, example_spec) if worked_example else ""
        spec = ctx.spec
        params = spec.resolved_params(**ctx.spec_params)
        user = render("transfer", reference_name=ctx.reference_name, reference_cuir=to_text(ctx.reference).rstrip(),
                      spec_name=spec.name, spec_params=_params(params), spec_source=spec.source.rstrip(),
                      taxonomy=render_taxonomy(), example=self.example.rstrip(), answer_format=render("answer_transfer"))
        self._messages = [system_message(), {"role": "user", "content": user}]

    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    def candidate(self, fields: dict) -> str:
        text = fields["cuir"].strip("\n")
        if not text.strip():
            raise Rejected(TrialState.REJECTED_PARSE, 'the "cuir" field is empty')
        return text + "\n"


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items()) or "none"


def worked_example_text(ctx, example_spec: str) -> str:
    """The rules proposer's transfer of an example spec from ctx's reference, as prompt text; ""
    when no example spec other than the target transfers."""
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    names = [example_spec] + [n for n in FALLBACK_EXAMPLES if n != example_spec]
    for name in names:
        if name == ctx.spec.name:
            continue
        try:
            spec = load_spec(name)
            cand = transfer(ctx.reference, spec)
        except CubridgeError:
            continue
        return render("example", reference_name=ctx.reference_name, example_spec=name,
                      example_source=spec.source.rstrip(), diff=unified_diff(to_text(ctx.reference), cand.text),
                      bound_note=_bound_note(cand))
    return ""


def _bound_note(cand) -> str:
    """Explain the example's extra inputs: the rules bind them at call time; an LLM answer writes
    shape-dependent constants as expressions of the shape instead."""
    if not cand.slots:
        return ""
    lines = ["The rules bind this example's scalar inputs at call time:"]
    for n in EXAMPLE_SHAPES:
        bound = cand.bind(Nq=n, Nk=n, Hq=4, Hkv=2)
        scalars = ", ".join(f"{k} = {v}" for k, v in bound.items() if not hasattr(v, "shape"))
        if scalars:
            lines.append(f"- at NQ = NK = {n}: {scalars}")
    lines.append("In your answer, write such a shape-dependent constant as an expression of NQ, NK, HQ, HKV "
                 "instead of declaring an input.")
    return "\n" + "\n".join(lines)

