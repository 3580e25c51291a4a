"""fa2_sm80 as a ReferenceKernel: its tile space, flags and launcher (runtime/fa2_sm80.py runs it).

Example:
    >>> k = reference_kernel("fa2_sm80")
    >>> k.space.problems({"block_m": 64, "block_n": 64, "stages": 2, "warps": 8}, 128, "sm_80")
    ['kernel static_asserts: block_m 64 must be a multiple of 16 * warps = 128']
"""
from __future__ import annotations

import torch

from cubridge.runtime.fa2_sm80 import HEAD_DIMS, SMEM_OPTIN, Config, Fa2Sm80, default_config
from cubridge.runtime.build import default_compiler
from cubridge.runtime.kernels import ReferenceKernel, check_dtype, register
from cubridge.runtime.kernels import reference_kernel  # noqa: F401 - the doctest uses it
from cubridge.runtime.launch import check_attention_args
from cubridge.runtime.space import Constraint, Param, Space

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_RUNTIMES: dict = {}     # (kernel folder, point) -> Fa2Sm80, for shape_launch
# Opt-in shared memory per block by target arch (the runtime's table, keyed by capability).
ARCH_CAPABILITY = {"sm_80": (8, 0), "sm_90a": (9, 0)}


def smem_limit(arch: str) -> int:
    return SMEM_OPTIN[ARCH_CAPABILITY[arch]]


def config(point: dict) -> Config:
    """The runtime's Config for a point (its validation and -D flags are the kernel's own)."""
    return Config(point["block_m"], point["block_n"], point["stages"], point["warps"],
                  spill_free=bool(point.get("spill_free", False)))   # runs tuned before session 17 have no key


def _fa2_static_asserts(point, head_dim, arch):
    """kernel.cu's static_asserts (divisibility, copy passes, register and shared-memory budgets),
    as the runtime's Config.problems states them."""
    problems = config(point).problems(head_dim, smem_limit(arch))
    return "; ".join(problems) or None


# The D 128 tiles that spill without spill_free hold 160-192 fp32 accumulator registers a thread (O + S of 32 rows a
# warp: 128 x 64 and 128 x 32 at 4 warps, 256-row tiles at 8); smaller ones build spill-free as they are.
SPILL_ACC_REGS = 160


def _fa2_spill_free(point, head_dim, arch):
    """spill_free exists for D 128's spills; D 64 builds spill-free without it (the same code, one more point)."""
    if point.get("spill_free") and head_dim != 128:
        return f"spill_free is for head dim 128 (D {head_dim} does not spill)"
    if point.get("spill_free") and config({**point, "spill_free": False}).acc_regs(head_dim) < SPILL_ACC_REGS:
        return f"the tile without it holds fewer than {SPILL_ACC_REGS} accumulator registers a thread: no spills to remove"
    return None


SPACE = Space(
    kernel="fa2_sm80",
    arches=("sm_80", "sm_90a"),
    head_dims=HEAD_DIMS,
    params=(Param("block_m", (64, 128, 256)), Param("block_n", (32, 64, 128)),
            Param("stages", (2, 3, 4)), Param("warps", (4, 8)), Param("spill_free", (False, True))),
    constraints=(Constraint("kernel static_asserts", _fa2_static_asserts), Constraint("spill_free", _fa2_spill_free)),
    to_cuir=lambda p: {"BLOCK_M": p["block_m"], "BLOCK_N": p["block_n"], "STAGES": p["stages"], "WARPS": p["warps"]},
    best_known=lambda d: [_fa2_point(default_config(d))],
)


def _fa2_point(c: Config) -> dict:
    return {"block_m": c.block_m, "block_n": c.block_n, "stages": c.stages, "warps": c.warps, "spill_free": c.spill_free}


@register
class Fa2Sm80Kernel(ReferenceKernel):
    """The portable mma.sync kernel (sm_80 and newer), launched by runtime.fa2_sm80.Fa2Sm80."""
    name = "fa2_sm80"
    arch = "sm_80"
    generator = "cubridge.lower.fa2_sm80"
    space = SPACE

    def defines(self, point: dict, head_dim: int, dtype: str) -> list[str]:
        return config(point).defines(head_dim, TORCH_DTYPES[check_dtype(dtype)], causal=False)

    def check_inputs(self, q, k, v) -> None:
        check_attention_args(q, k, v, head_dims=HEAD_DIMS)

    def runtime(self, point: dict) -> Fa2Sm80:
        return Fa2Sm80(config(point), compiler=default_compiler(), source_path=self.directory / "kernel.cu")

    def launcher(self, lowered, cubin: bytes, point: dict):
        kernel = self.runtime(point)

        def prepare(extra: dict, device):
            launch = lowered.args(extra, device)        # keeps the packed tensors alive with the call
            return lambda q, k, v, out, lse=None: kernel(q, k, v, causal=False, out=out, lse=lse, variant=launch,
                                                          cubin=cubin or None)
        return prepare

    def shape_launch(self, cubin: bytes, point: dict, head_dim: int, dtype: str, variant, device, dims, scale):
        """Fa2Sm80's checked call. One runtime per (folder, point) for every shape, so a cubin is
        loaded once per device: a later shape's first call then loads nothing (a CUDA graph
        capture forbids the load's synchronisation)."""
        key = (self.directory, tuple(sorted(point.items())))
        kernel = _RUNTIMES.get(key) or _RUNTIMES.setdefault(key, self.runtime(point))

        def launch(q, k, v, out, lse):
            kernel(q, k, v, causal=False, out=out, lse=lse, sm_scale=scale, variant=variant, cubin=cubin or None)
        return launch
