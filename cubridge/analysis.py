"""Analysis on CuIR: exact FLOPs executed, bytes per memory level, KV tiles visited / skipped,
shared-memory footprint per tile configuration.

Counts come from interpreting the program (so they are exact for the shape analysed, including
causal skipping and ragged tails); the footprint comes from the static checker.

Example:
    >>> from cubridge.cuir.parser import parse_file
    >>> from cubridge.paths import ref_kernel_dir
    >>> from cubridge.verify import Case
    >>> prog = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")
    >>> a = analyze(prog, Case(1, 1, 1, 256, 256, 64), params={"CAUSAL": 0})
    >>> a.kv_tiles_visited, a.kv_tiles_total, a.mma_flops == 4 * 256 * 256 * 64
    (8, 8, True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cubridge.cuir import nodes as N
from cubridge.cuir.checker import check
from cubridge.cuir.interp import Counters, interpret
from cubridge.errors import CubridgeError


@dataclass
class Analysis:
    program: str
    case: object
    params: dict
    counters: Counters
    smem_bytes: int
    kv_tiles_total: int | None
    useful_flops: int | None       # 4 * D * attended pairs, from the spec's mask (None without spec)

    @property
    def mma_flops(self) -> int:
        return self.counters.mma_flops

    @property
    def kv_tiles_visited(self) -> int:
        return self.counters.kv_tiles

    @property
    def kv_tiles_skipped(self) -> int | None:
        return None if self.kv_tiles_total is None else self.kv_tiles_total - self.kv_tiles_visited

    def table(self) -> str:
        c = self.counters
        rows = [("program", self.program), ("shape", str(self.case)),
                ("params", ", ".join(f"{k}={v}" for k, v in self.params.items())),
                ("shared memory / block", f"{self.smem_bytes} B"),
                ("blocks", c.blocks), ("MMA FLOPs executed", f"{c.mma_flops:,}")]
        if self.useful_flops is not None:
            rows.append(("useful FLOPs (attended pairs)", f"{self.useful_flops:,}"))
            if c.mma_flops:
                rows.append(("useful / executed", f"{self.useful_flops / c.mma_flops:.3f}"))
        rows += [(f"bytes {k}", f"{v:,}") for k, v in c.bytes.items()]
        rows.append(("KV tiles visited", c.kv_tiles))
        if self.kv_tiles_total is not None:
            rows.append(("KV tiles skipped", self.kv_tiles_skipped))
        rows.append(("KV tiles masked (partial)", c.masked_tiles))
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def analyze(program: N.Program, case, *, params: dict | None = None, dtype="bf16", spec=None,
            spec_params: dict | None = None, progress=None) -> Analysis:
    """Interpret `program` once at `case` (a verify.Case) on random inputs and report its counts.
    With a spec: a reference kernel is first transferred to the spec (so the counts are those of
    the spec's iteration space, not the kernel's causal one), and a transferred program's extra
    inputs are bound from the spec as the tuner binds them. progress(done, total): called after
    each block the interpreter runs (minutes at N = 8k: the caller says how far it is)."""
    from cubridge.verify import DTYPES, make_inputs
    tdtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    extra = {}
    if spec is not None:
        program, extra = _for_spec(program, spec, spec_params or {}, case, params)
    merged = {**program.params(), **(params or {})}
    report = check(program, params=params, dims={"D": case.D})
    q, k, v = make_inputs(case, tdtype)
    run = interpret(program, {"Q": q, "K": k, "V": v, **extra}, params=params, progress=progress)
    total = None
    if "BLOCK_N" in merged and "NK" in run.dims:
        total = run.counters.blocks * math.ceil(run.dims["NK"] / merged["BLOCK_N"])
    useful = None
    if spec is not None:
        from cubridge.transfer.pairs import count_attended
        hooks = spec.hooks_for(case.Nq, case.Nk, case.Hq, case.Hkv, **(spec_params or {}))
        useful = 4 * case.D * count_attended(hooks, case.B, case.Hq, case.Nq, case.Nk)
    return Analysis(program.name, case, merged, run.counters, report.smem_bytes, total, useful)


def _for_spec(program, spec, spec_params, case, params):
    """(program to analyse, its extra inputs at `case`) for a spec."""
    from cubridge.transfer.binding import binder, extra_inputs, recorded, spec_mismatch
    from cubridge.transfer.rules import transfer
    if recorded(program) is None and not extra_inputs(program):       # a reference kernel
        program = transfer(program, spec, spec_params=spec_params).program
    problem = spec_mismatch(program, spec, spec_params)
    if problem:
        raise CubridgeError(problem)
    bind = binder(program, spec, spec_params)
    extra = bind.bind(Nq=case.Nq, Nk=case.Nk, Hq=case.Hq, Hkv=case.Hkv, B=case.B, params=params) if bind else {}
    return program, extra


def smem_table(program: N.Program, configs: list[dict], D: int) -> list[tuple[dict, int | None, str]]:
    """Shared-memory bytes per block for each tile configuration; (config, bytes, '' or the reason
    it is rejected)."""
    out = []
    for cfg in configs:
        try:
            out.append((cfg, check(program, params=cfg, dims={"D": D}).smem_bytes, ""))
        except CubridgeError as e:
            out.append((cfg, None, e.message))
    return out
