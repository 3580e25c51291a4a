"""The record a transfer leaves in its program's docstring: the spec and the spec parameters it was
transferred with (read back by transfer/binding.py). Its own module so that the rules transfer,
which writes it, and binding.py, which re-runs the transfer to bind a program, do not import each
other."""
from __future__ import annotations

import json
from dataclasses import replace

from cubridge.cuir import nodes as N

RECORD = "cubridge-spec:"


def record_text(spec, spec_params: dict) -> str:
    """The docstring line a transfer adds: spec name and its parameters (defaults resolved)."""
    params = {**spec.params, **(spec_params or {})}
    return f"{RECORD} {spec.name} {json.dumps(params, sort_keys=True, default=list)}"


def add_record(program: N.Program, spec, spec_params: dict) -> N.Program:
    """The program with the record appended to its first docstring (or a new one first)."""
    line = record_text(spec, spec_params)
    body = list(program.body)
    for i, st in enumerate(body):
        if isinstance(st, N.Doc):
            body[i] = replace(st, text=st.text.rstrip() + "\n\n" + line + "\n")
            return replace(program, body=tuple(body))
    return replace(program, body=(N.Doc(line),) + tuple(body))
