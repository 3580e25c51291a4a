"""The rules proposer: the deterministic transfer behind the ask / tell interface.

It has exactly one proposal per (reference, spec): the rules transfer. `binder` gives the
candidate's extra kernel inputs at a shape, for verification and for launches.

Example:
    >>> from cubridge.search.screen import ScreenContext, screen
    >>> ctx = ScreenContext.build("fa2_sm80", "prefixlm", quick=True)
    >>> p = RulesProposer(ctx)
    >>> [prop] = p.ask(4)
    >>> screen(prop, ctx, p.binder(prop)).state.value
    'verified'
"""
from __future__ import annotations

from cubridge.errors import CubridgeError
from cubridge.vocab import Outcome, Proposal, Proposer
from cubridge.registry import register
from cubridge.transfer.rules import transfer


class RulesProposer(Proposer):
    name = "rules"

    def __init__(self, ctx, options: dict | None = None):
        self.ctx = ctx
        self.options = dict(options or {})
        self._given = False
        self.candidates = {}
        self.outcomes = {}
        self.error: str | None = None

    def ask(self, n: int) -> list[Proposal]:
        if self._given or n <= 0:
            return []
        self._given = True
        try:
            cand = transfer(self.ctx.reference, self.ctx.spec, spec_params=self.ctx.spec_params)
        except CubridgeError as e:          # untraceable hook: nothing to propose (an LLM may)
            self.error = str(e)
            return []
        prop = Proposal(cand.text, "rules", notes=tuple(cand.rules), binding=cand.binding.to_json())
        self.candidates[prop.id] = cand
        return [prop]

    def tell(self, proposal: Proposal, outcome: Outcome) -> None:
        self.outcomes[proposal.id] = outcome

    def binder(self, proposal: Proposal):
        cand = self.candidates[proposal.id]
        return lambda case: cand.bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B)


@register("rules")
def _make(ctx, options):
    return RulesProposer(ctx, options)
