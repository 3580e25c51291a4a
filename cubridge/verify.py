"""Verify a CuIR program against a spec in the interpreter, under the rule of docs/DESIGN.md.

For every case (fresh random inputs, never zeros; lengths that are not tile multiples; MHA, GQA
and MQA; several seeds): golden = the spec's reference in float64, ref = the same reference in
the kernel dtype, out = the interpreted program; pass iff max|out - golden| <= 2 max|ref - golden|
+ 1e-5 with no NaN/Inf golden lacks. The interpreter poisons outputs and reports any element no
store wrote; inputs must be unchanged; a second run, under another role schedule, must agree bit
for bit.

Example:
    >>> from cubridge.cuir.parser import parse_file
    >>> from cubridge.paths import ref_kernel_dir
    >>> from cubridge.spec import load_spec
    >>> prog = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")
    >>> rep = verify_program(prog, load_spec("causal"), cases=[Case(1, 2, 1, 70, 70, 32, 0)])
    >>> rep.passed
    True
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cubridge import rule
from cubridge.cuir import nodes as N
from cubridge.cuir.checker import check
from cubridge.cuir.interp import interpret
from cubridge.errors import CubridgeError
from cubridge.timelimit import call_with_limit

# A reference at the verification shapes takes milliseconds; one that has not returned in a minute
# never will (the tuner's job timeout would otherwise hide the cause).
REFERENCE_TIMEOUT_S = 60.0

USER_DTYPE = {"bf16": "bf16", "f16": "fp16"}     # CuIR type name -> the name in configs and on the CLI
# Kernel dtypes (cubridge.vocab.DTYPES) and CuIR's name for fp16 ("f16"); nothing else is read.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16}


@dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    seed: int = 0

    def __str__(self) -> str:
        return f"B={self.B} Hq={self.Hq} Hkv={self.Hkv} Nq={self.Nq} Nk={self.Nk} D={self.D} seed={self.seed}"


@dataclass
class CaseResult:
    case: Case
    verdict: rule.Verdict | None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.verdict is not None and self.verdict.passed


@dataclass
class Report:
    program: str
    spec: str
    dtype: str
    params: dict
    results: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def first_failure(self) -> CaseResult | None:
        return next((r for r in self.results if not r.passed), None)

    def table(self) -> str:
        head = (f"verify {self.program} against spec {self.spec} ({self.dtype}; "
                + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")")
        lines = [head, f"{'B':>2} {'Hq':>3} {'Hkv':>3} {'Nq':>5} {'Nk':>5} {'D':>4} {'seed':>4}  "
                       f"{'max err':>9} {'bound':>9}  result"]
        for r in self.results:
            c = r.case
            err = f"{r.verdict.max_err:9.2e} {r.verdict.bound:9.2e}" if r.verdict else f"{'-':>9} {'-':>9}"
            status = "pass" if r.passed else "FAIL: " + (r.error or r.verdict.reason)
            lines.append(f"{c.B:>2} {c.Hq:>3} {c.Hkv:>3} {c.Nq:>5} {c.Nk:>5} {c.D:>4} {c.seed:>4}  {err}  {status}")
        n = sum(r.passed for r in self.results)
        lines.append(f"{n}/{len(self.results)} cases passed")
        return "\n".join(lines)


def default_cases(D: int = 64, quick: bool = False) -> list[Case]:
    """Ragged lengths (not multiples of any tile), MHA / GQA / MQA, Nq < Nk (queries end-aligned), seeds."""
    cases = [Case(2, 4, 2, 300, 300, D, 0), Case(1, 2, 2, 1, 1, D, 1), Case(1, 4, 1, 17, 17, D, 2),
             Case(2, 2, 2, 130, 130, D, 3), Case(1, 4, 4, 77, 200, D, 4), Case(1, 8, 2, 130, 301, D, 5)]
    return cases[:3] if quick else cases


def deep_cases(params: dict, D: int = 64) -> list[Case]:
    """Cases that cover a program's whole iteration space at its tile config `params` (what the
    fixed N <= 300 cases missed: a barrier parity that breaks past 2 * STAGES KV tiles, a bug only
    at one BLOCK_N): more KV tiles than two turns of the ring with a ragged end (GQA), Nq < Nk (MQA)
    and several query tiles end-aligned to longer keys at an offset that is no tile multiple, at
    lengths that follow BLOCK_M / BLOCK_N / STAGES (Nq > Nk is refused by the spec format). Heads and batch stay small:
    the interpreter's cost grows with them, the coverage does not."""
    bm, bn, st = int(params.get("BLOCK_M", 128)), int(params.get("BLOCK_N", 64)), int(params.get("STAGES", 2))
    long = bn * (2 * st + 1) + 13
    return [Case(1, 2, 1, long, long, D, 10), Case(1, 3, 1, bm + 5, bm + 3 * bn + 7, D, 11),
            Case(1, 2, 2, 2 * bm + 3, 2 * bm + bn + 9, D, 12)]


def lse_of(spec, q, k, spec_params: dict):
    """log-sum-exp of each row's scores (natural log, after score_mod and the mask; -inf for a row
    with no key), in q's dtype: the LSE a softmax kernel stores. None where the spec has no hooks
    or does not normalise with softmax (its kernels store no LSE)."""
    import math
    from cubridge.spec import index_grids, mask_of
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if not spec.has_hooks:
        return None
    hooks = spec.hooks_for(Nq, Nk, Hq, Hkv, q.device, B=B, **spec_params)   # runtime inputs: sampled
    if hooks.normalization.kind != "softmax":
        return None
    scores = q @ k.repeat_interleave(Hq // Hkv, dim=1).transpose(-2, -1) / math.sqrt(D)
    positions = torch.arange(Nk - Nq, Nk)          # queries aligned to the end of the keys
    b, h, qi, ki = index_grids(B, Hq, positions, Nk, q.device)
    if hooks.score_mod is not None:
        from cubridge.evalmod import score_values     # FlexAttention's per-element idioms too
        scores = score_values(hooks.score_mod, scores, b, h, qi, ki).to(scores.dtype)
    mask = mask_of(hooks, b, h, qi, ki)
    return torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)


# The spec-mask check materialises N x N float64 scores in the reference: 2 GiB a matrix at 16k.
MASK_CHECK_MAX_N = 16384
MASK_CHECK_TOL = 1e-9      # float64 noise is ~1e-14; one key more or less moves a row by ~1/N >= 6e-5


def spec_mask_problem(spec, lengths, *, heads=(2, 1), spec_params: dict | None = None) -> str | None:
    """The spec's hooks (what a transfer lowers) against its reference() (what verification trusts)
    over the full [N, N] grid at each length (capped at MASK_CHECK_MAX_N; one head past 4k), in
    float64: a mask that
    disagrees only past index 1000 passed the small verification cases. None when they agree, else
    the first length and query row that differ."""
    if not spec.has_hooks:
        return None
    from cubridge.spec import attention_from_hooks
    for n in sorted({min(int(n), MASK_CHECK_MAX_N) for n in lengths}):
        # Past 4k one head (memory: each N x N float64 matrix is 2 GiB at 16k); heads below that.
        hq, hkv = heads if n <= 4096 else (1, 1)
        q, k, v = make_inputs(Case(1, hq, hkv, n, n, 16, seed=n), torch.float64)
        sp = dict(spec_params or {})
        try:
            ref = call_with_limit(lambda: spec.run_reference(q, k, v, **sp), REFERENCE_TIMEOUT_S * 4,
                                  f"spec {spec.name!r}: reference() at N={n}", where=spec.path)
            hooked = attention_from_hooks(q, k, v, spec.hooks_for(n, n, hq, hkv, **sp))
        except CubridgeError as e:
            return f"spec check at N={n}: {str(e).splitlines()[0]}"
        diff = (ref - hooked).abs().amax(dim=(0, 1, 3))           # per query row
        bad = (diff > MASK_CHECK_TOL * (1 + ref.abs().max())) | ~torch.isfinite(diff)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            return (f"the spec's hooks (mask_mod / score_mod) disagree with its reference() at N={n}, first at "
                    f"query row {row} (max diff {float(diff[row]):.2e}): kernels would compute the hooks")
    return None


def make_inputs(case: Case, dtype: torch.dtype):
    g = torch.Generator().manual_seed(case.seed)
    q = torch.randn(case.B, case.Hq, case.Nq, case.D, generator=g).to(dtype)
    k = torch.randn(case.B, case.Hkv, case.Nk, case.D, generator=g).to(dtype)
    v = torch.randn(case.B, case.Hkv, case.Nk, case.D, generator=g).to(dtype)
    return q, k, v


def _fit_params(program: N.Program, D: int, params: dict | None) -> dict:
    """params, or the reference kernel's own tile at head dim D where the program's defaults do
    not fit there (cubridge.runtime.kernels.fit_params; imported here, the layer above)."""
    from cubridge.runtime.kernels import fit_params
    return fit_params(program, D, params)


def verify_program(program: N.Program, spec, *, params: dict | None = None, cases=None,
                   dtype="bf16", spec_params: dict | None = None, schedules=("in_order", "reverse"),
                   static_check: bool = True, binder=None) -> Report:
    """Run every case; never raises for a failing candidate (failures are in the report).
    `binder(case) -> extra inputs` supplies a transferred program's scalars / tables per case."""
    tdtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    dname = {torch.bfloat16: "bf16", torch.float16: "f16"}[tdtype]        # CuIR's own type names
    merged = {**program.params(), **(params or {})}
    report = Report(program.name, spec.name, USER_DTYPE[dname], merged)
    cases = cases or default_cases()
    from cubridge.transfer.binding import spec_binder, spec_mismatch
    given_binder = binder
    try:        # a transferred program: its extra inputs bound from the spec, as the tuner binds them
        problem = spec_mismatch(program, spec, spec_params)
        if not problem and binder is None:
            binder = spec_binder(program, spec, spec_params, params)
    except CubridgeError as e:
        problem = str(e).splitlines()[0]
    if problem:
        report.results.append(CaseResult(cases[0], None, problem))
        return report
    checked = set()
    own_binder = given_binder
    for case in cases:
        at_d = _fit_params(program, case.D, params)      # e.g. fa3_sm90's own tile at D = 256
        if at_d and not params:
            report.params = {**program.params(), **at_d}
        if static_check and case.D not in checked:
            try:
                check(program, params=at_d, dims={"D": case.D}, dtype=dname)
            except CubridgeError as e:
                report.results.append(CaseResult(case, None, f"static check: {e}"))
                continue
            checked.add(case.D)
        try:
            case_binder = binder
            if own_binder is None and binder is not None and at_d != (params or {}):
                case_binder = spec_binder(program, spec, spec_params, at_d)   # tables at that tile
            extra = case_binder(case) if case_binder else None
        except CubridgeError as e:
            report.results.append(CaseResult(case, None, f"binding extra inputs: {str(e).splitlines()[0]}"))
            continue
        report.results.append(run_case(program, spec, case, tdtype, at_d, spec_params or {}, schedules,
                                         extra=extra))
    return report


def verify_transfer(reference: N.Program, spec, *, params: dict | None = None, cases=None, dtype="bf16",
                    spec_params: dict | None = None, schedules=("in_order", "reverse")) -> Report:
    """Transfer `reference` to `spec` at every case's shape (rules proposer), check the candidate
    against the taxonomy and statically, and verify it like verify_program. Never raises for a
    failing candidate."""
    from cubridge.transfer.rules import transfer
    tdtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    dname = {torch.bfloat16: "bf16", torch.float16: "f16"}[tdtype]
    report = Report(f"{reference.name} -> {spec.name}", spec.name, USER_DTYPE[dname], {**reference.params(), **(params or {})})
    try:
        cand = transfer(reference, spec, spec_params=spec_params)
    except CubridgeError as e:
        report.results.append(CaseResult((cases or default_cases())[0], None, f"transfer: {str(e).splitlines()[0]}"))
        return report
    checked = set()
    for case in cases or default_cases():
        try:
            at_d = _fit_params(cand.program, case.D, params)
            if at_d and not params:
                report.params = {**reference.params(), **at_d}
            if case.D not in checked:
                check(cand.program, params=at_d, dims={"D": case.D}, dtype=dname)
                checked.add(case.D)
            extra = cand.bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B, params=at_d)
        except CubridgeError as e:
            report.results.append(CaseResult(case, None, f"transfer: {str(e).splitlines()[0]}"))
            continue
        report.results.append(run_case(cand.program, spec, case, tdtype, at_d, spec_params or {},
                                         schedules, extra=extra))
    return report


def run_case(program, spec, case, tdtype, params, spec_params, schedules, extra=None) -> CaseResult:
    q, k, v = make_inputs(case, tdtype)
    before = [t.clone() for t in (q, k, v)]
    try:
        golden, ref = (call_with_limit(lambda t=t: spec.run_reference(*t, **spec_params), REFERENCE_TIMEOUT_S,
                                       f"spec {spec.name!r}: reference() at {case}", where=spec.path)
                       for t in ((q.double(), k.double(), v.double()), (q, k, v)))
    except CubridgeError as e:
        return CaseResult(case, None, f"spec reference failed: {str(e).splitlines()[0]}")
    runs = []
    try:
        for sched in schedules:
            inputs = {"Q": q, "K": k, "V": v, **(extra or {})}
            runs.append(interpret(program, inputs, params=params, schedule=sched).outputs)
    except CubridgeError as e:
        return CaseResult(case, None, str(e).splitlines()[0])
    if any(not torch.equal(a, b) for a, b in zip(before, (q, k, v))):
        return CaseResult(case, None, "inputs changed by the run")
    for name in runs[0]:
        if not all(_same(runs[0][name], r[name]) for r in runs[1:]):
            return CaseResult(case, None, f"two runs (different role schedules) differ in {name}: a race")
    verdict = rule.compare(runs[0]["O"], golden, ref)
    if verdict.passed and "LSE" in runs[0]:
        # LSE is an output too (the backward pass and split-KV merges read it): LSE + 5 or -inf
        # passed when only O was compared.
        lse = _lse_verdict(runs[0]["LSE"], spec, q, k, spec_params)
        if lse is not None and not lse.passed:
            return CaseResult(case, lse, f"LSE: {lse.reason}")
    return CaseResult(case, verdict)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN: a NaN both runs leave is the rule's finding, not a race."""
    return torch.equal(a, b) or (a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all()))


def _lse_verdict(out, spec, q, k, spec_params):
    try:
        golden = lse_of(spec, q.double(), k.double(), spec_params)
        ref = lse_of(spec, q, k, spec_params)
    except CubridgeError:
        return None
    return None if golden is None else rule.compare(out, golden, ref)
