"""The backward of a variant spec: the rules transfer of the forward (fa2_sm80's program), lowered
into the regions of the portable fa2_bwd_sm80 (cubridge.lower.fa2_bwd_sm80) or, on sm_90, of the
Hopper fa3_bwd_sm90 (cubridge.lower.fa3_bwd_sm90, option fa3_bwd_sm90.VARIANT_OPTION by default).

Which kernel: `use_hopper=None` (default) takes the Hopper one on an sm_90 GPU unless
CUBRIDGE_HOPPER_VARIANT_BWD=0 (the default since session 10: its gradient tests pass on an H100 and,
on option bulk_overlap_lse_lean, compute-sanitizer racecheck reports 0 hazards; 1.2-2x fa2_bwd_sm80's
speed there; since session 12 on the dense default's option, bulk_overlap_lse_lean_issue_pf32_epi), True forces it (sm_90 only), False keeps fa2_bwd_sm80. deterministic=True always
runs fa2_bwd_sm80 (the Hopper dQ is a reduce-add whose order varies between runs). `hopper_option`:
which of cubridge.runtime.fa3_bwd_sm90.VARIANT_OPTIONS the Hopper path builds (default VARIANT_OPTION, or the one
CUBRIDGE_BWD_VARIANT_OPTION names: fa3_bwd_sm90.variant_option).
CUBRIDGE_BWD_FIT_SECTIONS (1 by default since session 13; 0 off) sizes a TILE_ORDER 2 option's head
sections by the spec's attended fraction (section_l2_bytes). CUBRIDGE_BWD_ARGS_CACHE (1 by default since session
14; 0 off) keeps each shape's packed VariantArgs and device tables (launchable; no per-call stream sync).
CUBRIDGE_BWD_SECTION_CAP (1 by default since session 15; 0 off) caps those sections where a pair has few KV tiles
(section_cap_pairs: 16 pairs at 1k, 4 at 4k, none from 8k on 132 SMs).

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
from cubridge.errors import env_switch

FORWARD_REF = "fa2_sm80"
HOPPER_ENV = "CUBRIDGE_HOPPER_VARIANT_BWD"
# dispatch.json's backward label for the Hopper variant backward (search/backward.py tunes it, op/autograd.py reads it)
HOPPER_LABEL = "fa3_bwd_sm90:variant"
# On by default since session 13's mid call (H100 8k, over l2lpt alone: global_sliding_window 1.29x, the
# others 0.998-1.010x; rule tests passed): TILE_ORDER 2's head sections sized by the attended fraction f of
# the pairs (fa3_backward's l2_bytes = L2 / f: a sparse spec's pairs stream 1 / f times less Q / dO), so a
# sparse spec's long tiles of every head go out first (host model 1.31x). 0 sizes them by the whole L2.
FIT_ENV = "CUBRIDGE_BWD_FIT_SECTIONS"
# On by default since session 14's mid call (H100, x over packing per call, same run: share_question 1.261x at 8k /
# 1.537x at 1k, relative_pos 1.128x / 1.463x, the specs without tables 0.999-1.000x; rule tests passed with it on):
# launchable keeps each shape's packed VariantArgs with its device copies of the bound tables. Packed per call (0),
# LoweredKernel.args copies the CPU tables the binder caches with x.to(device), a blocking host-to-device copy
# per table, so a spec with tables (share_question's SEGMENT and BLOCK_CLASS, relative_pos's SLOPES, document's)
# synced the stream once per backward call and its host path then ran with the GPU idle.
ARGS_CACHE_ENV = "CUBRIDGE_BWD_ARGS_CACHE"
# On by default since session 15's mid call (0 off): caps a TILE_ORDER 2 section at section_cap_pairs (batch, kv head)
# pairs, so that one wave of CTAs holds a pair's KV tiles side by side. Early call, 1k: the main kernel 1.33-1.41x
# FA4's with fit sections of 64-128 pairs (a wave held 1-2 of a pair's 8 tiles; its Q / dO / dQ accumulator lines
# left L2 between them). Mid call (H100, x over the uncapped fit sections, same run, _dqw_early_l2lpt): 1k prefixlm
# 1.19, gsw 1.43, share_question 1.35; 4k 1.00-1.04; at 8k a cap of 2 lost (gsw 0.80, composite 0.98: the fit's wide
# sections start every pair's long tiles first), hence no cap below 4 pairs.
SECTION_CAP_ENV = "CUBRIDGE_BWD_SECTION_CAP"
MIN_CAPPED_PAIRS = 4


def section_cap_pairs(sms: int, kv_tiles: int) -> int | None:
    """SECTION_CAP_ENV's most pairs per section: the largest power of two <= SMs / KV tiles, or None (no cap) where
    that is below 4 (long sequences: there the fit sections' balance wins, H100 8k).

    >>> section_cap_pairs(132, 8), section_cap_pairs(132, 32), section_cap_pairs(132, 64), section_cap_pairs(132, 256)
    (16, 4, None, None)
    """
    fit = max(1, sms // max(1, kv_tiles))
    cap = 1 << (fit.bit_length() - 1)
    return cap if cap >= MIN_CAPPED_PAIRS else None
ARGS_CACHED_SHAPES = 16


def args_cache_enabled() -> bool:
    """ARGS_CACHE_ENV: "1" or unset, VariantBackward.launchable keeps each shape's VariantArgs; "0", packs them per call."""
    return env_switch(ARGS_CACHE_ENV, "1", f"unset {ARGS_CACHE_ENV} (VariantArgs kept per shape) or 0 (packed per call)")


@functools.lru_cache(maxsize=None)
def _forward_program():
    from cubridge.cuir.parser import parse_file
    from cubridge.runtime.kernels import reference_kernel
    return parse_file(reference_kernel(FORWARD_REF).cuir_path())


class VariantBackward:
    """dq, dk, dv of a variant spec (name or path), with the spec's params as keyword overrides."""

    def __init__(self, spec, config: Config | None = None, kernel: Fa2BwdSm80 | None = None,
                 use_hopper: bool | None = None, hopper_option: str | None = None, **spec_params):
        from cubridge.runtime.fa3_bwd_sm90 import VARIANT_OPTIONS, variant_option
        from cubridge.spec import load_spec
        from cubridge.transfer.rules import transfer
        if hopper_option is not None and hopper_option not in VARIANT_OPTIONS:
            from cubridge.errors import LaunchError
            raise LaunchError(f"hopper_option={hopper_option!r} has no variant hooks", where="VariantBackward",
                              hint=f"pass one of {list(VARIANT_OPTIONS)} (or None: {variant_option()!r})")
        self.hopper_option = hopper_option or variant_option()
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        self.spec_params = spec_params
        self.candidate = transfer(_forward_program(), self.spec, spec_params=spec_params)
        self.ir = extract(self.candidate.program)
        self.source = lower_source(KERNEL_PATH.read_text(), self.ir)
        self.lowered = LoweredKernel("fa2_bwd_sm80", self.source, struct_fields(self.ir), self.ir)
        self.kernel = kernel or Fa2BwdSm80(config)
        self.config = config
        self.use_hopper = use_hopper
        self._hopper = None
        self._hopper_list = None
        self._fractions: dict[tuple, float] = {}
        self._args: dict[tuple, object] = {}   # ARGS_CACHE_ENV: (shape, device, kernel) -> Launchable
        self.cache_args: bool | None = None    # None: ARGS_CACHE_ENV decides (an A/B sets it per object)

    @property
    def hopper(self) -> LoweredKernel:
        """The variant lowered into ref_kernels/fa3_bwd_sm90 (built lazily: pure Python)."""
        if self._hopper is None:
            from cubridge.lower.fa3_bwd_sm90 import lower_source as lower_hopper
            from cubridge.runtime.fa3_bwd_sm90 import KERNEL_SOURCE
            self._hopper = LoweredKernel("fa3_bwd_sm90", lower_hopper(KERNEL_SOURCE.read_text(), self.ir),
                                         struct_fields(self.ir), self.ir)
        return self._hopper

    def uses_hopper(self, device, deterministic: bool = False) -> bool:
        """Whether a call on `device` runs fa3_bwd_sm90 (module docstring)."""
        from cubridge.errors import LaunchError
        from cubridge.runtime.driver import capability
        if self.use_hopper is False:
            return False
        if self.use_hopper:
            if deterministic:
                raise LaunchError("use_hopper=True with deterministic=True", where="VariantBackward",
                                  hint="the Hopper dQ is not bitwise repeatable: use_hopper=False for deterministic")
            if device.type != "cuda" or capability(device.index) != (9, 0):
                raise LaunchError(f"use_hopper=True on {device}, not an sm_90 GPU", where="VariantBackward",
                                  hint="use_hopper=None picks the kernel the device has")
            return True
        on = env_switch(HOPPER_ENV, "1", f"set {HOPPER_ENV}=0 for the portable fa2_bwd_sm80 variant backward, or unset it")
        return not deterministic and on and device.type == "cuda" and capability(device.index) == (9, 0)

    @property
    def norm(self) -> str:
        return self.ir.norm

    def launchable(self, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, head_dim: int, device, hopper: bool = False):
        """The VariantArgs at one shape (a block table at the dK/dV kernel's tile: fa2_bwd_sm80's
        config, or fa3_bwd_sm90's 64 queries x 128 keys with `hopper`)."""
        key = None
        if self.cache_args if self.cache_args is not None else args_cache_enabled():
            from cubridge.lower.fa3_bwd_sm90 import q_list_mode
            key = (B, Hq, Hkv, Nq, Nk, head_dim, str(torch.device(device)), hopper, q_list_mode() if hopper else None)
            if key in self._args:
                return self._args[key]
        launchable = self._launchable(B, Hq, Hkv, Nq, Nk, head_dim, device, hopper)
        if key is not None:
            if len(self._args) >= ARGS_CACHED_SHAPES:
                self._args.pop(next(iter(self._args)))   # the oldest shape
            self._args[key] = launchable
        return launchable

    def _launchable(self, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, head_dim: int, device, hopper: bool):
        if hopper:
            from cubridge.lower.fa3_bwd_sm90 import BLOCK_M, BLOCK_N
            tiles, lowered = (BLOCK_M, BLOCK_N), self.hopper
        else:
            cfg = self.config or default_config(head_dim)
            tiles, lowered = (cfg.block_m, cfg.block_n), self.lowered
        inputs = self.candidate.bind(Nq=Nq, Nk=Nk, Hq=Hq, Hkv=Hkv, B=B,
                                     params={"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]})
        if hopper and self.ir.table:   # CUBRIDGE_BWD_Q_LIST=auto: the exact list where the runs are not
            from cubridge.lower.fa3_bwd_sm90 import q_list_mode, wants_q_list
            if q_list_mode() == "auto" and wants_q_list(inputs["BLOCK_CLASS"], Hq // Hkv):
                lowered = self.hopper_list
        return lowered.args(inputs, device)

    def section_l2_bytes(self, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, device, head_dim: int = 128) -> int | None:
        """fa3_backward's l2_bytes for this shape: None (the device's L2) with FIT_ENV=0 and SECTION_CAP_ENV off or a
        TILE_ORDER 0 option, else the L2 over the attended fraction of the pairs (counted once per shape:
        cubridge.transfer.pairs; a spec with runtime inputs counts the values sampled at this shape), with
        SECTION_CAP_ENV (on by default) at most section_cap_pairs pairs' bytes."""
        fit = env_switch(FIT_ENV, "1", f"unset {FIT_ENV} (sections sized by the attended fraction) or 0 (by the whole L2)")
        cap = env_switch(SECTION_CAP_ENV, "1", f"unset {SECTION_CAP_ENV} (a wave holds a pair's tiles) or 0 (no cap)")
        from cubridge.runtime.fa3_bwd_sm90 import OPTIONS, pair_bytes
        if not (fit or cap) or OPTIONS[self.hopper_option].tile_order != 2:   # only TILE_ORDER 2 reads it
            return None
        props = torch.cuda.get_device_properties(device)
        l2 = self._fit_l2_bytes(B, Hq, Hkv, Nq, Nk, device, props.L2_cache_size) if fit else props.L2_cache_size
        pairs = section_cap_pairs(props.multi_processor_count, -(-Nk // 128)) if cap else None
        if pairs is not None:
            l2 = min(l2, pairs * pair_bytes(Hq // Hkv, Nq, head_dim))
        return int(l2)

    def _fit_l2_bytes(self, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, device, l2: int) -> float:
        """FIT_ENV's budget: l2 over the attended fraction of the pairs (counted once per shape)."""
        key = (B, Hq, Hkv, Nq, Nk)
        key = (B, Hq, Hkv, Nq, Nk)
        if key not in self._fractions:
            from cubridge.transfer.pairs import count_attended
            hooks = self.spec.hooks_for(Nq, Nk, Hq, Hkv, device, B=B, **self.spec_params)
            self._fractions[key] = count_attended(hooks, B, Hq, Nq, Nk, device=device) / (B * Hq * Nq * Nk)
        return l2 / max(self._fractions[key], 1e-6)

    def _launch_option(self) -> str:
        """hopper_option, except that a spec lowered to the dense reference itself (no q_range runs to
        queue) runs a PERSIST option's body without the queue (fa3_bwd_sm90.QUEUELESS)."""
        from cubridge.runtime.fa3_bwd_sm90 import QUEUELESS
        if self.ir.dense_reference:
            return QUEUELESS.get(self.hopper_option, self.hopper_option)
        return self.hopper_option

    @property
    def hopper_list(self) -> LoweredKernel:
        """The Hopper lowering with q_range as the exact query-tile list (CUBRIDGE_BWD_Q_LIST=auto)."""
        if self._hopper_list is None:
            from cubridge.lower.fa3_bwd_sm90 import lower_source as lower_hopper
            from cubridge.runtime.fa3_bwd_sm90 import KERNEL_SOURCE
            self._hopper_list = LoweredKernel("fa3_bwd_sm90", lower_hopper(KERNEL_SOURCE.read_text(), self.ir, q_list=True),
                                              struct_fields(self.ir), self.ir)
        return self._hopper_list

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
        if self.uses_hopper(q.device, deterministic):
            from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
            va = self.launchable(b, hq, k.shape[1], nq, k.shape[2], d, q.device, hopper=True)
            l2 = self.section_l2_bytes(b, hq, k.shape[1], nq, k.shape[2], q.device, d)
            fit = {} if l2 is None else {"l2_bytes": l2}   # absent unless set: callers may bind their own
            return fa3_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=sm_scale, dq=dq, dk=dk, dv=dv,
                                option=self._launch_option(), variant=va, **fit)   # default_compiler(), as the dense path
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


def reference_grads(spec, q, k, v, dout, **spec_params):
    """dq, dk, dv of the spec's reference by torch.autograd, in q's dtype (float64: the golden)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    spec.run_reference(q, k, v, **spec_params).backward(dout)
    return q.grad, k.grad, v.grad


class GradCase:
    """One gradient check's data: random q, dout [B, Hq, Nq, D] and k, v [B, Hkv, Nk, D] (drawn in
    that order from `seed`), the forward's out / LSE from the float64 reference (so only the
    backward is under test), the golden (float64) and ref (dtype) gradients of the rule."""

    def __init__(self, spec, spec_params: dict, shape: tuple, dtype, seed: int, device="cuda"):
        b, hq, hkv, nq, nk, d = shape
        g = torch.Generator(device=device).manual_seed(seed)
        self.q, self.dout = (torch.randn(b, hq, nq, d, device=device, generator=g).to(dtype) for _ in range(2))
        self.k, self.v = (torch.randn(b, hkv, nk, d, device=device, generator=g).to(dtype) for _ in range(2))
        q64, k64, v64 = (t.double() for t in (self.q, self.k, self.v))
        out, self.lse = reference_forward(spec, q64, k64, v64, **spec_params)
        self.out = out.to(dtype)
        self.golden = reference_grads(spec, q64, k64, v64, self.dout.double(), **spec_params)
        self.ref = reference_grads(spec, self.q, self.k, self.v, self.dout, **spec_params)

    def check(self, bwd, **call):
        """cubridge.rule.check_backward of `bwd(dout, q, k, v, out, lse, sm_scale, dq=, dk=, dv=, **call)`."""
        from cubridge.rule import check_backward
        inputs = {"q": self.q, "k": self.k, "v": self.v, "dout": self.dout, "out": self.out, "lse": self.lse}
        scale = self.q.shape[-1] ** -0.5
        return check_backward(lambda dq, dk, dv: bwd(self.dout, self.q, self.k, self.v, self.out, self.lse,
                                                     sm_scale=scale, dq=dq, dk=dk, dv=dv, **call),
                              inputs, (self.q, self.k, self.v), self.golden, self.ref)
