"""The forward's side of expkit.sass_stalls (issue 19, D 256): each SASS instruction of a Hopper
forward kernel (ours fa3_sm90_fwd, FA4's FlashAttentionForwardSm90) gets a phase of the KV step from
its opcode, its operands and the landmarks before it; executed instructions are summed per opcode
class; and the tile model counts the KV steps of a causal launch (what the per-step numbers divide
by) and the tail of a greedy longest-first schedule. tests/cpu/test_sass_stalls_fwd.py checks it.

Phases: a warpgroup that waits for its wgmma parks on WARPGROUP.DEPBAR (wait_group 1 = the QK of
the step with the P V still queued; wait_group 0 = the P V, or a lone QK); a warp waiting for a
TMA (K / V / Q full) or for a free slot (the producer) spins on SYNCS ... TRYWAIT and its retry
branch; the turns / epilogue on BAR; the softmax is MUFU.EX2 and the FFMA / FADD around it, the
row max FMNMX and SHFL; the O rescale FMUL runs of 16 or more; P's conversion F2FP.
"""
from __future__ import annotations

import collections
import math
import re

from expkit.sass_stalls import _landmark

CLASSES = {"hgmma": ("HGMMA",), "mufu": ("MUFU",), "fp32": ("FFMA", "FMUL", "FADD", "FSEL", "FMNMX", "FSETP"),
           "convert": ("F2FP",), "shuffle": ("SHFL",),
           "sync": ("BAR", "SYNCS", "WARPGROUP", "MEMBAR", "FENCE", "DEPBAR"),
           "int": ("IMAD", "VIADD", "LOP3", "SHF", "IADD3", "LEA", "ISETP", "SEL", "PRMT", "PLOP3", "MOV", "CS2R",
                   "IABS", "I2F", "F2I"),
           "memory": ("LDS", "STS", "STSM", "LDSM", "LDG", "STG", "LDL", "STL", "UTMALDG", "UTMASTG"),
           "branch": ("BRA", "BSSY", "BSYNC", "EXIT", "YIELD", "WARPSYNC", "NOP")}


def op_class(op: str) -> str:
    base = op.split(".")[0]
    if base.startswith("U") and base not in ("UTMALDG", "UTMASTG"):
        return "uniform"
    if base in ("R2UR", "S2UR", "S2R", "ELECT", "VOTEU"):
        return "uniform"
    return next((c for c, ops in CLASSES.items() if base in ops), "other")


LABEL = re.compile(r"^(\.L_x_\d+):")


def parse_listing(text: str) -> list[tuple[int, str, int | None]]:
    """(address, opcode, branch target address or None) per instruction of a SASS listing (cuobjdump or
    nvdisasm -c: targets as addresses or .L_x_ labels); experiments/sass_step_count_fwd.py's loops."""
    from expkit import SASS_INSN
    rows, labels, pending = [], {}, []
    for line in text.splitlines():
        m = LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = SASS_INSN.match(line)
        if not m:
            continue
        addr, op, rest = int(m.group(1), 16), m.group(2), m.group(3)
        for name in pending:
            labels[name] = addr
        pending = []
        target = re.search(r"(\.L_x_\d+)|\b0x([0-9a-f]+)\b", rest) if op.startswith("BRA") else None
        rows.append((addr, op, target.group(1) or int(target.group(2), 16) if target else None))
    return [(a, op, labels.get(t) if isinstance(t, str) else t) for a, op, t in rows]


def phase_of(op: str, recent: list[str], sass: str = "") -> str:
    """The phase of one instruction of the forward's step (see the module's docstring)."""
    own = _landmark(op)
    last = recent[-1] if recent else None
    if own == "mbar_wait" or (op == "BRA" and last == "mbar_wait"):
        return "mbarrier wait (K/V/Q full, slot empty, tile)"
    if own == "bar":
        return "named barrier (turn / epilogue)"
    if own == "wgmma_wait":
        # WARPGROUP.DEPBAR.LE gsb0, 0x1 = wait_group 1 (the QK; the P V may stay queued)
        return "wgmma wait 1 (QK)" if re.search(r",\s*0x1\s*;?\s*$", sass) else "wgmma wait 0 (P V / all)"
    if own == "hgmma":
        return "HGMMA issue"
    if op.startswith("WARPGROUP.ARRIVE"):
        return "HGMMA issue"
    if own == "exp2" or op.startswith("FADD"):
        return "softmax exp2 / row sum"
    if op.startswith(("FMNMX", "SHFL")):
        return "row max (FMNMX / SHFL)"
    if op.startswith("F2FP"):
        return "convert P / O (F2FP)"
    if op.startswith(("FMUL", "FFMA")):
        return "FMUL / FFMA (scale, rescale)"
    if op.startswith(("STS", "STSM", "UTMASTG", "STG")) or op.startswith("UTMACMDFLUSH") or "exit" in recent[-2:]:
        return "epilogue (O stage / store)"
    if op.startswith("UTMALDG"):
        return "producer TMA issue"
    if last == "wgmma_wait":
        return "after a wgmma wait (first use of its result)"
    return "other"


def fmul_runs(rows: list[dict], at_least: int = 16) -> None:
    """Relabels runs of >= at_least consecutive FMUL (O's rescale, 128 a thread at D 256; the
    epilogue's normalisation) so that the rescale stands apart from the scale FFMA / FMUL."""
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j]["opcode"].startswith("FMUL"):
            j += 1
        if j - i >= at_least:
            for r in rows[i:j]:
                r["phase"] = "O rescale (FMUL run)"
        i = max(j, i + 1)


def executed_by_class(rows: list[dict]) -> dict:
    """Warp-level instructions executed per opcode class (ncu's Instructions Executed per PC)."""
    out: dict[str, int] = {}
    for r in rows:
        c = op_class(r["opcode"])
        out[c] = out.get(c, 0) + r["executed"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def causal_steps(n: int, bm: int, bn: int) -> list[int]:
    """KV tiles each query block of a causal N x N head visits, bottom-right aligned."""
    return [math.ceil(min(n, (m + 1) * bm) / bn) for m in range(math.ceil(n / bm))]


def section_heads(n: int, d: int = 256, elem: int = 2, l2_bytes: int = 50 << 20) -> int:
    """Heads a section of kernel.cu's TILE_SECTIONS order holds: the largest power of two whose K and V
    (n keys, d columns each) fit in l2_bytes, at least 1."""
    fit = l2_bytes // (n * 2 * d * elem)
    return 1 if fit < 2 else 1 << (fit.bit_length() - 1)


def tile_order(per_head: list[int], heads: int, order: str, section: int = 1) -> list[int]:
    """The KV steps of every tile in the order a dynamic scheduler hands them out: "lpt" all tiles longest
    first; "heads" head by head, longest first inside a head (the dense kernel's default order, decode_tile);
    "sections" `section` heads at a time, longest first inside a section with heads minor (TILE_SECTIONS)."""
    by_len = sorted(range(len(per_head)), key=lambda m: -per_head[m])
    if order == "lpt":
        return sorted(per_head * heads, reverse=True)
    if order == "heads":
        section = 1
    elif order != "sections":
        raise ValueError(f"order {order!r}: lpt, heads or sections")
    return [per_head[m] for s0 in range(0, heads, section) for m in by_len for _ in range(s0, min(heads, s0 + section))]


def tile_model(n: int, bm: int, bn: int, heads: int, sms: int = 132, tile_cost: float = 0.0,
               order: str = "lpt", section: int | None = None) -> dict:
    """Tiles, KV steps and the makespan (in KV steps) of a greedy schedule on `sms` CTAs of the tiles in
    `order` (tile_order; FA4's one-tile-per-CTA LPT launch is a greedy list schedule of sections too, and
    ours persistent is one of its order: "heads" by default, "sections" with TILE_SECTIONS, whose section
    defaults to section_heads(n)); tile_cost: fixed steps a tile costs beyond its KV steps (drain,
    epilogue, Q load). efficiency = ideal / makespan, ideal = all steps / sms."""
    import heapq
    per_head = causal_steps(n, bm, bn)
    tiles = tile_order(per_head, heads, order, section or section_heads(n))
    free = [0.0] * sms
    heapq.heapify(free)
    for s in tiles:
        heapq.heappush(free, heapq.heappop(free) + s + tile_cost)
    makespan = max(free)
    total = sum(tiles) + tile_cost * len(tiles)
    return {"tiles": len(tiles), "steps": sum(tiles), "steps_per_tile_max": tiles[0],
            "steps_per_tile_mean": round(sum(tiles) / len(tiles), 2), "tiles_per_cta": round(len(tiles) / sms, 2),
            "steps_per_cta": round(total / sms, 1), "makespan_steps": round(makespan, 1),
            "efficiency": round(total / sms / makespan, 4)}


# ------------------------------------------------------------------ the steady KV step of a listing (static count)
# experiments/sass_step_count_fwd.py (and sass_step_count.py --fwd, the D 256 command line) count with these: the
# innermost backward branch whose body holds both a QK HGMMA (A from shared memory: `gdesc[UR..], R|RZ`) and a P V
# HGMMA (A from registers: `R.., R.., gdesc`), the last in the listing where several qualify (FA4 peels a masked
# loop before its steady one), less every forward span in it with >= 16 FSEL (ours' mask pass of a partial tile).
def counts(body: list[str]) -> dict:
    classes = collections.Counter(op_class(op) for op in body)
    ops = collections.Counter(op.split(".")[0] for op in body)
    return dict(instructions=len(body), classes=dict(classes.most_common()), opcodes=dict(ops.most_common()))


def d256_config(row: str):
    """A bench_d256 row (expkit.d256.parse_row: 128x80fr, 128x80fru ...) at D 256 causal."""
    from cubridge.runtime.fa3_sm90 import Fa3Config
    from expkit.d256 import parse_row
    bm, bn, options = parse_row(row)
    return Fa3Config(**{**dict(head_dim=256, block_m=bm, block_n=bn, stages=2, causal=True, bf16=True), **options})


def hgmma_operands(text: str) -> tuple[list[int], list[int]]:
    """Addresses of the QK HGMMAs (both operands in shared memory) and of the P V HGMMAs (A from registers)."""
    from expkit import SASS_INSN
    hgmma = [(int(m.group(1), 16), m.group(3)) for m in map(SASS_INSN.match, text.splitlines())
             if m and m.group(2).startswith("HGMMA")]
    ss = [a for a, rest in hgmma if re.search(r"gdesc\[UR\d+\], R", rest)]
    rs = [a for a, rest in hgmma if re.search(r"\bR\d+, R\d+, gdesc", rest)]
    return ss, rs


def steady_loop(text: str) -> list[str]:
    ins = parse_listing(text)
    ss, rs = hgmma_operands(text)
    loops = []
    for i, (a, op, t) in enumerate(ins):
        # (a BRA right after a BRA: the mbarrier retry stub's return into the loop, not a loop)
        if op.startswith("BRA") and t is not None and t < a and not ins[i - 1][1].startswith("BRA"):
            if any(t <= h <= a for h in ss) and any(t <= h <= a for h in rs):
                loops.append((t, a))
    if not loops:
        raise SystemExit("error: no loop with both a QK and a P V HGMMA in the listing (not the forward kernel?)")
    head, end = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)][-1]
    # the mask pass (a forward span with >= 16 FSEL: ours' partial tiles) is not a dense step's path
    skip = []
    for a, op, t in ins:
        if op.startswith("BRA") and head < a < end and t is not None and a < t <= end:
            if sum(o.startswith("FSEL") for b, o, _ in ins if a < b < t) >= 16:
                skip.append((a, t))
    return [op for a, op, _ in ins if head <= a <= end and not any(s < a < t for s, t in skip)]


def counts(body: list[str]) -> dict:
    classes = collections.Counter(op_class(op) for op in body)
    ops = collections.Counter(op.split(".")[0] for op in body)
    return dict(instructions=len(body), classes=dict(classes.most_common()), opcodes=dict(ops.most_common()))


def fwd_step_counts(text: str) -> dict:
    """counts() of a listing's steady step (sass_step_count.py --fwd and the D 256 tests call this)."""
    return counts(steady_loop(text))


def fwd_listing(cfg, work, name: str) -> tuple[str, list[str]]:
    """fa3_sm90_fwd's SASS for `cfg` (the cubin's tile-count kernel left out) and ptxas's spill lines."""
    import subprocess

    from cubridge.runtime.fa3_sm90 import KERNEL_DIR, KERNEL_SOURCE, NVCC_FLAGS
    from expkit import disassembler
    cubin = work / f"{name}.cubin"
    run = subprocess.run(["nvcc", *NVCC_FLAGS, *cfg.defines(), f"-I{KERNEL_DIR}", "-Xptxas", "-v", "-o", str(cubin),
                          str(KERNEL_SOURCE)], capture_output=True, text=True, check=True)
    spills = [line for line in run.stderr.splitlines() if "spill stores" in line]
    text = subprocess.run([*disassembler(), str(cubin)], capture_output=True, text=True, check=True).stdout
    start = text.find(".text.fa3_sm90_fwd:")
    stop = text.find(".text.", start + 1)
    return (text[start:stop if stop > start else None] if start >= 0 else text), spills
