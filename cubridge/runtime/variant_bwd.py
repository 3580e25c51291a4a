"""The backward of a variant spec on fa2_bwd_sm80: the rules transfer of the forward (fa2_sm80's
program), lowered into the backward kernel's regions by cubridge.lower.fa2_bwd_sm80.

Example (GPU):
    >>> bwd = VariantBackward("prefixlm")                                               # doctest: +SKIP
    >>> dq, dk, dv = bwd(dout, q, k, v, out, lse)                                      # doctest: +SKIP

`out` and `lse` are the forward's (the natural-log LSE for softmax variants; for sigmoid / relu
the backward reads no row statistics: pass any float32 [B, Hq, Nq], e.g. zeros).
"""
from __future__ import annotations

import functools

import torch

from cubridge.lower import LoweredKernel, struct_fields
from cubridge.lower.fa2_bwd_sm80 import lower_source
from cubridge.lower.variant import extract
from cubridge.runtime.fa2_bwd_sm80 import KERNEL_PATH, Config, Fa2BwdSm80, default_config

FORWARD_REF = "fa2_sm80"


@functools.lru_cache(maxsize=None)
def _forward_program():
    from cubridge.cuir.parser import parse_file
    from cubridge.runtime.kernels import reference_kernel
    return parse_file(reference_kernel(FORWARD_REF).cuir_path())


class VariantBackward:
    """dq, dk, dv of a variant spec (name or path), with the spec's params as keyword overrides."""

    def __init__(self, spec, config: Config | None = None, kernel: Fa2BwdSm80 | None = None, **spec_params):
        from cubridge.spec import load_spec
        from cubridge.transfer.rules import transfer
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        self.spec_params = spec_params
        self.candidate = transfer(_forward_program(), self.spec, spec_params=spec_params)
        self.ir = extract(self.candidate.program)
        self.source = lower_source(KERNEL_PATH.read_text(), self.ir)
        self.lowered = LoweredKernel("fa2_bwd_sm80", self.source, struct_fields(self.ir), self.ir)
        self.kernel = kernel or Fa2BwdSm80(config)
        self.config = config

    @property
    def norm(self) -> str:
        return self.ir.norm

    def launchable(self, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, head_dim: int, device):
        """The VariantArgs at one shape (a block table at the dK/dV kernel's tile)."""
        cfg = self.config or default_config(head_dim)
        inputs = self.candidate.bind(Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B,
                                     params={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n})
        return self.lowered.args(inputs, device)

    def __call__(self, dout, q, k, v, out, lse, sm_scale: float | None = None, deterministic: bool = False,
                 dq=None, dk=None, dv=None):
        b, hq, nq, d = q.shape
        if nq > k.shape[2]:
            # as the forward's op: query row i sits at position Nk - Nq + i, so a spec's mods are
            # defined for Nq <= Nk only (cubridge.inputs.check_query_length)
            from cubridge.errors import LaunchError
            raise LaunchError(f"Nq={nq} > Nk={k.shape[2]}: queries are aligned to the end of the keys (row i at "
                              "position Nk - Nq + i), so a variant needs Nq <= Nk", where="VariantBackward",
                              hint="give at least as many keys as queries")
        va = self.launchable(b, hq, k.shape[1], nq, k.shape[2], d, q.device)
        return self.kernel(dout, q, k, v, out, lse, causal=False, sm_scale=sm_scale, deterministic=deterministic,
                           dq=dq, dk=dk, dv=dv, variant=va)


def reference_forward(spec, q, k, v, **spec_params):
    """(out, lse) of a spec by its hooks, in q's dtype (lse: natural-log logsumexp of the masked,
    score_mod-ed scores for softmax; zeros otherwise, as the forward saves none)."""
    import math

    from cubridge.spec import attention_from_hooks, index_grids, mask_of
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    hooks = spec.hooks_for(Nq, Nk, Hq, Hkv, q.device, **spec_params)
    out = attention_from_hooks(q, k, v, hooks)
    if hooks.normalization.kind != "softmax":
        return out, torch.zeros(B, Hq, Nq, dtype=torch.float32, device=q.device)
    s = q @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) / math.sqrt(D)
    # queries end-aligned: row i sits at position Nk - Nq + i (as the forward and the kernel)
    b, h, qi, ki = index_grids(B, Hq, torch.arange(Nk - Nq, Nk, device=q.device), Nk, q.device)
    if hooks.score_mod is not None:
        s = hooks.score_mod(s, b, h, qi, ki).to(s.dtype)
    s = s.masked_fill(~mask_of(hooks, b, h, qi, ki), float("-inf"))
    return out, torch.logsumexp(s, dim=-1).float()
