"""Prompts, from the files in `cubridge/llm/prompts/` and data the project already has: the op set
(`cuir.nodes.OPS`), the rule taxonomy (`transfer.taxonomy.TAXONOMY`), a worked example made by the
rules proposer, the reference CuIR and the spec's PyTorch source.

Templates use `$name` placeholders (string.Template), so the braces of JSON, CUDA and CuIR in them
need no escaping.

Example:
    >>> "mask_predicate" in render_taxonomy()
    True
    >>> render("retry", stage="interpreter", error="max err 0.8", advice="", artifact="program").splitlines()[0]
    'Your previous answer was rejected.'
"""
from __future__ import annotations

import difflib
from functools import lru_cache
from importlib import resources
from string import Template

from cubridge.cuir import nodes as N
from cubridge.vocab import TrialState
from cubridge.transfer.taxonomy import TAXONOMY

# What to tell the model about each kind of rejection, beside the error itself.
ADVICE = {
    TrialState.REJECTED_PARSE: ("parser", "The text is not valid CuIR (see the syntax in the system message): "
                                "no imports, attributes, methods or Python builtins; op calls only."),
    TrialState.REJECTED_CHECK: ("static checker", "The program parses but is ill-formed: check shapes, dtypes, "
                                "memory spaces, waits and barriers at the line named."),
    TrialState.REJECTED_STRUCTURE: ("taxonomy checker", "You changed something the rule taxonomy does not allow. "
                                    "Start again from the reference program and change only the contents of "
                                    "the rewritable regions."),
    TrialState.WRONG_ANSWER: ("verification", "The program ran but its output differs from the variant's "
                              "PyTorch reference (or faulted). Re-read the reference: which pairs (q, kv) are "
                              "attended, how scores are transformed, how they are normalised."),
    TrialState.COMPILE_ERROR: ("compiler", "The CUDA compiler rejected the code; the log names the line."),
    TrialState.CRASH: ("GPU run", "The kernel crashed on the GPU (illegal address, misaligned access, ...): "
                       "check bounds and indexing."),
}


@lru_cache(maxsize=None)
def template(name: str) -> Template:
    return Template(resources.files("cubridge.llm").joinpath("prompts", f"{name}.md").read_text(encoding="utf-8"))


def render(prompt: str, /, **values) -> str:
    """Fill a prompt file's placeholders; a missing value is a KeyError (a bug, not user input)."""
    return template(prompt).substitute(**values).strip() + "\n"


def render_ops() -> str:
    lines = []
    for name, spec in N.OPS.items():
        params = [p.rstrip("?") + ("=None" if p.endswith("?") else "") for p in spec.params]
        params += [f"{k}=..." for k in spec.kwargs]
        doc = f": {spec.doc}" if spec.doc else ""
        lines.append(f"- {name}({', '.join(params)}){doc}")
    return "\n".join(lines)


def render_taxonomy() -> str:
    lines = []
    for i, rule in enumerate(TAXONOMY, 1):
        where = f"regions {', '.join(rule.regions)}" if rule.regions else "declarations before grid(...)"
        lines.append(f"{i}. {rule.name} ({where}): {rule.doc}; ops allowed there: {', '.join(rule.ops)}")
    return "\n".join(lines)


def system_message() -> dict:
    return {"role": "system", "content": render("system", ops=render_ops(), regions=", ".join(N.REGIONS))}


def retry_message(state: TrialState, error: str, artifact: str) -> dict:
    stage, advice = ADVICE.get(state, (state.value, ""))
    return {"role": "user", "content": render("retry", stage=f"{stage} ({state.value})", error=error.strip(),
                                              advice=advice, artifact=artifact)}


def unified_diff(before: str, after: str, a: str = "reference", b: str = "target", context: int = 2) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=a, tofile=b, n=context)).rstrip("\n")


def numbered(text: str) -> str:
    """Source lines with their 1-based numbers, for prompts that refer to lines."""
    lines = text.splitlines()
    width = len(str(len(lines)))
    return "\n".join(f"{i:>{width}}| {line}" for i, line in enumerate(lines, 1))
