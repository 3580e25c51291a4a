"""FlexAttention as the corpus benchmarks call it (bench_corpus, variant_tiles --flex-flash): a
compiled call on (q, k, v) with the spec's mods, the block mask built per batch / head where the
mask reads b / h, and whether FlexAttention's FLASH backend (FA4's CuTe DSL) can run here."""
from __future__ import annotations

from cubridge.runtime.timing import compiled_flex_attention
from cubridge.transfer.trace import trace_mask


def block_mask_dims(hooks, b: int, hq: int) -> tuple[int | None, int | None]:
    """(B, H) for create_block_mask: a mask that reads the batch or head index needs its own block
    table per batch / head (with None, FlexAttention would take batch 0 / head 0's full blocks for
    every batch and head, skipping mask_mod where it must not: padded_causal, packed_sequences,
    ag_head_mask); one that does not is broadcast."""
    uses = trace_mask(hooks.mask_mod).uses
    return (b if "b" in uses else None), (hq if "h" in uses else None)


def flash_available() -> str | None:
    """None when FlexAttention's FLASH backend can run here, else why not (it needs FA4's CuTe DSL
    package, flash_attn.cute, which the device has only when the coordinator unpacks it)."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:       # noqa: BLE001 - missing package or a missing shared library
        return f"flash_attn.cute not importable ({type(e).__name__}: {str(e)[:120]})"
    return None


def flex_fn(hooks, q, k, v, backend=None):
    """A compiled FlexAttention call on (q, k, v), compiled now (the first call). `hooks`: the
    spec's hooks at this shape (spec.hooks_for(..., B=b))."""
    fx, cbm = compiled_flex_attention()
    b, hq, n, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    hooks = hooks.for_flex(n, nk)
    bm = None
    if hooks.mask_mod is not None:
        mb, mh = block_mask_dims(hooks, b, hq)
        # Per batch / head at 8k the eager mask would materialise B * H * N^2 pairs (4 G): compile it.
        bm = cbm(hooks.mask_mod, mb, mh, n, nk, device="cuda", _compile=mb is not None or mh is not None)
    opts = {"BACKEND": backend} if backend else None
    gqa = q.shape[1] != k.shape[1]
    call = lambda: fx(q, k, v, score_mod=hooks.score_mod, block_mask=bm, enable_gqa=gqa,  # noqa: E731
                      kernel_options=opts)
    call()
    return call
