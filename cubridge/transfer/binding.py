"""Extra inputs and spec parameters of a transferred program read back from its text.

A transferred program (`cubridge transfer --out`) declares extra kernel inputs (captured tables
TABLE, shape-dependent scalars C0.., the block table BLOCK_CLASS) and records, in its docstring,
the spec and the spec parameters it was transferred with (constants that did not change between
the probe shapes are baked into its expressions; those that did stay scalar inputs bound at call
time). `binder(program, spec, spec_params)` rebuilds the spec's binding (what the tuner does) and
checks it matches the program's inputs; `spec_mismatch` says when a program is verified against
other spec parameters than the ones baked into it.
"""
from __future__ import annotations

import json
from dataclasses import replace

from cubridge.cuir import nodes as N
from cubridge.errors import CubridgeError
from cubridge.transfer.record import RECORD

_BASE_INPUTS = {"Q", "K", "V"}


def recorded(program: N.Program) -> tuple[str, dict] | None:
    """(spec name, spec parameters) a transferred program records, or None."""
    for st in program.body:
        if isinstance(st, N.Doc) and RECORD in st.text:
            rest = st.text.split(RECORD, 1)[1].strip().splitlines()[0]
            name, _, params = rest.partition(" ")
            try:
                return name, json.loads(params or "{}")
            except json.JSONDecodeError:
                return None
    return None


def spec_mismatch(program: N.Program, spec, spec_params: dict | None) -> str | None:
    """Why verifying `program` against (spec, spec_params) would compare different variants."""
    rec = recorded(program)
    if rec is None:
        return None
    name, baked = rec
    if name != spec.name:
        return (f"spec mismatch: the program was transferred for spec {name!r}, not {spec.name!r} "
                f"(transfer it again: cubridge transfer {spec.name} --out ...)")
    asked = json.loads(json.dumps({**spec.params, **(spec_params or {})}, sort_keys=True, default=list))
    diff = {k: (baked.get(k), asked.get(k)) for k in sorted(set(baked) | set(asked)) if baked.get(k) != asked.get(k)}
    if not diff:
        return None
    parts = ", ".join(f"{k}: program {a!r}, asked {b!r}" for k, (a, b) in diff.items())
    fix = " ".join(f"--spec-param {k}={a}" for k, (a, _) in diff.items() if a is not None)
    return (f"spec parameter mismatch: the program has spec parameters baked in ({parts}); "
            f"verify with {fix or 'the recorded parameters'}, or transfer again with the new values")


def extra_inputs(program: N.Program) -> set[str]:
    """Names of the kernel inputs beyond Q, K, V."""
    out = set()
    for st in program.body:
        if isinstance(st, N.Assign) and isinstance(st.value, N.Call) and \
                st.value.op in ("global_input", "scalar_input"):
            out |= set(st.targets)
    return out - _BASE_INPUTS


def spec_binder(program: N.Program, spec, spec_params: dict | None = None, params: dict | None = None):
    """`binder(case) -> extra inputs` for verify_program, or None when the program has none."""
    cand = binder(program, spec, spec_params)
    if cand is None:
        return None
    return lambda case: cand.bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B, params=params)


def binder(program: N.Program, spec, spec_params: dict | None = None):
    """A Candidate whose bind() gives `program`'s extra inputs at a shape, or None when it has
    none. Raises CubridgeError when the spec binds other inputs than the program declares."""
    extra = extra_inputs(program)
    if not extra:
        return None
    from cubridge.cuir.parser import parse_file
    from cubridge.paths import ref_kernel_dir
    from cubridge.transfer.rules import transfer
    ref = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")    # the binding depends on the spec only
    cand = transfer(ref, spec, spec_params=spec_params)
    want = extra_inputs(cand.program)
    if want != extra:
        raise CubridgeError(f"{program.source or program.name}: the program's extra inputs {sorted(extra)} are not "
                            f"the ones spec {spec.name!r} binds ({sorted(want)})",
                            hint=f"transfer the program from this spec: cubridge transfer {spec.name} --out FILE")
    return replace(cand, program=program)       # bind() reads BLOCK_M / BLOCK_N from this program
