"""Tile-configuration search spaces, one per reference kernel, declared once as data.

A Space is parameters with their choices plus constraints: small pure functions
`(point, head_dim, arch) -> problem | None` that each name their reason (shared-memory limit,
register limit, divisibility). Where a kernel's runtime glue already validates a config
(`cubridge/runtime/fa2_sm80.py` Config.problems, `fa3_sm90.py` Fa3Config.smem_bytes), the
constraint calls it rather than restating it. The tuner never compiles a point with a problem.

A point is a plain dict of the runtime's lowercase field names ({"block_m": 128, ...}); `to_cuir`
maps it to the CuIR program's param(...) names, which the checker, interpreter and lowering use.

Example:
    >>> s = SPACES["fa3_sm90"]
    >>> s.problems({"block_m": 128, "block_n": 256, "stages": 2, "persistent": False}, 128, "sm_90a")[0][:9]
    'registers'
    >>> len(s.points(128, "sm_90a")) > 10
    True
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from cubridge.runtime import fa2_sm80, fa3_sm90

# Opt-in shared memory per block by target arch (the runtime's table, keyed by capability).
ARCH_CAPABILITY = {"sm_80": (8, 0), "sm_90a": (9, 0)}


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
        """Short printable name, e.g. '128x128s2' (+ 'w4' for warps, 'p' for persistent)."""
        s = f"{point['block_m']}x{point['block_n']}s{point['stages']}"
        if "warps" in point:
            s += f"w{point['warps']}"
        if point.get("persistent"):
            s += "p"
        return s


def smem_limit(arch: str) -> int:
    return fa2_sm80.SMEM_OPTIN[ARCH_CAPABILITY[arch]]


# ------------------------------------------------------------------ fa2_sm80
def fa2_config(point: dict) -> fa2_sm80.Config:
    """The runtime's Config for a point (its validation and -D flags are the kernel's own)."""
    return fa2_sm80.Config(point["block_m"], point["block_n"], point["stages"], point["warps"])


def _fa2_static_asserts(point, head_dim, arch):
    """kernel.cu's static_asserts (divisibility, copy passes, register and shared-memory budgets),
    as the runtime's Config.problems states them."""
    problems = fa2_config(point).problems(head_dim, smem_limit(arch))
    return "; ".join(problems) or None


FA2_SM80 = Space(
    kernel="fa2_sm80",
    arches=("sm_80", "sm_90a"),
    head_dims=fa2_sm80.HEAD_DIMS,
    params=(Param("block_m", (64, 128, 256)), Param("block_n", (32, 64, 128)),
            Param("stages", (2, 3, 4)), Param("warps", (4, 8))),
    constraints=(Constraint("kernel static_asserts", _fa2_static_asserts),),
    to_cuir=lambda p: {"BLOCK_M": p["block_m"], "BLOCK_N": p["block_n"], "STAGES": p["stages"], "WARPS": p["warps"]},
    best_known=lambda d: [_fa2_point(fa2_sm80.default_config(d))],
)


def _fa2_point(c: fa2_sm80.Config) -> dict:
    return {"block_m": c.block_m, "block_n": c.block_n, "stages": c.stages, "warps": c.warps}


# ------------------------------------------------------------------ fa3_sm90
# Spill-free accumulator budget per consumer thread, by consumer count. Measured on sm_90a
# (ref_kernels/fa3_sm90/README.md, NOTES.md v2): 3 consumers (160 regs after setmaxnreg) spill at
# D=64 BLOCK_N=144 (estimate 140) and not at BLOCK_N=128 (128); 2 consumers (232 regs) compile
# spill-free at D=128 BLOCK_N=176 (196) and spill at BLOCK_N=256 (224 at D=64).
FA3_ACC_REG_BUDGET = {2: 196, 3: 128}


def fa3_acc_regs(block_n: int, head_dim: int) -> int:
    """fp32 O (64 x D) and S (64 x BLOCK_N) plus bf16x2-packed P, per thread of a 128-thread consumer."""
    rows, threads = fa3_sm90.WG_ROWS, fa3_sm90.WG_THREADS
    return rows * (head_dim + block_n) // threads + rows * block_n // (2 * threads)


def fa3_config(point: dict, head_dim: int) -> fa3_sm90.Fa3Config:
    """The runtime's Fa3Config for a point (its shared-memory arithmetic and -D flags)."""
    return fa3_sm90.Fa3Config(head_dim=head_dim, block_m=point["block_m"], block_n=point["block_n"],
                              stages=point["stages"], persistent=bool(point.get("persistent")))


def _fa3_smem(point, head_dim, arch):
    need = fa3_config(point, head_dim).smem_bytes
    if need > fa3_sm90.SMEM_LIMIT:
        return f"{need} B of tiles and barriers over the {fa3_sm90.SMEM_LIMIT} B per-block limit"
    return None


def _fa3_registers(point, head_dim, arch):
    consumers = point["block_m"] // fa3_sm90.WG_ROWS
    budget = FA3_ACC_REG_BUDGET.get(consumers)
    if budget is None:
        return f"{consumers} consumer warpgroups: the kernel has register budgets for 2 or 3"
    need = fa3_acc_regs(point["block_n"], head_dim)
    if need > budget:
        return f"~{need} accumulator registers per consumer thread > {budget} measured spill-free with {consumers} consumers"
    return None


def _fa3_divisibility(point, head_dim, arch):
    if point["block_m"] % fa3_sm90.WG_ROWS:
        return f"block_m {point['block_m']} is not a multiple of {fa3_sm90.WG_ROWS} rows per consumer"
    if point["block_n"] % 16 or not 16 <= point["block_n"] <= 256:
        return f"block_n {point['block_n']} must be a multiple of 16 (wgmma K) in [16, 256]"
    if point["stages"] < 2:
        return "stages must be >= 2 so loads overlap compute"
    return None


# Measured best beyond the runtime defaults: three consumers at D = 128 for a normalisation with
# two transcendentals per score (composite: 0.83-0.86x of causal softmax at 8k vs 0.78-0.82x at
# 128 x 128, H100, experiments/results/variant_tiles_192_h100/ and session5_close_h100/).
_FA3_EXTRA_KNOWN = {128: [{"block_m": 192, "block_n": 80, "stages": 2, "persistent": True}]}


def _fa3_best_known(head_dim: int) -> list[dict]:
    """The runtime's measured defaults for causal and non-causal masks at short and long N, then
    the configs measured best for particular variants (_FA3_EXTRA_KNOWN)."""
    out = []
    for causal, n in itertools.product((True, False), (1024, 8192)):
        c = fa3_sm90.default_config(head_dim, causal, seqlen=n)
        pt = {"block_m": c.block_m, "block_n": c.block_n, "stages": c.stages, "persistent": c.persistent}
        if pt not in out:
            out.append(pt)
    return out + [pt for pt in _FA3_EXTRA_KNOWN.get(head_dim, []) if pt not in out]


FA3_SM90 = Space(
    kernel="fa3_sm90",
    arches=("sm_90a",),
    head_dims=fa3_sm90.SUPPORTED_HEAD_DIMS,
    params=(Param("block_m", (128, 192)), Param("block_n", (64, 80, 96, 112, 128, 144, 160, 176, 192)),
            Param("stages", (2, 3, 4)), Param("persistent", (False, True))),
    constraints=(Constraint("divisibility", _fa3_divisibility), Constraint("shared memory", _fa3_smem),
                 Constraint("registers", _fa3_registers)),
    to_cuir=lambda p: {"BLOCK_M": p["block_m"], "BLOCK_N": p["block_n"], "STAGES": p["stages"],
                       "CONSUMERS": p["block_m"] // fa3_sm90.WG_ROWS},
    best_known=_fa3_best_known,
)

SPACES = {s.kernel: s for s in (FA2_SM80, FA3_SM90)}
