"""The tuned op's backward: `cubridge::attention_lse` gets `register_autograd` (cubridge/op/library.py),
its setup_context saves q, k, v, out, lse, and the backward is the custom op
`cubridge::attention_backward`, which runs the run's spec through the lowered fa2_bwd_sm80
backward (cubridge.runtime.variant_bwd: the forward's mask and iteration space transposed, the
score_mod's derivative, the normalisation's backward), or on sm_90 (the default since session
10; CUBRIDGE_HOPPER_VARIANT_BWD=0 switches it off) through the same lowered into the Hopper
fa3_bwd_sm90. A run that tuned its backward uses what it chose (a fa2 config or the Hopper label). Its fake implementation gives the gradient
shapes, so torch.compile traces forward and backward.

A call that needs gradients goes through attention_lse (the backward needs the forward's LSE for
softmax variants; sigmoid / relu read none). The LSE output itself is not differentiable.
"""
from __future__ import annotations

import torch

from cubridge.errors import LaunchError
from cubridge.op.handles import op_for

WHERE = "cubridge op backward"
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


def check_trainable(op, rt: list) -> None:
    """Refuse, at the forward, what the backward cannot do (so no error waits for loss.backward())."""
    if rt:
        raise LaunchError(f"spec {op.dispatch['spec_name']!r} takes runtime inputs; the backward does not bind "
                          "them yet", where=WHERE, hint="call the op under torch.no_grad(), or use a spec without "
                                                        "RUNTIME_INPUTS for training")
    if op.head_dim not in HEAD_DIMS or op.dtype not in DTYPES:
        raise LaunchError(f"the backward kernel (fa2_bwd_sm80) supports D in {HEAD_DIMS}, float16 / bfloat16; this "
                          f"run is D={op.head_dim} {op.dtype}", where=WHERE,
                          hint="tune a run with D = 64 or 128, or call the op under torch.no_grad()")


def variant_backward(op, config: str | None = None):
    """The VariantBackward of a TunedOp's spec at a backward label of dispatch.json (a
    fa2_bwd_sm80 config, or variant_bwd.HOPPER_LABEL; None: the default, where
    CUBRIDGE_HOPPER_VARIANT_BWD decides), built once per op and label (compiles at first use)."""
    cache = op.__dict__.setdefault("_variant_backwards", {})
    vb = cache.get(config)
    if vb is None:
        from cubridge.runtime.build import default_compiler
        from cubridge.runtime.fa2_bwd_sm80 import Config, Fa2BwdSm80
        from cubridge.runtime.variant_bwd import HOPPER_LABEL, VariantBackward
        from cubridge.spec import load_spec
        from dataclasses import replace
        # the run's spec copy under the name it was tuned as (as cubridge/op/kernels.py binds it)
        spec = replace(load_spec(str(op.directory / op.dispatch["spec"])), name=op.dispatch.get("spec_name") or "spec")
        params = dict(op.dispatch.get("spec_params") or {})
        if config == HOPPER_LABEL:   # the run's backward tuning checked and chose the Hopper variant backward
            vb = cache[config] = VariantBackward(spec, use_hopper=True, **params)
            return vb
        cfg = Config.parse(config) if config else None
        # a tuned fa2 config is the run's choice (its GPU check and timing beat the Hopper point):
        # keep it; untuned (None), the device and CUBRIDGE_HOPPER_VARIANT_BWD decide
        vb = cache[config] = VariantBackward(spec, config=cfg, kernel=Fa2BwdSm80(cfg, compiler=default_compiler()),
                                             use_hopper=False if cfg else None, **params)
    return vb


def tuned_config(op, nq: int) -> str | None:
    """The backward config the run chose for the bucket of `nq` queries (dispatch.json's
    "backward", written when the run tuned its backward), else None (the kernel's default)."""
    chosen = op.select(nq).get("backward")
    return chosen["config"] if chosen else None


def reads_in_place(op, dout, q, k, v, out) -> bool:
    """Whether the backward reads dout, q, k, v, out where they are and writes gradients like q, k, v
    (torch.empty_like): fa3_bwd_sm90's BNHD path (cubridge.runtime.fa3_bwd_layout), taken by the Hopper
    backward (the default; CUBRIDGE_BWD_BNHD=0 turns it off) when dout and out are [B, N, H, D] memory (a
    transformers model's views) and its TMA maps address q, k, v. Strides only: the fake implementation asks too."""
    from cubridge.runtime import fa3_bwd_layout as lay
    from cubridge.runtime.fa3_bwd_sm90 import OPTIONS
    if getattr(op, "backward_impl", None) is not None or not lay.enabled() or q.device.type != "cuda":
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():   # the fake asks too: build (and cache) the real object, never a traced one
        vb = variant_backward(op, tuned_config(op, int(q.shape[2])))
    modes = OPTIONS[vb.hopper_option]
    return bool(modes.lean and modes.epilogue) and vb.uses_hopper(q.device) and lay.fits(dout, q, k, v, out)


def run_backward(op, dout, q, k, v, out, lse, scale: float, rt: list, in_place: bool = False):
    """(dq, dk, dv) in q's dtype: laid out like q, k, v when `in_place` (the trace's decision,
    reads_in_place at the time the backward was traced), else contiguous [B, H, N, D]. The layout
    follows the argument, never the environment at run time: a compiled graph (or inductor's on-disk
    cache of one, traced in another process) asserts the strides its fake promised, so the promise
    is kept even where the in-place path is not taken now (its gradients are then copied into
    q / k / v's layout). `op.backward_impl`, where set, replaces the kernels (CPU tests stub it as
    they stub the forward's launch)."""
    impl = getattr(op, "backward_impl", None)
    if impl is not None:
        return impl(dout, q, k, v, out, lse, scale, rt)
    check_trainable(op, rt)
    here = in_place and reads_in_place(op, dout, q, k, v, out)
    if not here:
        # the portable fa2_bwd_sm80 and the Hopper kernel's default path address contiguous [B, H, N, D]
        # only: a model's [B, N, H, D] views are copied here (session 13: ~1.9 ms per Llama step at 8k)
        like = (q, k, v)
        dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    grads = variant_backward(op, tuned_config(op, q.shape[2]))(dout, q, k, v, out, lse.contiguous(), sm_scale=scale)
    if in_place and not here:   # promised like q, k, v (traced with the in-place path), run with copies
        return tuple(torch.empty_like(t).copy_(g) for t, g in zip(like, grads))
    return grads


def backward_fake(dout, q, k, v, in_place: bool = False):
    """The gradients' shapes, dtypes and strides as run_backward makes them (torch.compile must see
    the strides the kernel writes: like q, k, v on the in-place path, else contiguous)."""
    if in_place:
        return tuple(torch.empty_like(t) for t in (q, k, v))
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def setup_context(ctx, inputs, output):
    q, k, v, handle, scale, runtime = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, *runtime)
    ctx.handle, ctx.scale, ctx.n_runtime = handle, scale, len(runtime)


def backward(ctx, dout, _dlse):
    q, k, v, out, lse, *rt = ctx.saved_tensors
    # decided here, once, where torch.compile traces it (fake tensors) as where eager runs it; the op
    # then keeps to it (run_backward)
    in_place = reads_in_place(op_for(ctx.handle), dout, q, k, v, out)
    dq, dk, dv = torch.ops.cubridge.attention_backward(dout, q, k, v, out, lse, ctx.handle, ctx.scale, rt, in_place)
    return dq, dk, dv, None, None, [None] * ctx.n_runtime   # the runtime list: no gradient
