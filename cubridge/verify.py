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
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


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


def make_inputs(case: Case, dtype: torch.dtype):
    g = torch.Generator().manual_seed(case.seed)
    q = torch.randn(case.B, case.Hq, case.Nq, case.D, generator=g).to(dtype)
    k = torch.randn(case.B, case.Hkv, case.Nk, case.D, generator=g).to(dtype)
    v = torch.randn(case.B, case.Hkv, case.Nk, case.D, generator=g).to(dtype)
    return q, k, v


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
    checked = set()
    for case in cases:
        if static_check and case.D not in checked:
            try:
                check(program, params=params, dims={"D": case.D}, dtype=dname)
            except CubridgeError as e:
                report.results.append(CaseResult(case, None, f"static check: {e}"))
                continue
            checked.add(case.D)
        try:
            extra = binder(case) if binder else None
        except CubridgeError as e:
            report.results.append(CaseResult(case, None, f"binding extra inputs: {str(e).splitlines()[0]}"))
            continue
        report.results.append(run_case(program, spec, case, tdtype, params or {}, spec_params or {}, schedules,
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
            if case.D not in checked:
                check(cand.program, params=params, dims={"D": case.D}, dtype=dname)
                checked.add(case.D)
            extra = cand.bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B, params=params)
        except CubridgeError as e:
            report.results.append(CaseResult(case, None, f"transfer: {str(e).splitlines()[0]}"))
            continue
        report.results.append(run_case(cand.program, spec, case, tdtype, params or {}, spec_params or {},
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
    outs = []
    try:
        for sched in schedules:
            inputs = {"Q": q, "K": k, "V": v, **(extra or {})}
            outs.append(interpret(program, inputs, params=params, schedule=sched).outputs["O"])
    except CubridgeError as e:
        return CaseResult(case, None, str(e).splitlines()[0])
    if any(not torch.equal(a, b) for a, b in zip(before, (q, k, v))):
        return CaseResult(case, None, "inputs changed by the run")
    if len(outs) > 1 and not all(torch.equal(outs[0], o) for o in outs[1:]):
        return CaseResult(case, None, "two runs (different role schedules) differ: a race")
    return CaseResult(case, rule.compare(outs[0], golden, ref))
