"""The peers of issue 18 as callables on one shape, and a sampled float64 check that every system
(ours included) must pass before its time counts. Used by bench_peers.py, ab_peer_patches.py and
ncu_compare.py; the backward pair (ours_backward, fa4_backward) by bench_bwd_options.py and ncu_compare.py.

Systems (JSON names): `cubridge/fa3_sm90` (dense: fa3_forward at default_config; a variant: the
rules transfer lowered onto fa3_sm90, as bench_variants.py launches it), `fa4`
(flash_attn.cute.flash_attn_func, BSHD), `flex_flash` (compiled FlexAttention with
kernel_options={"BACKEND": "FLASH"}), `flex` (the same on Triton), `sdpa_cudnn` (SDPA restricted
to the cuDNN backend). A maker returns (fn, note) or raises Unsupported(reason).

The check: a float64 golden of the spec's hooks on sampled rows (the first, middle and last 32
query rows of the last batch entry, query heads 0 and Hq - 1), ref = the same in bf16, and the
verification rule (cubridge.rule.compare) on each system's output at those rows. Full-size goldens
do not fit at 16k (a float64 score matrix per head is 2 GB); rows at both ends and the middle
cover every mask's special regions (global rows, prefix, diagonal, the last answer).
"""
from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

from cubridge import rule
from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
from cubridge.runtime.timing import compiled_flex_attention

DENSE = ("full", "causal")
SAMPLE_ROWS = 32


class Unsupported(Exception):
    """A peer that cannot run this shape or variant; the message is the recorded reason."""


def bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------- systems
POINT = re.compile(r"^(\d+)x(\d+)s(\d+)(p?)$")


def parse_point(label: str) -> dict:
    """'128x160s2p' (the tuner's label: BMxBNsS, p = persistent) -> a fa3_sm90 tile config point."""
    m = POINT.match(label)
    if not m:
        raise ValueError(f"tile config {label!r}: expected BMxBNsS or BMxBNsSp, e.g. 128x160s2p")
    return {"block_m": int(m.group(1)), "block_n": int(m.group(2)), "stages": int(m.group(3)),
            "persistent": bool(m.group(4))}


def point_label(point: dict) -> str:
    return f"{point['block_m']}x{point['block_n']}s{point['stages']}{'p' if point.get('persistent') else ''}"


def product_point(name: str, d: int, n: int, runs: dict | None = None) -> tuple[dict, str]:
    """(point, origin): the tile config the product runs a lowered variant at for (D, N): the bucket
    of a tuned run that holds N (runs: spec name -> run directory; what cubridge.load(DIR) picks),
    else the untuned default that cubridge.op.build.build_run writes (the kernel's variant_default)."""
    import json
    from pathlib import Path

    from cubridge.op.build import default_points
    run = (runs or {}).get(name)
    if run is not None:
        dispatch = json.loads((Path(run) / "dispatch.json").read_text())
        if int(dispatch["head_dim"]) == d:
            for b in dispatch["buckets"]:
                if b["min_seqlen"] <= n and (b["max_seqlen"] is None or n <= b["max_seqlen"]):
                    return dict(b["config"]), f"tuned run {run} ({b['shape']})"
    return default_points("fa3_sm90", d, [n], _wide(name))[n], "untuned default (build_run / variant_default)"


@functools.lru_cache(maxsize=None)
def _wide(name: str) -> bool:
    """cubridge.lower.fa3_sm90.wide_tile of the lowered variant (its untuned default tile depends on it)."""
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.runtime.kernels import reference_kernel
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    cand = transfer(parse_file(reference_kernel("fa3_sm90").cuir_path()), load_spec(name))
    from cubridge.lower.fa3_sm90 import wide_tile
    return wide_tile(lower(cand.program, "fa3_sm90").ir)


def make_ours(name, q, k, v, ours_variants, point: dict | None = None):
    """(fn, note): the dense kernel at its default config, or the lowered variant at `point` (a
    tile config point; None: its default config)."""
    if name in DENSE:
        causal = name == "causal"
        cfg = default_config(q.shape[-1], causal, seqlen=q.shape[2])
        out = torch.full_like(q, float("nan"))          # poisoned: an unwritten element shows
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        note = f"{cfg.block_m}x{cfg.block_n}s{cfg.stages}{'P' if cfg.persistent else 'G'}"
        return (lambda: fa3_forward(q, k, v, causal=causal, config=cfg, out=out, lse=lse)[0]), note
    out = torch.full_like(q, float("nan"))
    run = ours_variants.fn(name, q, k, v, out=out, overrides=point)
    return (lambda: (run(), out)[1]), f"lowered variant, {point_label(point) if point else 'default config'}"


def _fa4_func():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 (any import failure is the reason)
        raise Unsupported(f"flash_attn.cute not importable: {type(e).__name__}: {str(e)[:200]}")
    return flash_attn_func


def fa4_window(name):
    """FA4's (left, right) window for a variant it can express with window_size alone, else None.
    global_sliding_window's 64 global rows / columns are not a window: FA4 direct runs the plain
    window (255, 0) there and the check reports the difference."""
    return {"global_sliding_window": (255, 0)}.get(name)


def make_fa4(name, q, k, v, **options):
    """options: more keyword arguments of flash_attn_func (e.g. pack_gqa=False)."""
    fa = _fa4_func()
    qt, kt, vt = bshd(q), bshd(k), bshd(v)
    if name in DENSE:
        causal, window, note = name == "causal", (None, None), ""
    elif fa4_window(name) is not None:
        causal, window = False, fa4_window(name)
        note = f"window_size={window}: the sliding window without the global tokens"
    else:
        raise Unsupported("FA4 direct takes causal / window_size only; this mask or score needs a "
                          "CuTe DSL mask_mod / score_mod (what flex_flash compiles)")

    def fn():
        out = fa(qt, kt, vt, causal=causal, window_size=window, **options)
        return out[0] if isinstance(out, tuple) else out
    return (lambda: fn().transpose(1, 2)), note


def ours_backward(option: str, causal: bool, q, k, v, dout):
    """fa3_bwd_sm90's fa3_backward with `option` after our dense forward: the callable times the
    backward alone and returns (dq, dk, dv)."""
    import functools

    from cubridge.runtime.autograd import forward_with_lse
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    out, lse = forward_with_lse(q, k, v, causal)
    return functools.partial(fa3_backward, dout, q, k, v, out, lse, causal=causal, option=option)


def fa4_backward(causal: bool, q, k, v, dout, bhnd: bool = True):
    """FA4's backward alone: torch.autograd.grad through one flash_attn_func forward on BSHD leaves
    (its native layout), retain_graph so each call differentiates again. bhnd: gradients returned
    as [B, H, N, D] views (for a check against ours); False leaves them BSHD (ncu: no extra work)."""
    leaves = [bshd(t).requires_grad_() for t in (q, k, v)]
    out = _fa4_func()(*leaves, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    do = bshd(dout)
    if not bhnd:
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
    return lambda: [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, do, retain_graph=True)]


def flex_block_size(backend: str, head_dim: int) -> tuple[int, int]:
    """The BlockMask's (Q, KV) block size for a FlexAttention backend. FLASH (FA4's SM90 forward)
    requires the KV block to be a multiple of its tile_n, which is 80 at head dim 256
    (`_tile_size_fwd_sm90`: 128 x 80; 128 x 128 at D <= 128, whose 128-block mask fits): with the
    default 128 x 128 mask it refuses D 256 ("sparse_block_size[1] to be a multiple of tile_n=80",
    session 13's early call). Triton keeps the default 128 x 128.

    >>> flex_block_size("flash", 256), flex_block_size("flash", 128), flex_block_size("triton", 256)
    ((128, 80), (128, 128), (128, 128))
    """
    return (128, 80) if backend == "flash" and head_dim > 192 else (128, 128)


def _flex(name, hooks, q, k, v, backend):
    if not hooks.flex_expressible:
        raise Unsupported(f"{hooks.normalization!r} normalisation: FlexAttention is softmax only")
    fx, cbm = compiled_flex_attention()
    n_q, n_k = q.shape[2], k.shape[2]
    block = flex_block_size(backend, q.shape[3])
    bm = cbm(hooks.mask_mod, None, None, n_q, n_k, device=q.device, BLOCK_SIZE=block) if hooks.mask_mod else None
    gqa = q.shape[1] != k.shape[1]
    opts = {"BACKEND": "FLASH"} if backend == "flash" else None

    def fn():
        if opts is None:
            return fx(q, k, v, score_mod=hooks.score_mod, block_mask=bm, enable_gqa=gqa)
        return fx(q, k, v, score_mod=hooks.score_mod, block_mask=bm, enable_gqa=gqa, kernel_options=opts)
    return fn, f"BlockMask {block[0]}x{block[1]}" if bm is not None else "no BlockMask"


def flex_autograd(hooks, q, k, v, backend: str):
    """(leaves, forward) for timing FlexAttention's backward: detached copies of q, k, v that require grad and
    the compiled flex_attention call on them with the spec's score / mask mods (backend "flash": FA4's kernels,
    kernel_options BACKEND FLASH). The caller checks hooks.flex_expressible and maps the backend's refusal."""
    fx, cbm = compiled_flex_attention()
    n = q.shape[2]
    kw = {"score_mod": hooks.score_mod,
          "block_mask": cbm(hooks.mask_mod, None, None, n, n, device=q.device) if hooks.mask_mod else None}
    if backend == "flash":
        kw["kernel_options"] = {"BACKEND": "FLASH"}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return leaves, lambda: fx(*leaves, **kw)


def make_flex_flash(name, hooks, q, k, v):
    return _flex(name, hooks, q, k, v, "flash")


def make_flex(name, hooks, q, k, v):
    return _flex(name, hooks, q, k, v, "triton")


def make_cudnn(name, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if name not in DENSE:
        raise Unsupported("SDPA cuDNN has is_causal only: no mask_mod / score_mod")
    causal, group = name == "causal", q.shape[1] // k.shape[1]

    def native():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)
    try:
        native()
        return native, "enable_gqa" if group > 1 else ""
    except RuntimeError:
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def expanded():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)
        return expanded, "K/V expanded to Hq heads"


def makers(name, hooks, q, k, v, ours_variants, point: dict | None = None):
    """system -> zero-argument maker, ours first (a lowered variant at `point`, see make_ours)."""
    return {"cubridge/fa3_sm90": lambda: make_ours(name, q, k, v, ours_variants, point),
            "fa4": lambda: make_fa4(name, q, k, v),
            "flex_flash": lambda: make_flex_flash(name, hooks, q, k, v),
            "sdpa_cudnn": lambda: make_cudnn(name, q, k, v),
            "flex": lambda: make_flex(name, hooks, q, k, v)}


# ---------------------------------------------------------------------------------- the check
def sample_rows(n: int) -> torch.Tensor:
    r = SAMPLE_ROWS
    idx = torch.cat([torch.arange(0, r), torch.arange(n // 2 - r // 2, n // 2 + r // 2), torch.arange(n - r, n)])
    return torch.unique(idx.clamp(0, n - 1))


def sampled_attention(q, k, v, hooks, rows, heads, b, dtype):
    """Attention of the hooks at query rows `rows` of batch b, query heads `heads`, in `dtype`
    (float64: the golden; the kernel dtype: the rule's ref). [len(heads), len(rows), D]."""
    hq, hkv, nk, d = q.shape[1], k.shape[1], k.shape[2], q.shape[3]
    hk = heads // (hq // hkv)
    qs = q[b][heads][:, rows].to(dtype)
    ks, vs = k[b][hk].to(dtype), v[b][hk].to(dtype)
    scores = qs @ ks.transpose(-2, -1) / d ** 0.5
    dev = q.device
    bb = torch.full((1, 1, 1, 1), b, device=dev)
    hh = heads.to(dev).view(1, -1, 1, 1)
    qi = rows.to(dev).view(1, 1, -1, 1)
    ki = torch.arange(nk, device=dev).view(1, 1, 1, -1)
    scores = scores.unsqueeze(0)
    if hooks.score_mod is not None:
        scores = hooks.score_mod(scores, bb, hh, qi, ki).to(dtype)
    mask = (torch.as_tensor(hooks.mask_mod(bb, hh, qi, ki), device=dev).bool()
            if hooks.mask_mod is not None else torch.ones((), dtype=torch.bool, device=dev))
    return (hooks.normalization.apply(scores, mask) @ vs.unsqueeze(0))[0]


class SampledCheck:
    """The rule at sampled rows, golden and ref computed once per shape."""

    def __init__(self, q, k, v, hooks):
        self.b = q.shape[0] - 1
        self.rows = sample_rows(q.shape[2])
        self.heads = torch.tensor(sorted({0, q.shape[1] - 1}))
        self.golden = sampled_attention(q, k, v, hooks, self.rows, self.heads, self.b, torch.float64)
        self.ref = sampled_attention(q, k, v, hooks, self.rows, self.heads, self.b, q.dtype)

    def pick(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, Hq, N, D] (any strides) at the sampled positions."""
        return out[self.b][self.heads.to(out.device)][:, self.rows.to(out.device)]

    def verdict(self, out: torch.Tensor) -> rule.Verdict:
        return rule.compare(self.pick(out), self.golden, self.ref)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the whole output (two systems' full outputs, no golden)."""
    return float((a.float() - b.float()).abs().max())
