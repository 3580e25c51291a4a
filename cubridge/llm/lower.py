"""The lower task: a CuIR change the deterministic generators do not cover -> a patch of the
reference kernel.cu's marked regions (`// @cuir-region NAME` ... `// @cuir-end NAME`).

The prompt shows, region by region, the CuIR before and after and the CUDA now between the
markers, with the whole kernel for context. The answer is {"regions": {NAME: new contents}}
(or marked blocks, as a fallback). A patch is applied only to regions whose CuIR changed, never
carries marker lines, and the patched file must equal the original outside the regions' contents
(`regions.check_confined`); anything else is REJECTED_STRUCTURE. A patch that passes is accepted
only by the injected `accept(candidate) -> Outcome`: compile + GPU verification, which the tuner
runs in its isolated runner workers. This module never compiles or loads the CUDA it receives.

Example:
    >>> from cubridge.cuir.parser import parse_file
    >>> from cubridge.paths import ref_kernel_dir
    >>> from cubridge.spec import load_spec
    >>> from cubridge.transfer.rules import transfer
    >>> ref = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")
    >>> changed_regions(ref, transfer(ref, load_spec("sigmoid")).program)   # + a bias input, no LSE
    ['kv_range', 'mask', 'softmax', 'epilogue', 'extra_io']
"""
from __future__ import annotations

from dataclasses import dataclass

from cubridge.cuir import nodes as N
from cubridge.cuir.printer import stmt_lines, to_text
from cubridge.errors import CubridgeError
from cubridge.llm.engine import Rejected, Solution, Task, run_task
from cubridge.llm.envelope import LOWER, EnvelopeError, read_envelope
from cubridge.llm.prompting import render, system_message
from cubridge.llm.regions import PatchError, apply_patch, find_regions, marked_blocks
from cubridge.vocab import TrialState

# The kernel.cu region that declares a variant's extra inputs (fa3_sm90 marks one); CuIR has no
# region for them: they are the extra I/O declarations before grid(...).
EXTRA_IO = "extra_io"


@dataclass(frozen=True)
class LowerCandidate:
    source: str          # the patched kernel.cu
    patch: dict          # region name -> new contents

    def __str__(self) -> str:
        return self.source


def _regions_by_name(body) -> dict:
    out = {}
    for st in N.walk_stmts(body):
        if isinstance(st, N.Region):
            out.setdefault(st.name, []).append(st.body)
    return out


def _extra_io(program: N.Program) -> list:
    return [st for st in program.body if isinstance(st, N.Assign) and isinstance(st.value, N.Call)
            and st.value.op in ("global_input", "scalar_input", "global_output")
            and st.targets[0] not in ("Q", "K", "V", "O")]


def changed_regions(reference: N.Program, target: N.Program) -> list:
    """Region names whose CuIR differs between the programs (file order of the target), plus
    EXTRA_IO when the extra input / output declarations differ."""
    a, b = _regions_by_name(reference.body), _regions_by_name(target.body)
    names = [n for n in b if a.get(n) != b[n]] + [n for n in a if n not in b]
    if _extra_io(reference) != _extra_io(target):
        names.append(EXTRA_IO)
    return names


def _cuir(body) -> str:
    return "\n".join(stmt_lines(body, 0)) or "(nothing)"


class LowerTask(Task):
    name = "lower"
    envelope = LOWER
    artifact = "set of region contents (every region you change, in full)"

    def __init__(self, kernel_cu: str, reference: N.Program, target: N.Program, *, regions=None,
                 reference_name: str = "reference", include_kernel: bool = True):
        self.kernel = kernel_cu
        self.spans = find_regions(kernel_cu)
        if regions is None:           # extra_io only where the kernel marks it (else the generators own it)
            regions = [r for r in changed_regions(reference, target) if r != EXTRA_IO or r in self.spans]
        self.regions = tuple(regions)
        if not self.regions:
            raise CubridgeError("the target CuIR changes no region of the reference: nothing to lower")
        missing = [r for r in self.regions if r not in self.spans]
        if missing:
            raise CubridgeError(f"kernel.cu marks no region {', '.join(map(repr, missing))}",
                                hint=f"marked: {', '.join(self.spans)}; reference-guided lowering patches marked "
                                     "regions only: mark the code of that region in the reference kernel")
        before, after = _regions_by_name(reference.body), _regions_by_name(target.body)
        changes, current = [], []
        for name in self.regions:
            if name == EXTRA_IO:
                old, new = _cuir(tuple(_extra_io(reference))), _cuir(tuple(_extra_io(target)))
            else:
                old = "\n# ...\n".join(_cuir(b) for b in before.get(name, [()]))
                new = "\n# ...\n".join(_cuir(b) for b in after.get(name, [()]))
            changes.append(f"### {name}\nbefore:\n```cuir\n{old}\n```\nafter:\n```cuir\n{new}\n```")
            s = self.spans[name]
            body = "\n".join(kernel_cu.splitlines()[s.open + 1:s.close])
            current.append(f"### {name} (kernel.cu lines {s.open + 2}-{s.close})\n```cuda\n{body}\n```")
        user = render("lower", reference_name=reference_name, changes="\n\n".join(changes),
                      cuda_regions="\n\n".join(current), kernel=kernel_cu.rstrip() if include_kernel else
                      "(left out to fit the context)")
        user += f"\n## The target CuIR program\n\n```cuir\n{to_text(target).rstrip()}\n```\n"
        self._messages = [system_message(), {"role": "user", "content": user}]

    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    def read(self, text, finish_reason, max_tokens):
        try:
            fields = read_envelope(text, finish_reason, self.envelope, max_tokens)
        except EnvelopeError as e:
            blocks = marked_blocks(text or "") if finish_reason != "length" else {}
            if not blocks:
                raise Rejected(TrialState.REJECTED_PARSE, str(e)) from None
            fields = {"regions": blocks}
        return self.candidate(fields)

    def candidate(self, fields: dict) -> LowerCandidate:
        patch = fields["regions"]
        if not patch:
            raise Rejected(TrialState.REJECTED_STRUCTURE, f"the patch rewrites no region; rewrite: {', '.join(self.regions)}")
        bad = [k for k, v in patch.items() if not isinstance(v, str)]
        if bad:
            raise Rejected(TrialState.REJECTED_PARSE, f"regions {bad} are not strings of CUDA code")
        from cubridge.llm.patch_guard import forbidden
        refused = forbidden(patch)
        if refused:
            raise Rejected(TrialState.REJECTED_STRUCTURE, "the patch holds forbidden constructs: " + "; ".join(refused))
        try:
            return LowerCandidate(apply_patch(self.kernel, patch, allowed=self.regions), dict(patch))
        except PatchError as e:
            raise Rejected(TrialState.REJECTED_STRUCTURE, str(e)) from None


def lower(kernel_cu: str, reference: N.Program, target: N.Program, backend, accept, *, out_dir,
          regions=None, reference_name: str = "reference", **options) -> Solution:
    """Patch kernel.cu for `target` with the model behind `backend`; `accept(LowerCandidate) ->
    Outcome` compiles and verifies on the GPU (the tuner's runners). See engine.run_task for
    options (samples, max_retries, sampling, max_model_len, structured)."""
    task = LowerTask(kernel_cu, reference, target, regions=regions, reference_name=reference_name)
    return run_task(task, backend, accept, out_dir=out_dir, **options)
