"""Find and replace the marked regions of a reference kernel (`// @cuir-region NAME` ...
`// @cuir-end NAME`): the lifting map that makes lowering reference-guided."""
from __future__ import annotations

import re

from cubridge.lower.cexpr import LowerError

_BEGIN = re.compile(r"^[ \t]*// @cuir-region (\w+)[ \t]*$", re.M)


def spans(source: str) -> dict[str, tuple[int, int]]:
    """Region name -> (start, end) offsets of its body (between the marker lines)."""
    out = {}
    for m in _BEGIN.finditer(source):
        name = m.group(1)
        end = re.compile(rf"^[ \t]*// @cuir-end {name}[ \t]*$", re.M).search(source, m.end())
        if end is None:
            raise LowerError(f"region {name!r} has no // @cuir-end {name} marker")
        if name in out:
            raise LowerError(f"region {name!r} is marked twice")
        out[name] = (m.end() + 1, end.start())
    return out


def body(source: str, name: str) -> str:
    s, e = spans(source)[name]
    return source[s:e]


def replace(source: str, new_bodies: dict[str, str]) -> str:
    """Source with the named regions' bodies replaced (markers kept)."""
    sp = spans(source)
    missing = set(new_bodies) - set(sp)
    if missing:
        raise LowerError(f"the reference kernel has no region(s) {sorted(missing)}")
    out, pos = [], 0
    for name, (s, e) in sorted(sp.items(), key=lambda kv: kv[1][0]):
        if name in new_bodies:
            text = new_bodies[name]
            out.append(source[pos:s])
            out.append(text if text.endswith("\n") else text + "\n")
            pos = e
    out.append(source[pos:])
    return "".join(out)
