"""A tuned run as a `transformers` attention implementation.

    >>> from cubridge.integrations.transformers import register              # doctest: +SKIP
    >>> name = register("out/h100_causal")                                   # doctest: +SKIP
    >>> model.set_attn_implementation(name)                                  # doctest: +SKIP
    >>> logits = model(input_ids).logits                                     # doctest: +SKIP

Every attention layer of the model then runs the tuned kernel: the spec's mask replaces the
model's causal default (a causal run reproduces it; a prefixlm run makes the model a prefix LM).
transformers calls attention with q [B, Hq, N, D] and k, v [B, Hkv, N, D] (views of its
projections, GQA unrepeated) and expects [B, N, Hq, D] back; the head counts must be the ones the
run was tuned for. What the kernel cannot honour is refused, never run on misread data: a padding
mask (attention_mask with zeros), a custom 4-D mask, packed sequences, a decode step with a KV
cache (fewer queries than keys), dropout in training, output_attentions. Under autocast to the
kernel's dtype (float32 weights), q, k and v are cast to it as SDPA would (autocast_inputs).

Called without attention_mask, a model runs transformers' packed-sequence check every forward
(position_ids scanned, then a `.all()` that waits for the GPU): ~1 ms of a 24 ms Llama forward at
8k on an H100 (session 10, experiments/llama_profile.py: 24.67 ms with it, 23.70 ms without), which
FlexAttention's callers never pay because they pass a BlockMask. `spec_mask(B, N)` is the same
for a tuned run: a 4-D mask object, built once per shape, that transformers passes through
untouched and the kernel reads as "no padding; the spec's own mask applies":

    >>> mask = spec_mask(2, 8192)                                             # doctest: +SKIP
    >>> logits = model(input_ids, attention_mask=mask, use_cache=False).logits # doctest: +SKIP
"""
from __future__ import annotations

import ctypes

import torch

from cubridge.errors import LaunchError

WHERE = "cubridge.integrations.transformers"


def register(run, name: str | None = None) -> str:
    """Register `run` (a run directory or a cubridge.load result) as an attention implementation
    and a mask function under `name` (default "cubridge_<spec>"); returns the name to pass to
    model.set_attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import cubridge
    attn = cubridge.load(run) if not hasattr(run, "dispatch") else run
    name = name or f"cubridge_{attn.dispatch['spec_name']}"
    AttentionInterface.register(name, attention_forward(attn))
    AttentionMaskInterface.register(name, no_mask)
    return name


def spec_mask(batch_size: int, q_length: int, kv_length: int | None = None) -> torch.Tensor:
    """The attention_mask that says "no padding" to a model whose attention is a tuned run:
    [B, 1, Nq, Nk] bool, every entry True, a stride-0 view of one CPU element (no memory, no GPU
    work; build it once per shape). Only cubridge's attention accepts it (is_spec_mask); SDPA or
    eager would read it as attend-everything."""
    kv_length = q_length if kv_length is None else kv_length
    return torch.ones((), dtype=torch.bool).expand(batch_size, 1, q_length, kv_length)


def is_spec_mask(mask, query, key) -> bool:
    """Whether `mask` is a spec_mask for these q [B, Hq, Nq, D] / k [B, Hkv, Nk, D]: a constant
    (all strides 0) CPU bool [B, 1, Nq, Nk] whose one value is True. A padding mask varies along
    the keys, so it is never all-stride-0; a materialised all-True mask is not one either."""
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.device.type == "cpu"
            and mask.dim() == 4 and not any(mask.stride())):
        return False
    if tuple(mask.shape) != (query.shape[0], 1, query.shape[2], key.shape[2]) or mask.numel() == 0:
        return False
    # its one byte, read from host memory: no dispatcher call (item() is one per layer), no GPU sync
    return torch.compiler.is_compiling() or ctypes.c_bool.from_address(mask.data_ptr()).value


def attention_forward(attn):
    """The function transformers calls per layer: (module, q, k, v, attention_mask, ...) ->
    (out [B, N, Hq, D], None)."""
    def forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                **kwargs):
        if attention_mask is not None and not is_spec_mask(attention_mask, query, key):
            raise LaunchError(f"attention_mask of shape {tuple(attention_mask.shape)}: the tuned kernel applies its "
                              "spec's mask and cannot take another", where=WHERE,
                              hint="call the model without attention_mask (no padding) or with "
                                   "attention_mask=spec_mask(B, N), or use attn_implementation='sdpa'")
        if attention_mask is not None and query.shape[2] != key.shape[2]:
            raise LaunchError(f"{query.shape[2]} queries against {key.shape[2]} keys with a spec_mask: a decode "
                              "step or a cached prefix", where=WHERE,
                              hint="run the tuned kernel on full sequences (use_cache=False), or generate with 'sdpa'")
        if dropout and module.training:
            raise LaunchError(f"attention dropout {dropout} in training mode", where=WHERE,
                              hint="model.eval(), or set attention_dropout: 0.0 in the model config")
        if kwargs.get("output_attentions"):
            raise LaunchError("output_attentions=True: the kernel never forms the attention matrix", where=WHERE,
                              hint="use attn_implementation='eager' for attention weights")
        is_causal = kwargs.get("is_causal")
        if (is_causal is False or getattr(module, "is_causal", True) is False) and attn.dispatch["spec_name"] != "full":
            raise LaunchError(f"a bidirectional attention layer ({type(module).__name__}) and a "
                              f"{attn.dispatch['spec_name']!r} kernel", where=WHERE,
                              hint="register a run of the 'full' spec for bidirectional layers")
        out = attn(*autocast_inputs(attn, query, key, value), scale=scaling)
        return out.transpose(1, 2), None
    return forward


def autocast_inputs(attn, *tensors):
    """q, k, v as the kernel's dtype under autocast to it (float32 weights, bf16 compute): Llama's
    rotary embedding hands q and k over in float32 there (cos / sin follow the float32 hidden
    states; transformers 5.17), and SDPA casts them itself. Outside autocast, or under autocast
    to another dtype, they pass unchanged and the op's dtype check names the mismatch."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != attn.dtype:
        return tensors
    return tuple(t.to(attn.dtype) if t.is_floating_point() else t for t in tensors)


def no_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
            mask_function=None, attention_mask=None, **kwargs):
    """The mask function transformers calls once per forward: the kernel needs none, so this
    returns None after refusing what a None mask would silently drop."""
    from transformers.masking_utils import causal_mask_function
    if q_length != kv_length or q_offset or kv_offset:
        raise LaunchError(f"{q_length} queries against {kv_length} keys (offsets {q_offset}, {kv_offset}): a decode "
                          "step or a cached prefix", where=WHERE,
                          hint="run the tuned kernel on full sequences (use_cache=False), or generate with 'sdpa'")
    if mask_function is not None and mask_function is not causal_mask_function:
        raise LaunchError("the model asked for a mask beyond the causal default (packed sequences or a mask overlay)",
                          where=WHERE, hint="pass one sequence per batch row, without position_ids that pack several")
    if attention_mask is not None:
        if torch.compiler.is_compiling():
            raise LaunchError("attention_mask given under torch.compile: whether it pads cannot be checked there",
                              where=WHERE, hint="call the model without attention_mask")
        if not bool(attention_mask.all()):
            raise LaunchError("attention_mask has zeros (padding): the tuned kernel attends every position its spec "
                              "allows", where=WHERE, hint="batch sequences of one length without padding, or use 'sdpa'")
    return None
