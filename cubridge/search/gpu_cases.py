"""The shapes a candidate is verified at on the GPU before its time counts (issue 20, Deliver 1).

The first GPU check ran three fixed cases at the target's heads with Nq == Nk: a kernel wrong only
with fewer queries than keys, only under GQA, only past two turns of the KV ring at one BLOCK_N,
or only where a window's far edge shows (N > window) verified and was timed. Each tile config the
tuner times now gets, besides those three:

- many KV tiles (two turns of the ring at its BLOCK_N / STAGES, ragged end) under MQA;
- Nq < Nk, queries end-aligned at an offset that is no tile multiple, one and several query tiles;
- the spec's structure length: the shortest of a few lengths at which every kind of tile of the
  spec's mask occurs (empty / partial / full, below / across / above the diagonal), so a sliding
  window of 4096 is checked past 4096 and a document mask where documents span whole tiles;
- each distinct query length of the targets below their key length (capped, see below).

A variant that reads a runtime table (document ids) takes the block-table path at every case: its
binder builds the table per shape.

Example:
    >>> [c.label for c in check_cases(32, 8, {"BLOCK_M": 128, "BLOCK_N": 64, "STAGES": 2}, [])][:2]
    ['B=1 Hq=32 Hkv=1 Nq=333 Nk=333 seed=10', 'B=1 Hq=32 Hkv=8 Nq=133 Nk=327 seed=11']
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Key lengths of the target checks are capped: the golden is float64 N x N on the GPU.
MAX_CHECK_KEYS = 2048
# Structure lengths tried (ragged: +37); the golden at the longest, one query head, is ~0.5 GiB
# per N x N float64 matrix.
STRUCTURE_LENGTHS = (1024 + 37, 2048 + 37, 4096 + 37, 8192 + 37)
_STRUCTURE: dict = {}        # (spec, params, tile, heads) -> length or None, per worker process


@dataclass(frozen=True)
class CheckCase:
    B: int
    Hq: int
    Hkv: int
    Nk: int
    seed: int
    Nq: int | None = None     # None: Nq = Nk

    @property
    def label(self) -> str:
        return f"B={self.B} Hq={self.Hq} Hkv={self.Hkv} Nq={self.Nq or self.Nk} Nk={self.Nk} seed={self.seed}"


def check_cases(hq: int, hkv: int, cuir: dict, shapes, structure: int | None = None) -> list[CheckCase]:
    """Every case of one tile config `cuir` (BLOCK_M / BLOCK_N / STAGES) for target heads hq / hkv,
    the targets `shapes` (TargetShape) and the spec's structure length (structure_length)."""
    bm, bn, st = int(cuir.get("BLOCK_M", 128)), int(cuir.get("BLOCK_N", 64)), int(cuir.get("STAGES", 2))
    # MQA, and GQA with groups of two where the targets are MHA (a KV head picked as h % Hkv
    # instead of h // group agrees with the right one under MHA and MQA alike)
    mqa = 1 if hq > 1 else hkv
    gqa = hkv if hkv < hq else hq // 2 if hq >= 4 and hq % 2 == 0 else mqa
    cases = [CheckCase(1, hq, mqa, bn * (2 * st + 1) + 13, 10),
             CheckCase(1, hq, hkv, bm + 3 * bn + 7, 11, Nq=bm + 5),
             CheckCase(1, hq, gqa, 2 * bm + bn + 9, 12, Nq=2 * bm + 3),
             CheckCase(2, hq, hkv, 300, 0), CheckCase(1, hq, hkv, 1000, 1), CheckCase(1, hq, hkv, 77, 2)]
    if structure is not None:
        cases.append(CheckCase(1, *_small_heads(hq, hkv), structure, 13))
    for nk, nq in _short_query_pairs(shapes):
        cases.append(CheckCase(1, hq, hkv, nk, 3, Nq=nq))
    return cases


def _small_heads(hq: int, hkv: int) -> tuple[int, int]:
    """Two query heads over one KV head (GQA) where the targets have several: the structure case
    is long, and its float64 golden grows with the heads."""
    return (2, 1) if hq >= 2 else (hq, hkv)


def _short_query_pairs(shapes) -> list:
    """(Nk, Nq) of one check per distinct query length below its key length: keys capped at
    MAX_CHECK_KEYS, the queries end-aligned within them."""
    out = []
    for t in shapes:
        nk = min(t.seqlen, MAX_CHECK_KEYS)
        pair = (nk, min(t.nq, nk - 1) if t.nq >= nk else t.nq)
        if t.nq < t.seqlen and pair not in out:
            out.append(pair)
    return out


def structure_length(spec, spec_params: dict, cuir: dict, hq: int, hkv: int, device="cuda",
                     lengths=STRUCTURE_LENGTHS) -> int | None:
    """The shortest of `lengths` at which the spec's mask shows every kind of tile it shows
    at the longest (tile classes at BLOCK_M x BLOCK_N, each with its side of the diagonal); None
    for a spec without a mask_mod (dense: the fixed cases cover it). Cached per worker process."""
    if not spec.has_hooks:
        return None
    bm, bn = int(cuir.get("BLOCK_M", 128)), int(cuir.get("BLOCK_N", 64))
    heads = _small_heads(hq, hkv)
    key = (spec.name, spec.path, repr(sorted(spec_params.items())), bm, bn, heads, tuple(lengths))
    if key not in _STRUCTURE:
        _STRUCTURE[key] = _shortest_complete(spec, spec_params, bm, bn, heads, device, lengths)
    return _STRUCTURE[key]


def _shortest_complete(spec, spec_params, bm, bn, heads, device, lengths) -> int | None:
    longest = tile_kinds(spec, spec_params, lengths[-1], bm, bn, heads, device)
    if longest is None:
        return None
    for n in lengths[:-1]:
        if tile_kinds(spec, spec_params, n, bm, bn, heads, device) == longest:
            return n
    return lengths[-1]


def tile_kinds(spec, spec_params: dict, n: int, bm: int, bn: int, heads, device="cpu") -> frozenset | None:
    """{(class, side)} over the BLOCK_M x BLOCK_N tiles of the spec's mask at Nq = Nk = n (batch 1,
    `heads` (Hq, Hkv)): class 0 empty, 1 partial, 2 full; side -1 wholly below the diagonal, 0
    across it, 1 above. None without a mask_mod. The mask is evaluated one query tile at a time."""
    from cubridge.spec import index_grids, mask_of
    hooks = spec.hooks_for(n, n, heads[0], heads[1], device, B=1, **spec_params)
    if hooks.mask_mod is None:
        return None
    kinds = set()
    nt = -(-n // bn)
    pad = nt * bn - n
    k_lo = torch.arange(nt, device=device) * bn
    k_hi = (k_lo + bn - 1).clamp(max=n - 1)
    for q0 in range(0, n, bm):
        rows = torch.arange(q0, min(q0 + bm, n), device=device)
        m = mask_of(hooks, *index_grids(1, heads[0], rows, n, device))
        m = torch.broadcast_to(m, (1, heads[0], len(rows), n)).reshape(heads[0], len(rows), n)
        # pad the ragged last tile with values that change neither "any" nor "all"
        any_t = torch.nn.functional.pad(m, (0, pad), value=False).view(heads[0], len(rows), nt, bn).any(-1).any(1)
        all_t = torch.nn.functional.pad(m, (0, pad), value=True).view(heads[0], len(rows), nt, bn).all(-1).all(1)
        cls = torch.where(all_t, 2, torch.where(any_t, 1, 0))              # [heads, nt]
        side = torch.where(k_hi <= q0, -1, torch.where(k_lo > int(rows[-1]), 1, 0))
        pairs = torch.stack([cls, side.expand_as(cls)], -1).view(-1, 2).unique(dim=0)
        kinds.update((int(c), int(s)) for c, s in pairs.tolist())
    return frozenset(kinds)
