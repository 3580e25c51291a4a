"""Reference-guided lowering onto ref_kernels/fa3_sm90/kernel.cu (Hopper, wgmma + TMA).

Regenerates only the regions a transfer may change -- extra_io, kv_range, score, mask, softmax,
epilogue -- and keeps every other line of the reference kernel (roles, pipeline, barriers, TMA).

The iteration space: the tiles a query tile visits form runs (maximal stretches of tiles that may
hold an attended pair), scanned once per work tile from the highest KV tile down; up to
MAX_RUNS runs are kept exactly and the last one absorbs any further ones (its empty tiles then
run as partial, fully masked: correct, a little slower). Full tiles skip the mask entirely.
"""
from __future__ import annotations

import dataclasses
import os

from cubridge.cuir import nodes as N
from cubridge.lower import fusion, itspace, maskclass, regions, rowint, rowrange, saturate, tablerange, tileshare
from cubridge.lower.hooks import c_names, c_tables, extra_io, mask
from cubridge.lower.cexpr import LowerError, c_literal, to_c
from cubridge.lower.fusion import positive_const, split_factor
from cubridge.lower.variant import VariantIR
from cubridge.errors import env_switch

EPILOGUE_NORMALISE = """\
  float inv[2], row_lse[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = st.row_sum[half];
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    const bool attended = sum > 0.f;                       // else: no key attended, O = 0, lse = -inf
    inv[half] = attended ? 1.f / sum : 0.f;
    row_lse[half] = attended ? st.row_max[half] + __logf(sum) : kNegInf;
  }
"""


# Session 10's codegen beyond the mask-only family, each off until a GPU run measures it (knob
# experiments/patches/knobs/variant_codegen.patch sets it for every variant): a score_mod (session 13
# mid call: ag_relative_positional 0.855 vs 0.822 of dense causal, 128 x 128) and a block table per
# (batch, head) (ptxas, 128 x 128: padded_causal 0 -> 0 spilled bytes, packed_sequences 10 -> 6,
# ag_head_mask 0 -> 0, document 10 -> 6; the tables not per (b, h) spill more: share_question 0 -> 6).
SCORE_MOD_CODEGEN = True
TABLE_BH_CODEGEN = True


def session10_codegen(ir: VariantIR) -> bool:
    """Does the variant take the dense kernel's session-10 codegen (kernel.cu kNewCodegen)? A softmax
    variant with no block table: session 12's mid call measured prefixlm, causal_blockwise, ag_causal
    (+3.4-4.9% at 128 x 176) and global_sliding_window (+1-2% at 128 x 128) with it; session 13 / 14's
    mid calls a score_mod, ag_relative_positional at 128 x 128 (SCORE_MOD_CODEGEN); every one
    spill-free (so are ag_alibi, gemma2_local, fa_local_softcap, t5_encoder_bias at 128 x 128).
    Block-table producers spill with it (share_question 0 -> 6 bytes at 128 x 128, ag_document_sliding
    4 -> 8); the elementwise normalisations were not measured."""
    table_ok = not ir.table or (ir.table_bh and TABLE_BH_CODEGEN)
    return ir.norm == "softmax" and table_ok and (ir.score is None or SCORE_MOD_CODEGEN)


def _dense_family(ir: VariantIR) -> bool:
    """A softmax mask-only variant (no score_mod, no block table): the family whose tile (wide_tile)
    and row intervals (edge_heavy) were measured."""
    return ir.norm == "softmax" and ir.score is None and not ir.table


def _pieces(ir: VariantIR):
    names = c_names(ir, {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int"), "b": ("b", "int"), "h": ("h", "int")})
    return rowint.row_pieces(ir.mask, names, c_tables(ir))


# Session 13 (win13): 128 x 176 executes more masked pairs than 128 x 128 where the mask has edges
# inside the visited range (tileshare.py: ag_sliding_window 0.782 vs 0.890 useful at 8k): a
# one-interval mask goes wide only if its useful share at 176 stays within WIDE_MIN_RATIO of 128's
# (sampled ratios: causal / prefix / block-causal 0.984 wide; mistral 0.967, phi3 0.939,
# ag_sliding_window 0.896 not). Session 13 mid call (H100, variant_tiles, 8k, all verified; x our
# dense causal in the same run): ag_sliding_window 128x128 0.728 vs 128x176 0.649 (+12.2%), phi3
# 0.850 vs 0.813 (+4.5%), mistral 0.924 vs 0.905 (+2.1%). On by default; CUBRIDGE_WIDE_SHARE=0
# restores session 12's rule.
WIDE_SHARE_ENV = "CUBRIDGE_WIDE_SHARE"
WIDE_MIN_RATIO = 0.975


def wide_share_enabled() -> bool:
    return env_switch(WIDE_SHARE_ENV, "1", f"unset {WIDE_SHARE_ENV} (session 12's rule) or set it to 0 / 1", LowerError)


# A mask with the arithmetic range runs the dense kernel's code: 128 x 128 at 8k (session 14 mid call).
# RANGE_WIDE_FROM: the length from which it takes 128 x 176 (the dense causal's from 16k), None: never.
# Session 15 mid call (H100, 16k, MHA, x our dense causal 176 in the same run; its 128: 0.993): 128 / 176
# ag_causal 0.993 / 1.005, prefixlm 1.001 / 1.017, llama4_chunked 0.957 / 0.921 (its 8192-key chunks cut
# 176-wide tiles; the share rule samples 8k, where chunk = N): +1.2 / +1.6 / -3.8%, not taken.
# Session 16 (var16): the chunk-edge-aware rule, CUBRIDGE_RANGE_WIDE=1 (default RANGE_WIDE_DEFAULT, off until
# measured): the share is sampled at the lengths the choice applies to (RANGE_SHARE_LENGTHS: 16k and 32k, where
# chunk edges inside N show) and 176 is taken only where it keeps RANGE_WIDE_MIN_RATIO of 128's share at each.
# Sampled 176 / 128 ratios at 16k: ag_causal / ag_prefix_lm / causal_blockwise 0.990, llama4_chunked 0.972
# (prefixlm reads its prefix as a scalar: not evaluated, kept). 0.985 is where the s15 numbers cross zero
# (ratio 0.990: +1.2 / +1.6%; 0.972: -3.8%; linear between them).
# Session 16 mid call (H100, 16k MHA, 176 over 128, same run): ag_causal +0.8%, prefixlm +1.4%, ag_prefix_lm +1.5%,
# llama4_chunked -3.6% (refused by the rule). On by default since the session 16 final call: tests/gpu/
# test_row_range.py's 176 cases passed (20), and ag_prefix_lm at 16k (GQA 32/8, rotated round-robin beside Flex
# Triton) read 176 over 128 1.007x (3.101 vs 3.123 ms). CUBRIDGE_RANGE_WIDE=0 keeps 128.
RANGE_WIDE_ENV = "CUBRIDGE_RANGE_WIDE"
RANGE_WIDE_DEFAULT = "1"
RANGE_WIDE_AT = 16384
RANGE_WIDE_FROM = None
RANGE_WIDE_MIN_RATIO = 0.985
RANGE_SHARE_LENGTHS = (16384, 32768)


def range_wide_from() -> int | None:
    """The length from which a range variant (one interval per row, arithmetic range) may take 128 x
    176: RANGE_WIDE_FROM, or RANGE_WIDE_AT where CUBRIDGE_RANGE_WIDE=1 (RANGE_WIDE_DEFAULT)."""
    on = env_switch(RANGE_WIDE_ENV, RANGE_WIDE_DEFAULT,
                    f"unset {RANGE_WIDE_ENV} (default {RANGE_WIDE_DEFAULT}) or set it to 0 / 1", LowerError)
    return RANGE_WIDE_AT if on else RANGE_WIDE_FROM


def range_shares_keep_wide(mask) -> bool:
    """Does 176 keep RANGE_WIDE_MIN_RATIO of 128's useful share at every length of RANGE_SHARE_LENGTHS
    (a mask that cannot be evaluated, e.g. one reading a scalar: yes)?"""
    for n in RANGE_SHARE_LENGTHS:
        shares = tileshare.useful_shares(mask, n=n)
        if shares is not None and shares[176] < RANGE_WIDE_MIN_RATIO * shares[128]:
            return False
    return True


def wide_tile(ir: VariantIR) -> bool | int:
    """Does the variant default to the dense kernel's 128 x 176 from 8k (runtime default_config's
    `wide`)? session10_codegen, one interval of keys per row (a near-dense mask: prefix, block
    causal, causal, chunks), and (unless CUBRIDGE_WIDE_SHARE=0) a useful share (tileshare.py) at
    176 within WIDE_MIN_RATIO of 128's where the mask can be evaluated: windows keep 128 x 128, as
    does global_sliding_window (two pieces). A mask with the arithmetic range (rowrange.py, on by
    default at D 128) runs the dense kernel's code and takes its 8k tile, 128 x 128: session 14 mid
    call (H100, 8k, x our dense causal 128 x 176 in the same run; dense 128 x 128 1.020): 128x128 /
    128x176 with the range ag_causal 1.019 / 1.006, ag_prefix_lm 1.027 / 1.015, llama4_chunked
    1.017 / 1.003, prefixlm 1.050 / 1.039); an int, range_wide_from(), for those where set and the
    share rule at the lengths it applies to (range_shares_keep_wide) allows: the length from which
    they take 176 (default_config's `wide`)."""
    pieces = _pieces(ir)
    if not (_dense_family(ir) and pieces is not None and len(pieces) == 1):
        return False
    ranged = rowrange.row_range_define() != "0" and rowint.row_range(ir.mask, _mask_names(ir), c_tables(ir))
    if ranged:
        wide_from = range_wide_from()
        if not wide_from or (wide_share_enabled() and not range_shares_keep_wide(ir.mask)):
            return False
        return wide_from
    shares = tileshare.useful_shares(ir.mask) if wide_share_enabled() else None
    if not (shares is None or shares[176] >= WIDE_MIN_RATIO * shares[128]):
        return False                    # a window: 176 cuts more partial tiles
    return True


def kv_range(ir: VariantIR) -> str:
    """The iteration space, then the partial tiles' mask classes (maskclass.py; used by a consumer
    that dispatches on them, experiments/patches/mask_classes.patch, else dead code), and
    CUIR_VARIANT_CODEGEN where session10_codegen."""
    t = itspace.FA3
    classes = maskclass.tile_class_fn(ir, itspace.region_names(ir, t), c_tables(ir), t.block_n, t.len_k)
    codegen = ("// session10_codegen (cubridge/lower/fa3_sm90.py): kernel.cu's kNewCodegen for this variant too.\n"
               "#define CUIR_VARIANT_CODEGEN 1\n") if session10_codegen(ir) else ""
    head0 = itspace.head_zero_define(ir, t)
    scan = itspace.kv_range_region(ir, t)
    rows = rowint.row_range(ir.mask, _mask_names(ir), c_tables(ir)) if ir.mask is not None else None
    if rows is not None:
        return head0 + rowrange.region(ir, t, rows, scan) + classes + codegen
    table = tablerange.table_rows(ir, _mask_names(ir), c_tables(ir))
    if table is not None:
        return head0 + tablerange.region(ir, t, *table, scan) + classes + codegen
    return head0 + scan + classes + codegen


def _mask_names(ir: VariantIR) -> dict:
    """CuIR name -> C text in the mask region's functions (and rowrange's row_key_lo / hi)."""
    return c_names(ir, {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int"), "b": ("b", "int"), "h": ("h", "int")})


# Row-interval masks (rowint.py): partial tiles test [lo, hi) per column. Session 12's mid call:
# global_sliding_window (two pieces) +7.2 / +5.1 / +5.9% at 1k / 4k / 8k; one-piece masks (prefixlm,
# causal_blockwise, ag_causal at 128 x 176) -0.8..+0.2%: on by default for two-piece masks, and
# (session 13 mid call, at 128 x 128) for one-piece masks whose useful share at 128 is below
# EDGE_SHARE (many partial tiles): ag_sliding_window (0.89) +1.9%, phi3 (0.94) +0.6%.
# CUBRIDGE_MASK_ROWS=1 / 0 turns it on / off for every proven mask; the generated mask_rows is
# emitted either way (unused when off).
MASK_ROWS_ENV = "CUBRIDGE_MASK_ROWS"


EDGE_SHARE = 0.95


def mask_rows_enabled(pieces: int, edge_heavy: bool = False) -> bool:
    value = os.environ.get(MASK_ROWS_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise LowerError(f"{MASK_ROWS_ENV}={value!r} is neither 0, 1 nor auto",
                         hint=f"unset {MASK_ROWS_ENV} (auto: two-piece and edge-heavy masks) or set it to 0 / 1")
    return value == "1" or (value == "auto" and (pieces == 2 or (pieces == 1 and edge_heavy)))


def edge_heavy(ir: VariantIR) -> bool:
    """Is the mask's useful share of its visited 128-wide tiles below EDGE_SHARE (tileshare.py)?
    Asked of session10_codegen variants only: the measured family (score_mod ones, e.g.
    fa_local_softcap at 0.91, were not measured with it)."""
    if not _dense_family(ir):
        return False
    shares = tileshare.useful_shares(ir.mask)
    return shares is not None and shares[128] < EDGE_SHARE


def mask_region(ir: VariantIR) -> str:
    names = c_names(ir, {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int"), "b": ("b", "int"), "h": ("h", "int")})
    pieces = _pieces(ir)
    return (mask(ir) + maskclass.mask_class_fn(ir, names, c_tables(ir))
            + rowint.mask_rows_region(ir.mask, names, c_tables(ir),
                                      mask_rows_enabled(len(pieces or ()), len(pieces or ()) == 1 and edge_heavy(ir))))


ELEMENTWISE_REGION = """\
{comment}
struct SoftmaxState {{ float row_max[2]; float row_sum[2]; }};
__device__ __forceinline__ void softmax_init(SoftmaxState& st) {{
  st.row_max[0] = st.row_max[1] = 0.f;
  st.row_sum[0] = st.row_sum[1] = 0.f;
}}
__device__ __forceinline__ void softmax_update(const VariantArgs& va, float (&s)[kSRegs],
                                               SoftmaxState& st, float (&rescale)[2],
                                               float score_scale) {{
  rescale[0] = rescale[1] = 1.f;
{body}
}}
__device__ __forceinline__ void rescale_o(float (&o)[kORegs], const float (&rescale)[2]) {{}}
"""


def softmax(ir: VariantIR, reference_body: str) -> str:
    """The softmax region: the reference's online softmax, or an elementwise normalisation (no
    running max, no row sum, no rescale of O)."""
    if ir.norm == "softmax":
        return reference_body
    arg = to_c(ir.norm_arg, c_names(ir, {}), c_tables(ir))
    fused = fusion.softcap_sigmoid(ir)
    if fused is not None:
        return _softcap_sigmoid(fused, arg)
    if ir.norm == "sigmoid":
        p = f"cuir_sigmoid(s + {arg})"
        # sigmoid(z) = 0.5 tanh(z / 2) + 0.5: the halving rides in the argument's FFMA.
        setup = f"  const float half_scale = 0.5f * score_scale, half_bias = 0.5f * {arg};"
        body = "s[i] = cuir_sigmoid_half(fmaf(s[i], half_scale, half_bias));"
    else:
        p = f"fmaxf(s, 0.f) * {arg}"
        setup = f"  const float p_scale = score_scale * {arg};"
        body = "s[i] = fmaxf(s[i], 0.f) * p_scale;    // score_scale > 0 commutes with relu"
    comment = (f"// Generated by cubridge.lower: {ir.norm} normalisation. No running max, no row sum, no rescale of\n"
               f"// O, no final division: P = {p} elementwise (a masked s = -inf gives 0),\n"
               "// s = S * score_scale (the kernel leaves the scaling to this region when score_mod is identity).")
    return ELEMENTWISE_REGION.format(comment=comment, body=f"{setup}\n#pragma unroll\n  for (int i = 0; i < kSRegs; ++i) {body}")


def _softcap_sigmoid(f: fusion.SoftcapSigmoid, arg: str) -> str:
    c0, c1, c2 = (c_literal(c) for c in f.coeffs())
    lo, hi = (c_literal(v) for v in fusion.K_RANGE)
    comment = f"""\
// Generated by cubridge.lower: sigmoid normalisation with the softcap {f.amp:g} * tanh({f.rate:g} * s) fused into
// it (cubridge/lower/fusion.py): P = sigmoid(y + {arg}), y the softcapped score, elementwise. S
// stays raw q.k (score_mod is left to this region) and score_scale is the softmax scale. Where
// |bias| <= {f.bias_max:.4g}, y is an odd degree-5 polynomial of u = x * k whose error moves P by at most
// 2^-12 (the sigmoid saturates where the polynomial departs from tanh): one MUFU op per score.
// Otherwise the tanh itself. No running max, no row sum, no rescale of O, no final division."""
    body = f"""\
  const float bias = {arg}, half_bias = 0.5f * bias;
  const float k = score_scale * {c_literal(f.rate)};   // u = x * k
  if (fabsf(bias) <= {c_literal(f.bias_max)} && k >= {lo} && k <= {hi}) {{
    // h = (y + bias) / 2 = x * (c0 + c1 x^2 + c2 x^4) + bias / 2; a masked x = -inf gives h = -inf
    const float k2 = k * k, c0 = {c0} * k, c1 = {c1} * (k * k2), c2 = {c2} * (k * k2 * k2);
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {{
      const float x = s[i], w = x * x;
      s[i] = cuir_sigmoid_half(fmaf(x, fmaf(w, fmaf(w, c2, c1), c0), half_bias));
    }}
  }} else {{
#pragma unroll
    for (int i = 0; i < kSRegs; ++i)   // a masked -inf gives exactly 0
      s[i] = s[i] == kNegInf ? 0.f : cuir_sigmoid_half(fmaf(cuir_tanh(s[i] * k), {c_literal(0.5 * f.amp)}, half_bias));
  }}"""
    return ELEMENTWISE_REGION.format(comment=comment, body=body)


def epilogue(ir: VariantIR, reference_body: str) -> str:
    if ir.norm == "softmax":
        return reference_body
    if EPILOGUE_NORMALISE not in reference_body:
        raise LowerError("the fa3_sm90 epilogue no longer has the expected normalisation block",
                         hint="update EPILOGUE_NORMALISE in cubridge/lower/fa3_sm90.py to match kernel.cu")
    return reference_body.replace(EPILOGUE_NORMALISE,
                                  "  // Generated by cubridge.lower: no row normalisation for "
                                  f"{ir.norm}; no LSE.\n"
                                  "  float inv[2] = {1.f, 1.f}, row_lse[2] = {kNegInf, kNegInf};\n")


def _is_expr(v) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def _map_children(e, fn):
    """e with fn applied to each child expression (also inside tuples: args, (name, expr) kwargs)."""
    def item(v):
        if _is_expr(v):
            return fn(v)
        if isinstance(v, tuple):
            return tuple(item(x) for x in v)
        return v
    return dataclasses.replace(e, **{f.name: item(getattr(e, f.name)) for f in dataclasses.fields(e)
                                     if f.compare})


def _fold_input_scale(e, bound: dict):
    """Rewrites the uses of s (= x * scale): s * c, c * s and s / c (c a positive constant) become
    one name bound to x * (scale * c), whose product of two uniforms nvcc computes once, not per
    score; any other s becomes x * scale. `bound` collects the new names' C text."""
    if isinstance(e, N.BinOp) and e.op in ("*", "/"):
        pairs = ((e.left, e.right), (e.right, e.left)) if e.op == "*" else ((e.left, e.right),)
        for s_side, c_side in pairs:
            c = positive_const(c_side)
            if isinstance(s_side, N.Name) and s_side.id == "s" and c is not None:
                name = f"__s{len(bound)}"
                bound[name] = (f"(x * (scale * {c_literal(c if e.op == '*' else 1.0 / c)}))", "float")
                return N.Name(name)
    if isinstance(e, N.Name):
        return N.Name("__sx") if e.id == "s" else e
    return _map_children(e, lambda child: _fold_input_scale(child, bound)) if _is_expr(e) else e


SCORE_SIGNATURE = ("__device__ __forceinline__ float score_mod(const VariantArgs& va, float x, float scale, int b, int h,\n"
                   "                                           int q_idx, int kv_idx) {\n")


def score_region(ir: VariantIR) -> str:
    """score_mod(x, scale, ...) with kScoreFactor (its positive constant factor, which the
    normalisation folds into its first FFMA) and kScoreModIdentity (no score_mod: the softmax
    region applies the scale to raw scores)."""
    if ir.score is None or fusion.softcap_sigmoid(ir) is not None:
        fused = ("" if ir.score is None else "// Generated by cubridge.lower: the softcap score_mod is fused into the sigmoid\n"
                 "// normalisation (region softmax), which gets the raw q.k.\n")
        return (fused + "constexpr bool kScoreModIdentity = true;\nconstexpr float kScoreFactor = 1.f;\n"
                + SCORE_SIGNATURE + "  return x * scale;\n}\n")
    factor, inner = split_factor(ir.score)
    bound = {"__sx": ("(x * scale)", "float")}
    inner = _fold_input_scale(inner, bound)
    names = c_names(ir, {"iq": ("q_idx", "int"), "ik": ("kv_idx", "int"), "b": ("b", "int"), "h": ("h", "int"),
                        **bound})
    expr = to_c(inner, names, c_tables(ir))
    return ("// Generated by cubridge.lower: score = kScoreFactor * score_mod(va, x, scale, ...), x the raw\n"
            "// q.k; the factor is folded into the normalisation's first FFMA.\n"
            f"constexpr bool kScoreModIdentity = false;\nconstexpr float kScoreFactor = {c_literal(factor)};\n"
            + _saturation(ir) + SCORE_SIGNATURE + f"  return {expr};\n}}\n")


# A side that does not saturate: a bound no tile's distances reach (positions stay below 2^30), so
# q_idx + bound cannot overflow in the instantiation that never runs.
_NO_SIDE = 1 << 30


def _saturation(ir: VariantIR) -> str:
    """The CUIR_SAT_LO / CUIR_SAT_HI defines of kernel.cu's kSaturates, where saturate.py proves
    the score constant in d past them; nothing otherwise (the kernel then keeps one path)."""
    sat = saturate.saturation(ir.score)
    if sat is None:
        return ""
    lo, hi = (max(sat[0], -_NO_SIDE), min(sat[1], _NO_SIDE))
    return ("// The score reads q_idx and kv_idx only through d = kv_idx - q_idx and does not change for\n"
            f"// d <= {lo} or d >= {hi} (cubridge/lower/saturate.py): full tiles past a bound evaluate it there.\n"
            f"#define CUIR_SAT_LO ({lo})\n#define CUIR_SAT_HI ({hi})\n")


def lower_source(reference: str, ir: VariantIR) -> str:
    if ir.dense_reference:
        return reference
    bodies = {name: regions.body(reference, name) for name in ("softmax", "epilogue")}
    return regions.replace(reference, {
        "extra_io": extra_io(ir), "kv_range": kv_range(ir), "score": score_region(ir), "mask": mask_region(ir),
        "softmax": softmax(ir, bodies["softmax"]), "epilogue": epilogue(ir, bodies["epilogue"]),
    })
