"""The built-in variant specs (docs/DESIGN.md, "Variant specs"); each file is an example of the format.

A spec is a plain Python file; cubridge.spec.load_spec reads it:

- a docstring describing the variant, and `NAME = "..."` (optional; default: the file stem);
- `PARAMS = {...}`: parameters and their benchmark defaults. A default of None means "derived from
  the shape in use" (e.g. the prefix P = Nk // 2); each spec's docstring says how. Every entry is
  passed to `reference` and `hooks` as a keyword argument;
- `reference(q, k, v, **params) -> out` (required): eager PyTorch, the ground truth. q is
  [B, Hq, Nq, D], k and v are [B, Hkv, Nk, D] (GQA: repeat_interleave on dim 1), out is
  [B, Hq, Nq, D]. It computes in its inputs' dtype (verification calls it in float64 for the golden
  output and in bf16/fp16 to measure that dtype's own rounding). score = q.k / sqrt(D) before any
  transform; a masked pair contributes nothing; a row with no attended key gives 0, not NaN;
- queries are aligned to the END of the keys, as in FlashAttention and a KV-cache prefill: with
  Nq <= Nk, query row i sits at absolute position Nk - Nq + i, and mods see that position as q_idx
  (so `kv_idx <= q_idx` is causal with the last query seeing every key). Nq > Nk is refused. A
  reference may be written for Nq == Nk only: cubridge runs it on the Nk-row problem (q padded at
  the front) and keeps the last Nq rows (cubridge.spec.Spec.run_reference);
- optional FlexAttention-compatible hooks, written only with torch ops so they broadcast and vmap:
  module-level `mask_mod(b, h, q_idx, kv_idx)`, `score_mod(score, b, h, q_idx, kv_idx)` and
  `NORMALIZATION` for mods without parameters, or a factory
  `hooks(Nq, Nk, Hq, Hkv, device, **params) -> cubridge.spec.Hooks` for mods that depend on the
  shape or params or capture tensors (built on `device`). When `hooks` exists it is the only source;
  module-level mods are then plain helpers;
- optional `RUNTIME_INPUTS = {"doc_ids": ("B", "Nk")}`: tensors each call supplies (name -> shape,
  or cubridge.inputs.RuntimeInput(shape, dtype, kind)); `reference` and `hooks` get them as keyword
  arguments and mods read them like captured tensors, so they follow the batch instead of being
  frozen at tune time. The tuner and verification use representative values
  (`sample_runtime_inputs(Nq, Nk, Hq, Hkv, B, device, generator, **params)` when defined, else a
  default per kind); cubridge/inputs.py has the details and `document.py` is an example.

Where a definition uses "N", the specs use Nk (the number of keys a query row ranges over).
"""

# docs/DESIGN.md order; cubridge.spec.builtin_specs() returns this list.
BUILTIN = (
    "full",
    "causal",
    "prefixlm",
    "global_sliding_window",
    "causal_blockwise",
    "share_question",
    "relative_pos",
    "relu",
    "sigmoid",
    "composite",
)
# Further specs shipped as examples, loadable by name but outside the ten benchmark variants.
EXAMPLES = ("document",)
