"""Tile-configuration search spaces, declared once as data; each reference kernel owns one
(cubridge.runtime.kernels, `ReferenceKernel.space`).

A Space is parameters with their choices plus constraints: small pure functions
`(point, head_dim, arch) -> problem | None` that each name their reason (shared-memory limit,
register limit, divisibility). Where a kernel's runtime glue already validates a config, the
constraint calls it rather than restating it. The tuner never compiles a point with a problem.

A point is a plain dict of the runtime's lowercase field names ({"block_m": 128, ...}); `to_cuir`
maps it to the CuIR program's param(...) names, which the checker, interpreter and lowering use.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Param:
    name: str
    choices: tuple


@dataclass(frozen=True)
class Constraint:
    reason: str                                        # "shared memory", "registers", "divisibility"
    check: Callable[[dict, int, str], str | None]      # (point, head_dim, arch) -> problem or None


@dataclass(frozen=True)
class Space:
    kernel: str
    arches: tuple[str, ...]
    head_dims: tuple[int, ...]
    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...]
    to_cuir: Callable[[dict], dict]                    # point -> CuIR param(...) values
    best_known: Callable[[int], list]                  # head_dim -> measured good points (warm start)

    def __repr__(self) -> str:
        ps = ", ".join(f"{p.name}={list(p.choices)}" for p in self.params)
        return f"Space({self.kernel}: {ps}; {len(self.constraints)} constraints)"

    def problems(self, point: dict, head_dim: int, arch: str) -> list[str]:
        """Why `point` cannot build (empty: valid); each problem starts with its reason."""
        if head_dim not in self.head_dims:
            return [f"head dim: {self.kernel} builds head dims {self.head_dims}, not {head_dim}"]
        out = []
        for c in self.constraints:
            problem = c.check(point, head_dim, arch)
            if problem:
                out.append(f"{c.reason}: {problem}")
        return out

    def points(self, head_dim: int, arch: str) -> list[dict]:
        """Every valid point, in a fixed order."""
        names = [p.name for p in self.params]
        grid = (dict(zip(names, vals)) for vals in itertools.product(*(p.choices for p in self.params)))
        return [pt for pt in grid if not self.problems(pt, head_dim, arch)]

    def label(self, point: dict) -> str:
        """Short printable name, e.g. '128x128s2' (+ 'w4' for warps, 'p' for persistent, 'f' for spill_free)."""
        s = f"{point['block_m']}x{point['block_n']}s{point['stages']}"
        if "warps" in point:
            s += f"w{point['warps']}"
        if point.get("persistent"):
            s += "p"
        if point.get("spill_free"):
            s += "f"
        return s
