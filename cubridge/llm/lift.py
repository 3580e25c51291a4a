"""The lift task: a user's CUDA attention kernel -> a CuIR program + its lifting map.

The prompt shows the CUDA source with line numbers, an example (a reference kernel's CuIR and the
first lines of each of its marked regions) and asks for {"cuir", "regions": {NAME: [first, last]},
"notes"}. On CPU a candidate must parse, pass the static checker, map every region it uses to a
line range (ranges disjoint, inside the file), and, when the spec the kernel computes is given,
verify in the interpreter against it. It is accepted only by the injected
`accept(LiftCandidate) -> Outcome`: the GPU lift check (the CUDA kernel and the CuIR program on
the same inputs), which the tuner runs in its isolated runner workers; this module never compiles
or runs the CUDA. An accepted candidate's `annotated` source carries the region markers, ready to
serve as a reference kernel.

Example:
    >>> from cubridge.paths import ref_kernel_dir
    >>> from cubridge.llm.regions import strip_markers
    >>> cu = strip_markers((ref_kernel_dir("fa2_sm80") / "kernel.cu").read_text())
    >>> task = LiftTask(cu, name="my_fa2", spec="causal")
    >>> "my_fa2" in task.messages()[1]["content"]
    True
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from cubridge.cuir import nodes as N
from cubridge.cuir.checker import check
from cubridge.cuir.parser import parse
from cubridge.errors import CubridgeError, CuIRSyntaxError
from cubridge.llm.engine import Rejected, Solution, Task, run_task
from cubridge.llm.envelope import LIFT
from cubridge.llm.prompting import numbered, render, system_message
from cubridge.llm.regions import PatchError, annotate, find_regions, strip_markers
from cubridge.vocab import Outcome, TrialState

# Lines of each example region shown in the prompt: enough to recognise the code.
EXAMPLE_LINES = 4
_RANGE_LINE = re.compile(r"^\s*[-*]?\s*`?(\w+)`?\s*:\s*(?:lines?\s*)?(\d+)\s*[-–]\s*(\d+)", re.M)


@dataclass(frozen=True)
class LiftCandidate:
    cuir: str
    program: N.Program
    regions: dict            # name -> (first line, last line), 1-based, inclusive
    annotated: str           # the CUDA source with region markers inserted

    def __str__(self) -> str:
        return self.cuir + json.dumps(self.regions, sort_keys=True)


class LiftTask(Task):
    name = "lift"
    envelope = LIFT
    artifact = "CuIR program and lifting map"

    def __init__(self, cuda_source: str, *, name: str = "user_kernel", arch: str = "sm_80", spec=None,
                 spec_params: dict | None = None, example: str = "fa2_sm80", cases=None, head_dim: int = 64):
        from cubridge.spec import load_spec
        self.cuda = strip_markers(cuda_source)     # markers would collide with the ones lifting adds
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        self.spec_params = dict(spec_params or {})
        self.cases = cases
        self.head_dim = head_dim
        spec_line = (f"It computes the variant `{self.spec.name}` (its PyTorch reference is what the lifted "
                     "program is verified against)." if self.spec else "")
        ex_cuir, ex_map = _example(example)
        user = render("lift", kernel_name=name, arch=arch, spec_line=spec_line, example_name=example,
                      example_cuir=ex_cuir, example_map=ex_map, cuda=numbered(self.cuda))
        self._messages = [system_message(), {"role": "user", "content": user}]

    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    def candidate(self, fields: dict) -> LiftCandidate:
        text = fields["cuir"].strip("\n") + "\n"
        ranges = fields.get("regions")
        if ranges is None:                          # fenced fallback: "mask: 120-135" lines in the prose
            ranges = {m[0]: [int(m[1]), int(m[2])] for m in _RANGE_LINE.findall(fields.get("notes", ""))}
        try:
            program = parse(text, source="<lifted>")
        except CuIRSyntaxError as e:
            raise Rejected(TrialState.REJECTED_PARSE, str(e)) from None
        try:
            check(program, dims={"D": self.head_dim})
        except CubridgeError as e:
            raise Rejected(TrialState.REJECTED_CHECK, str(e)) from None
        return LiftCandidate(text, program, *self._map(program, ranges))

    def _map(self, program, ranges):
        used = {st.name for st in N.walk_stmts(program.body) if isinstance(st, N.Region)}
        problems = [f"region {n!r} is used in the program but not in the lifting map" for n in sorted(used - set(ranges))]
        problems += [f"the lifting map names region {n!r}, which the program does not use"
                     for n in sorted(set(ranges) - used - set(N.CUDA_ONLY_REGIONS))]
        bad = [n for n, r in ranges.items() if not (isinstance(r, (list, tuple)) and len(r) == 2
                                                    and all(isinstance(x, int) for x in r))]
        problems += [f"region {n!r}: expected [first_line, last_line], got {ranges[n]!r}" for n in bad]
        if problems:
            raise Rejected(TrialState.REJECTED_CHECK, "lifting map: " + "; ".join(problems))
        clean = {n: (int(r[0]), int(r[1])) for n, r in ranges.items()}
        try:
            annotated = annotate(self.cuda, clean)
            find_regions(annotated)
        except PatchError as e:
            raise Rejected(TrialState.REJECTED_CHECK, f"lifting map: {e}") from None
        return clean, annotated

    def precheck(self, candidate: LiftCandidate) -> Outcome | None:
        """Verify the lifted program against the spec in the interpreter, when one is given."""
        if self.spec is None:
            return None
        from cubridge.verify import default_cases, verify_program
        report = verify_program(candidate.program, self.spec, spec_params=self.spec_params,
                                cases=self.cases or default_cases(D=self.head_dim, quick=True))
        if report.passed:
            return Outcome(TrialState.VERIFIED, f"{len(report.results)} interpreter cases passed")
        bad = report.first_failure
        return Outcome(TrialState.WRONG_ANSWER, f"verification failed at {bad.case}: {bad.error or bad.verdict.reason}")


def _example(name: str):
    from cubridge.paths import ref_kernel_dir
    d = ref_kernel_dir(name)
    cu = (d / "kernel.cu").read_text()
    lines = cu.splitlines()
    parts = []
    for region, s in find_regions(cu).items():
        head = "\n".join(lines[s.open + 1:min(s.close, s.open + 1 + EXAMPLE_LINES)])
        parts.append(f"- {region}: lines {s.open + 2}-{s.close}\n```cuda\n{head}\n```")
    return (d / "kernel.cuir").read_text().rstrip(), "\n".join(parts)


def lift(cuda_source: str, backend, accept, *, out_dir, name: str = "user_kernel", arch: str = "sm_80",
         spec=None, spec_params=None, **options) -> Solution:
    """Lift `cuda_source` with the model behind `backend`; `accept(LiftCandidate) -> Outcome` is the
    GPU lift check (the tuner's runners). See engine.run_task for options."""
    task = LiftTask(cuda_source, name=name, arch=arch, spec=spec, spec_params=spec_params)
    return run_task(task, backend, accept, out_dir=out_dir, **options)
