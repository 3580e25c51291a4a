"""The LLM proposer: the transfer task behind the ask / tell interface, registered as "vllm"
(vllm.LLM in process, or in a Ray actor) and "openai" (an OpenAI-compatible endpoint such as
`vllm serve`).

- `ask(n)` returns up to n new candidate programs: repairs first, then fresh samples from the
  population budget (`samples`); answers that cannot be read (cut off, no envelope) and requests
  that failed are recorded and logged, never raised. It returns [] once the budget is spent and
  no repair is pending.
- `tell(proposal, outcome)` records the outcome; a rejection (parse, check, structure, wrong
  answer, compile error, crash) schedules one repair of that candidate, fed the candidate and the
  error, up to `max_retries` repairs per chain.

Every prompt, answer and rejection goes to `<out_dir>/llm-<kind>.jsonl`.

Example (a scripted endpoint stands in for `vllm serve` in the tests):
    >>> from cubridge.registry import make_proposer
    >>> from cubridge.search.screen import ScreenContext, screen
    >>> ctx = ScreenContext.build("fa2_sm80", "causal", quick=True)
    >>> p = make_proposer("openai", ctx, {"base_url": "http://127.0.0.1:8000/v1", "samples": 4})  # doctest: +SKIP
    >>> for prop in p.ask(4):                                                                       # doctest: +SKIP
    ...     p.tell(prop, screen(prop, ctx, p.binder(prop)))
"""
from __future__ import annotations

import os
import tempfile

from cubridge.llm.backend import Backend, Sampling, check_fits
from cubridge.llm.engine import Record, Sampler
from cubridge.llm.log import EventLog
from cubridge.llm.options import LLMOptions, parse_options
from cubridge.llm.transfer import TransferTask
from cubridge.vocab import Outcome, Proposal, Proposer
from cubridge.registry import register


def make_backend(kind: str, opts: LLMOptions) -> Backend:
    """The backend an options object asks for; raises CubridgeError when it cannot be built."""
    b = opts.backend
    if kind == "openai":
        from cubridge.llm.openai_http import OpenAIHTTPBackend
        key = os.environ.get(b.api_key_env) if b.api_key_env else None
        return OpenAIHTTPBackend(b.base_url, model=b.model or None, api_key=key, timeout_s=b.timeout_s,
                                 retries=b.retries, backoff_s=b.backoff_s, structured=b.structured_field
                                 if opts.structured else "none", max_model_len=opts.max_model_len or None)
    engine = dict(max_model_len=opts.max_model_len or None, gpu_memory_utilization=b.gpu_memory_utilization,
                  dtype=b.dtype, seed=opts.seed, trust_remote_code=b.trust_remote_code)
    if b.ray_actor:
        from cubridge.llm.ray_actor import RayVLLMBackend
        return RayVLLMBackend(b.model, tensor_parallel_size=b.tensor_parallel_size, structured=opts.structured,
                              start_timeout_s=b.start_timeout_s, generate_timeout_s=b.generate_timeout_s, **engine)
    from cubridge.llm.vllm_backend import VLLMBackend
    return VLLMBackend(b.model, tensor_parallel_size=b.tensor_parallel_size, structured=opts.structured, **engine)


def sampling_of(opts: LLMOptions) -> Sampling:
    return Sampling(n=1, temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed, max_tokens=opts.max_tokens)


class LLMProposer(Proposer):
    def __init__(self, ctx, options: dict | None = None, *, kind: str = "openai", backend: Backend | None = None):
        self.name = kind
        self.ctx = ctx
        self.options = parse_options(kind, dict(options or {}))
        o = self.options
        self.task = TransferTask(ctx, worked_example=o.worked_example, example_spec=o.example_spec)
        if o.max_model_len:            # a prompt that cannot fit is a configuration error: say so now
            check_fits(self.task.messages(), o.max_tokens, o.max_model_len)
        self.backend = backend or make_backend(kind, o)
        self.log = EventLog(o.out_dir or tempfile.mkdtemp(prefix="cubridge-llm-"), kind)
        self.sampler = Sampler(self.task, self.backend, self.log, samples=o.samples, max_retries=o.max_retries,
                               sampling=sampling_of(o), max_model_len=o.max_model_len or None,
                               structured=o.structured)
        self.outcomes: dict[str, Outcome] = {}
        self.log.write("start", proposer=kind, backend=self.backend.describe(), reference=ctx.reference_name,
                       spec=ctx.spec.name, options={k: v for k, v in vars(o).items() if k != "backend"})

    # ------------------------------------------------------------ Proposer
    def ask(self, n: int) -> list[Proposal]:
        """Up to n new candidates; [] when the budget is spent and no repair is pending."""
        out = []
        while len(out) < n and not self.sampler.exhausted:
            errors_before = self._errors()
            drafts = self.sampler.draw(n - len(out))
            out += [Proposal(d.candidate, self.name, attempt=d.attempt, parent=d.parent,
                             notes=(f"model={self.backend.model}", f"seed={d.seed}", f"slot={d.slot}"))
                    for d in drafts]
            if self._errors() > errors_before:    # the backend is failing: do not spin on it
                break
        return out

    def tell(self, proposal: Proposal, outcome: Outcome) -> None:
        draft = self.sampler.drafts.get(proposal.id)
        if draft is None:
            return                                # not ours
        # Told again for another tile config: the latest outcome stands; the sampler repairs a
        # candidate at most once, so a second failure schedules nothing new.
        self.outcomes[proposal.id] = outcome
        if outcome.state.failed:
            self.sampler.reject(draft, outcome)
        else:
            self.sampler.accept(draft, outcome)

    def binder(self, proposal: Proposal):
        """Extra kernel inputs of an LLM candidate: none (shape constants are expressions of the
        shape in its text), so the same empty binding at every shape."""
        return lambda case: {}

    # ------------------------------------------------------------ inspection
    @property
    def records(self) -> list[Record]:
        """Every outcome so far, rejections before the screen included."""
        return self.sampler.records

    @property
    def last_error(self) -> str | None:
        """The latest failed request's message (unreachable server, timeout, prompt too long)."""
        return self.sampler.last_error

    error = last_error                    # the name the tuner and the rules proposer use

    def _errors(self) -> int:
        return sum(r.state.value == "proposer_error" for r in self.sampler.records)


@register("openai")
def _make_openai(ctx, options):
    return LLMProposer(ctx, options, kind="openai")


@register("vllm")
def _make_vllm(ctx, options):
    return LLMProposer(ctx, options, kind="vllm")
