"""Constructs an LLM's kernel.cu patch may not contain, whatever it computes (issue 20, item 3).

A patch replaces the contents of marked regions (device helper functions). The GPU check sees what a
kernel writes at its check shapes; it cannot see a patch that changes what is timed rather than what
is computed, or that carries state from one launch to the next. Those are refused here, on CPU,
before anything is compiled: host API calls (extra streams, events, allocations, copies), clocks
and sleeps (timing), static or __device__ variables (a result cached across launches), printf.
Inline asm stays allowed (fa3_sm90's epilogue uses it), but not asm that reads the clocks.

Example:
    >>> forbidden({"softmax": "  cudaEventRecord(e, 0);"})[0][:46]
    'region softmax: host API call cudaEventRecord('
    >>> forbidden({"softmax": "  float p = exp2f(s - m);"})
    []
"""
from __future__ import annotations

import re

FORBIDDEN = [
    (r"\bcu(?:da)?[A-Z]\w*\s*\(", "host API call {} (streams, events, allocations are not a kernel's business)"),
    (r"\bclock(?:64)?\s*\(|%globaltimer|%clock", "clock read {} (a kernel may not watch or shape its own timing)"),
    (r"__nanosleep\s*\(", "sleep {} (changes timing, not the result)"),
    (r"\bstatic\b", "static storage {} (state kept across launches: a cached result)"),
    (r"__device__\s+(?:__\w+__\s+|const\s+)*[\w:<>]+\s+\w+\s*(?:\[|=|;)", "device variable {} (state kept across launches)"),
    (r"\bprintf\s*\(", "printf {}"),
    (r"\bmalloc\s*\(|\bnew\s+\w", "allocation {}"),
]


def forbidden(patch: dict) -> list[str]:
    """What the patch's region contents hold of FORBIDDEN, region by region (empty: nothing)."""
    out = []
    for name, body in patch.items():
        for pattern, what in FORBIDDEN:
            m = re.search(pattern, body if isinstance(body, str) else "")
            if m:
                out.append(f"region {name}: " + what.format(m.group(0).strip()))
    return out
