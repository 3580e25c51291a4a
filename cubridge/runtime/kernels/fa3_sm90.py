"""fa3_sm90 as a ReferenceKernel: its tile space, flags and launcher (runtime/fa3_sm90.py runs it).

Example:
    >>> s = reference_kernel("fa3_sm90").space
    >>> [p.split(":")[0] for p in s.problems({"block_m": 128, "block_n": 256, "stages": 2, "persistent": False},
    ...                                        128, "sm_90a")]
    ['shared memory', 'registers']
    >>> len(s.points(128, "sm_90a")) > 10
    True
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from cubridge.runtime.fa3_sm90 import (SMEM_LIMIT, SUPPORTED_HEAD_DIMS, WG_ROWS, WG_THREADS, Fa3Config,
                                       check_inputs, default_config, fa3_forward, map_refusal)
from cubridge.runtime.fa3_fast import Fa3Launch, load_cubin
from cubridge.runtime.kernels import ReferenceKernel, check_dtype, register
from cubridge.runtime.kernels import reference_kernel  # noqa: F401 - the doctest uses it
from cubridge.runtime.space import Constraint, Param, Space

# Spill-free accumulator budget per consumer thread, by consumer count. Measured on sm_90a
# (ref_kernels/fa3_sm90/README.md, NOTES.md v2): 3 consumers (160 regs after setmaxnreg) spill at
# D=64 BLOCK_N=144 (estimate 140) and not at BLOCK_N=128 (128); 2 consumers (232 regs) compile
# spill-free at D=128 BLOCK_N=176 (196) and spill at BLOCK_N=256 (224 at D=64). D=256: BLOCK_N 64
# (172) is spill-free under 232, BLOCK_N 80 (188) under 240 (2 bytes before session 10; kernel.cu
# gives D=256 24 / 240 there); 96 (200) is refused, and shared memory refuses it too.
FA3_ACC_REG_BUDGET = {2: 196, 3: 128}


def fa3_acc_regs(block_n: int, head_dim: int) -> int:
    """fp32 O (64 x D) and S (64 x BLOCK_N) plus bf16x2-packed P, per thread of a 128-thread consumer."""
    rows, threads = WG_ROWS, WG_THREADS
    return rows * (head_dim + block_n) // threads + rows * block_n // (2 * threads)


def config(point: dict, head_dim: int) -> Fa3Config:
    """The runtime's Fa3Config for a point (its shared-memory arithmetic and -D flags)."""
    return Fa3Config(head_dim=head_dim, block_m=point["block_m"], block_n=point["block_n"],
                              stages=point["stages"], persistent=bool(point.get("persistent")))


def _fa3_smem(point, head_dim, arch):
    need = config(point, head_dim).smem_bytes
    if need > SMEM_LIMIT:
        return f"{need} B of tiles and barriers over the {SMEM_LIMIT} B per-block limit"
    return None


def _fa3_registers(point, head_dim, arch):
    consumers = point["block_m"] // WG_ROWS
    budget = FA3_ACC_REG_BUDGET.get(consumers)
    if budget is None:
        return f"{consumers} consumer warpgroups: the kernel has register budgets for 2 or 3"
    need = fa3_acc_regs(point["block_n"], head_dim)
    if need > budget:
        return f"~{need} accumulator registers per consumer thread > {budget} measured spill-free with {consumers} consumers"
    return None


def _fa3_divisibility(point, head_dim, arch):
    if point["block_m"] % WG_ROWS:
        return f"block_m {point['block_m']} is not a multiple of {WG_ROWS} rows per consumer"
    if point["block_n"] % 16 or not 16 <= point["block_n"] <= 256:
        return f"block_n {point['block_n']} must be a multiple of 16 (wgmma K) in [16, 256]"
    if point["stages"] < 2:
        return "stages must be >= 2 so loads overlap compute"
    return None


# Measured best beyond the runtime defaults: three consumers at D = 128 for a normalisation with
# two transcendentals per score (composite: 0.83-0.86x of causal softmax at 8k vs 0.78-0.82x at
# 128 x 128, H100, experiments/results/variant_tiles_192_h100/ and session5_close_h100/).
# D = 256: 128 x 64, the lowered variants' default (FlashAttention-3's tile with a window).
_FA3_EXTRA_KNOWN = {128: [{"block_m": 192, "block_n": 80, "stages": 2, "persistent": True}],
                    256: [{"block_m": 128, "block_n": 64, "stages": 2, "persistent": True}]}


def _fa3_best_known(head_dim: int) -> list[dict]:
    """The runtime's defaults for a lowered variant, then its measured dense defaults for causal
    and non-causal masks at short and long N, then the configs measured best for particular
    variants (_FA3_EXTRA_KNOWN). The first is what `lower --compile` and the CuIR check at an
    unusual D (fit_params) take: at D = 256 the variant tile 128 x 64 (128 x 80 spilled 264 bytes
    with the Gemma-2 softcap + window); at 64 / 128 the variant default is the dense one anyway."""
    out = []
    dense = [(False, c, n) for c, n in itertools.product((True, False), (1024, 8192))]
    for variant, causal, n in [(True, True, 1024), *dense]:
        c = default_config(head_dim, causal, seqlen=n, variant=variant)
        pt = {"block_m": c.block_m, "block_n": c.block_n, "stages": c.stages, "persistent": c.persistent}
        if pt not in out:
            out.append(pt)
    return out + [pt for pt in _FA3_EXTRA_KNOWN.get(head_dim, []) if pt not in out]


SPACE = Space(
    kernel="fa3_sm90",
    arches=("sm_90a",),
    head_dims=SUPPORTED_HEAD_DIMS,
    params=(Param("block_m", (128, 192)), Param("block_n", (64, 80, 96, 112, 128, 144, 160, 176, 192)),
            Param("stages", (2, 3, 4)), Param("persistent", (False, True))),
    constraints=(Constraint("divisibility", _fa3_divisibility), Constraint("shared memory", _fa3_smem),
                 Constraint("registers", _fa3_registers)),
    to_cuir=lambda p: {"BLOCK_M": p["block_m"], "BLOCK_N": p["block_n"], "STAGES": p["stages"],
                       "CONSUMERS": p["block_m"] // WG_ROWS},
    best_known=_fa3_best_known,
)


@register
class Fa3Sm90Kernel(ReferenceKernel):
    """The Hopper kernel (wgmma, TMA, warp specialisation), launched through runtime.fa3_sm90."""
    name = "fa3_sm90"
    arch = "sm_90a"
    generator = "cubridge.lower.fa3_sm90"
    space = SPACE

    @staticmethod
    def config(point: dict, head_dim: int, dtype: str) -> Fa3Config:
        """The runtime's config of a point for a lowered variant (the mask is the variant's)."""
        return replace(config(point, head_dim), causal=False, bf16=check_dtype(dtype) == "bf16")

    def defines(self, point: dict, head_dim: int, dtype: str) -> list[str]:
        return self.config(point, head_dim, dtype).defines()

    def check_inputs(self, q, k, v) -> None:
        head_dim = q.shape[-1] if q.dim() == 4 else 0     # check_inputs says what is wrong with q
        check_inputs(q, k, v, default_config(head_dim, False, q.dtype == torch.bfloat16, variant=True))

    def launcher(self, lowered, cubin: bytes, point: dict):
        configs: dict = {}       # (head dim, dtype) -> Fa3Config, built once outside the timed calls

        def prepare(extra: dict, device):
            launch = lowered.args(extra, device)        # keeps the packed tensors alive with the call

            def call(q, k, v, out, lse=None):
                key = (q.shape[-1], q.dtype)
                if key not in configs:
                    configs[key] = self.config(point, q.shape[-1], "bf16" if q.dtype == torch.bfloat16 else "fp16")
                return fa3_forward(q, k, v, causal=False, config=configs[key], out=out, lse=lse, variant=launch,
                                   cubin=cubin or None)
            return call
        return prepare

    def shape_launch(self, cubin: bytes, point: dict, head_dim: int, dtype: str, variant, device, dims, scale):
        """runtime.fa3_fast's cached launch: CUDA-graph safe once built (no sync, no allocation)."""
        config = self.config(point, head_dim, dtype)
        func, counts = load_cubin(cubin, config, device)
        return Fa3Launch(func, counts, config, device, *dims, scale, variant)

    def variant_default(self, head_dim: int, seqlen: int, wide: bool | int = False) -> dict:
        """The runtime's default for a lowered variant, which depends on N and on `wide`
        (cubridge.lower.fa3_sm90.wide_tile; fa3_sm90.default_config)."""
        c = default_config(head_dim, causal=False, seqlen=seqlen, variant=True, wide=wide)
        return {"block_m": c.block_m, "block_n": c.block_n, "stages": c.stages, "persistent": c.persistent}

    def copy_reason(self, t) -> str | None:
        """Any view the 4-D TMA maps (D, N, H, B) can express is read in place (fa3_sm90.map_refusal
        says why one cannot)."""
        return map_refusal(tuple(t.shape), tuple(t.stride()), t.element_size())
