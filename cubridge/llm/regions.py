"""The marked regions of a CUDA kernel (`// @cuir-region NAME` ... `// @cuir-end NAME`), patches
that replace their contents, and the check that a patched file changed nothing else.

A marker is a line holding only the marker comment (indentation allowed); a mention of the marker
syntax inside other text (the header's explanation) is not one. Region names are unique within a
file, regions do not nest, and every region is closed.

Example:
    >>> src = "int a;\\n// @cuir-region mask\\nreturn true;\\n// @cuir-end mask\\nint b;\\n"
    >>> print(apply_patch(src, {"mask": "return kv <= q;"}), end="")
    int a;
    // @cuir-region mask
    return kv <= q;
    // @cuir-end mask
    int b;
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from cubridge.errors import CubridgeError

_OPEN = re.compile(r"^\s*//\s*@cuir-region\s+(\w+)\s*$")
_CLOSE = re.compile(r"^\s*//\s*@cuir-end\s+(\w+)\s*$")
_ANY_MARKER = re.compile(r"^\s*//\s*@cuir-(region|end)\b")


class PatchError(CubridgeError):
    """A patch (or a marked file) is malformed, names an unknown region, or changes code outside
    the marked regions."""


@dataclass(frozen=True)
class Span:
    """A marked region: 0-based indices of its marker lines; the contents lie strictly between."""
    name: str
    open: int
    close: int

    @property
    def body(self) -> range:
        return range(self.open + 1, self.close)


def find_regions(text: str, source: str = "kernel.cu") -> dict[str, Span]:
    """The marked regions of a CUDA source, by name, in file order."""
    spans, current = {}, None
    for i, line in enumerate(text.splitlines()):
        m_open, m_close = _OPEN.match(line), _CLOSE.match(line)
        if m_open:
            name = m_open.group(1)
            if current is not None:
                raise PatchError(f"region {name!r} opens inside region {current[0]!r}", where=f"{source}:{i + 1}",
                                 hint="regions do not nest: close the first one before opening the next")
            if name in spans:
                raise PatchError(f"region {name!r} is marked twice", where=f"{source}:{i + 1}",
                                 hint="each region name marks one range of the file")
            current = (name, i)
        elif m_close:
            name = m_close.group(1)
            if current is None or current[0] != name:
                raise PatchError(f"`@cuir-end {name}` closes no open region {name!r}", where=f"{source}:{i + 1}")
            spans[name] = Span(name, current[1], i)
            current = None
    if current is not None:
        raise PatchError(f"region {current[0]!r} is never closed", where=f"{source}:{current[1] + 1}",
                         hint=f"add `// @cuir-end {current[0]}`")
    return spans


def region_text(text: str, name: str) -> str:
    span = find_regions(text)[name]
    return "\n".join(text.splitlines()[span.open + 1:span.close])


def apply_patch(text: str, patch: dict[str, str], allowed=None) -> str:
    """Replace the contents of the named regions (markers kept). `allowed` limits the names a
    patch may touch. Raises PatchError for an unknown or disallowed region or a body that holds
    marker lines."""
    spans = find_regions(text)
    for name, body in patch.items():
        if name not in spans:
            raise PatchError(f"the patch names region {name!r}, which the kernel does not mark",
                             hint=f"marked regions: {', '.join(spans) or 'none'}")
        if allowed is not None and name not in allowed:
            raise PatchError(f"the patch rewrites region {name!r}, which did not change in the CuIR",
                             hint=f"rewrite only: {', '.join(sorted(allowed))}")
        if any(_ANY_MARKER.match(line) for line in body.splitlines()):
            raise PatchError(f"the new contents of region {name!r} hold a @cuir marker line",
                             hint="give only the lines between the markers")
    lines = text.splitlines()
    out, i = [], 0
    for span in sorted((spans[n] for n in patch), key=lambda s: s.open):
        out += lines[i:span.open + 1] + patch[span.name].strip("\n").splitlines()
        i = span.close
    out += lines[i:]
    patched = "\n".join(out) + ("\n" if text.endswith("\n") else "")
    check_confined(text, patched)
    return patched


def check_confined(original: str, patched: str) -> None:
    """Raise PatchError unless `patched` differs from `original` only inside marked regions'
    contents, with the same regions marked in the same order."""
    before, after = find_regions(original), find_regions(patched, "patched kernel.cu")
    if list(before) != list(after):
        raise PatchError(f"the patch changed the marked regions: {list(before)} -> {list(after)}",
                         hint="keep every marker line as it is")
    a, b = _outside(original, before), _outside(patched, after)
    for (line, x), (_, y) in zip(a, b):
        if x != y:
            raise PatchError(f"the patch changes line {line} of the kernel, outside every marked region: "
                             f"{x.strip()[:80]!r}",
                             hint="only the lines between `// @cuir-region NAME` and `// @cuir-end NAME` may change")
    if len(a) != len(b):
        line = a[min(len(a), len(b)) - 1][0] if a else 1
        raise PatchError(f"the patch adds or removes lines after line {line} of the kernel, outside every "
                         "marked region", hint="only the lines between the markers may change")


def _outside(text: str, spans: dict) -> list:
    """(1-based line number, line) of every line outside the regions' contents."""
    inside = {i for s in spans.values() for i in s.body}
    return [(i + 1, line) for i, line in enumerate(text.splitlines()) if i not in inside]


def marked_blocks(text: str) -> dict[str, str]:
    """Region bodies written out with their markers inside an answer (the fallback format)."""
    out, current, body = {}, None, []
    for line in text.splitlines():
        m_open, m_close = _OPEN.match(line), _CLOSE.match(line)
        if m_open and current is None:
            current, body = m_open.group(1), []
        elif m_close and current == m_close.group(1):
            out[current] = "\n".join(body)
            current = None
        elif current is not None:
            body.append(line)
    return out


def annotate(text: str, ranges: dict[str, tuple[int, int]]) -> str:
    """Insert region markers around 1-based inclusive line ranges (a lifting map), indented like
    the range's first line. Raises PatchError for a range outside the file or overlapping another."""
    lines = text.splitlines()
    order = sorted(ranges.items(), key=lambda kv: kv[1][0])
    prev_end, prev = 0, None
    for name, (lo, hi) in order:
        if not 1 <= lo <= hi <= len(lines):
            raise PatchError(f"region {name!r}: lines {lo}-{hi} are not a range of the {len(lines)}-line source")
        if lo <= prev_end:
            raise PatchError(f"region {name!r} (lines {lo}-{hi}) overlaps region {prev!r}",
                             hint="regions are disjoint line ranges")
        prev_end, prev = hi, name
    out, i = [], 0
    for name, (lo, hi) in order:
        indent = re.match(r"\s*", lines[lo - 1]).group(0)
        out += lines[i:lo - 1] + [f"{indent}// @cuir-region {name}"] + lines[lo - 1:hi] + [f"{indent}// @cuir-end {name}"]
        i = hi
    out += lines[i:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def strip_markers(text: str) -> str:
    """The source without its marker lines (what a user's kernel looks like before lifting)."""
    keep = [line for line in text.splitlines() if not (_OPEN.match(line) or _CLOSE.match(line))]
    return "\n".join(keep) + ("\n" if text.endswith("\n") else "")
