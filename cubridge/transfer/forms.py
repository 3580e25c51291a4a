"""A spec's hooks traced at one shape (a `Form`), the pieces of it the rules transfer and the
binding compare across shapes, and the exact host block table of a mask.

Both cubridge.transfer.rules (the transfer: probes, generalisation) and
cubridge.transfer.call_binding (a call's extra inputs) read forms through here.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

from cubridge.cuir import nodes as N
from cubridge.evalmod import mask_values
from cubridge.transfer.trace import trace_mask, trace_score

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass
class Form:
    """The traced hooks at one shape."""
    mask: object            # CuIR expression or None
    score: object
    norm_kind: str
    bias: object            # CuIR Const
    scale: object
    captures: dict          # name -> tensor

    def nodes(self):
        return (self.mask, self.score, self.bias, self.scale)


# Batch of the probe shapes: 2, so that a mask reading b indexes a runtime input's batch dim.
PROBE_B = 2


def trace_at(spec, Nq, Nk, Hq, Hkv, spec_params, device, *, runtime=None, B=PROBE_B) -> tuple:
    """(fingerprint, numeric constants in traversal order, captured tensors by name) of the spec's
    hooks at one shape: what Candidate.bind needs (cubridge.transfer.call_binding)."""
    form = trace_form(spec, Nq, Nk, Hq, Hkv, spec_params, device, runtime=runtime, B=B)
    return fingerprint(form), consts(form), form.captures


def trace_form(spec, Nq, Nk, Hq, Hkv, spec_params, device, runtime=None, B=PROBE_B) -> Form:
    hooks = spec.hooks_for(Nq, Nk, Hq, Hkv, device, B=B, runtime=runtime, **spec_params)
    mask = trace_mask(hooks.mask_mod) if hooks.mask_mod is not None else None
    score = trace_score(hooks.score_mod) if hooks.score_mod is not None else None
    caps = {**(mask.captures if mask else {}), **(score.captures if score else {})}
    norm = hooks.normalization
    return Form(mask.expr if mask else None, score.expr if score else None, norm.kind,
                 N.Const(float(norm.bias)), N.Const(float(norm.scale)),
                 {c.name: c.tensor for c in caps.values()})


def _is_num(e) -> bool:
    return isinstance(e, N.Const) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool)


def map_consts(e, fn):
    """Rebuild expression e with every numeric constant c replaced by fn(c) (in traversal order)."""
    if e is None:
        return None
    if _is_num(e):
        return fn(e)
    if isinstance(e, (N.BinOp, N.Compare)):
        return replace(e, left=map_consts(e.left, fn), right=map_consts(e.right, fn))
    if isinstance(e, N.UnaryOp):
        return replace(e, operand=map_consts(e.operand, fn))
    if isinstance(e, N.BoolOp):
        return replace(e, values=tuple(map_consts(v, fn) for v in e.values))
    if isinstance(e, N.IfExp):
        return replace(e, test=map_consts(e.test, fn), body=map_consts(e.body, fn), orelse=map_consts(e.orelse, fn))
    if isinstance(e, N.Call):
        return replace(e, args=tuple(map_consts(a, fn) for a in e.args))
    return e


def consts(form: Form) -> list:
    out = []
    for node in form.nodes():
        map_consts(node, lambda c: out.append(c.value) or c)
    return out


def skeleton(form: Form) -> tuple:
    return tuple(map_consts(n, lambda c: N.Const(0)) for n in form.nodes()) + (form.norm_kind, tuple(form.captures))


def fingerprint(form: Form) -> str:
    """skeleton as a short string (CuIR nodes are frozen dataclasses: their repr is canonical)."""
    return hashlib.sha256(repr(skeleton(form)).encode()).hexdigest()[:16]


def block_classes(hooks, B, Hq, Nq, Nk, BM, BN, per_bh, device="cpu") -> torch.Tensor:
    """Class of every (query tile, KV tile): 0 empty, 1 partial, 2 full, from the mask itself
    (exact, at call time). Shape [NQT, NKT], or [B, Hq, NQT, NKT] when the mask reads b or h."""
    nqt, nkt = -(-Nq // BM), -(-Nk // BN)
    offset = Nk - Nq            # queries aligned to the end of the keys
    bs, hs = (B, Hq) if per_bh else (1, 1)
    b = torch.arange(bs, device=device).view(bs, 1, 1, 1)
    h = torch.arange(hs, device=device).view(1, hs, 1, 1)
    kv = torch.arange(nkt * BN, device=device).view(1, 1, 1, -1)
    out = torch.empty(bs, hs, nqt, nkt, dtype=torch.int64, device=device)
    for i in range(nqt):
        q = torch.arange(offset + i * BM, offset + min((i + 1) * BM, Nq), device=device).view(1, 1, -1, 1)
        m = mask_values(hooks.mask_mod, b, h, q, kv.clamp(max=Nk - 1)) & (kv < Nk)
        m = m.expand(bs, hs, q.shape[2], nkt * BN).reshape(bs, hs, q.shape[2], nkt, BN)
        valid = (kv < Nk).reshape(1, 1, 1, nkt, BN)
        anyv = m.any(dim=(2, 4))
        allv = (m | ~valid).all(dim=(2, 4))
        out[:, :, i] = torch.where(allv, FULL, torch.where(anyv, PARTIAL, EMPTY))
    return (out if per_bh else out[0, 0]).to("cpu")
