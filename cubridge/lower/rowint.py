"""Row-interval masks: where a mask, for each query row, keeps one interval of keys.

For a mask whose kept keys in every row q are {k : lo(q) <= k < hi(q)} (lo, hi free of the key
index), a partial tile can compute [lo, hi) once per row and tile, move it to the tile's column
origin, and test each element with one compare pair against an immediate column offset (FA4's
"column limit per row" for causal) instead of the whole predicate per element: prefixlm's
`(kv <= q) | (kv < P)` is k < max(q + 1, P); causal_blockwise's `q // 256 >= kv // 256` is
k < (q // 256 + 1) * 256.

The analysis is structural and refuses (returns None) whatever it cannot prove:
- an atom compares the key index, as +-ik plus key-free int terms (or ik // c, c > 0), with a
  key-free int: ik < t, ik <= t, ik > t, ik >= t, ik == t;
- a key-free boolean p (q < 64, a head test) is the whole row or none of it;
- `&` intersects piece by piece, `|` unites; pieces that are provably one interval (both unbounded
  below, or both above) merge; more than MAX_PIECES (2) pieces are refused;
- `not` is pushed through atoms and connectives (De Morgan).
global_sliding_window, (kv <= q & q - kv < 256) | kv < 64 | q < 64, is two pieces: the window and
the global columns (both the whole row where q < 64). kernel.cu clips them to each tile and
merges them there (tile_row_interval); a warp with a row of two disjoint pieces in a tile (tile 0
of rows 320-382 at 128 x 128) evaluates mask_pred. A gathered key (share_question) is refused.

`mask_rows_region` emits `mask_rows(va, b, h, q_idx, lo, hi)` (arrays of kMaskPieces) and
`kMaskRowLo` (false where no piece is bounded below: the kernel then skips that compare). The
kernel uses it on partial tiles where CUIR_MASK_ROWS is 1 (off by default until a GPU run says it
wins: CUBRIDGE_MASK_ROWS=1, or the knob experiments/patches/knobs/mask_rows.patch).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cubridge.cuir import nodes as N
from cubridge.lower.cexpr import LowerError, to_c_typed

KEY = "ik"
QUERY = "iq"
BIG = "(1 << 30)"          # past any position (positions stay below 2^30): an unbounded side
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
_NEG = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


@dataclass(frozen=True)
class Rows:
    """Keys lo <= k < hi of a row (C int expressions; None: unbounded on that side)."""
    lo: str | None
    hi: str | None
    # p & R built it (p key-free): (p, R.lo, R.hi); row_pieces(select=True) merges it with its
    # complement !p & R2 into one piece with selected bounds (a per-head choice of interval)
    guard: tuple | None = field(default=None, compare=False)
    # (lo, hi) each nondecreasing in the query index (or unbounded): proven structurally (_mono);
    # row_range() needs both to bound a query tile's keys by its first and last rows
    up: tuple = field(default=(False, False), compare=False)


@dataclass(frozen=True)
class Pred:
    """A key-free boolean (C expression): the whole row where true, no key where false."""
    c: str
    q_free: bool = field(default=False, compare=False)     # does not read the query index


class _Refuse(Exception):
    pass


def _has_key(e, name: str = KEY) -> bool:
    if isinstance(e, N.Name):
        return e.id == name
    if isinstance(e, (N.Const, type(None), str, int, float, bool)):
        return False
    if isinstance(e, tuple):
        return any(_has_key(x, name) for x in e)
    return any(_has_key(getattr(e, f), name) for f in getattr(e, "__dataclass_fields__", {}) if f != "line")


def reads_index(e, name: str = KEY) -> bool:
    """Does the expression read the index `name` (KEY or QUERY)?"""
    return _has_key(e, name)


def _combine(*ms):
    """The direction of a sum / max / min of terms with directions ms (+1 nondecreasing in the
    query index, -1 nonincreasing, 0 free of it, None unknown)."""
    if None in ms:
        return None
    moving = {m for m in ms if m}
    return moving.pop() if len(moving) == 1 else (0 if not moving else None)


def _neg(m):
    return None if m is None else -m


def _int_const(e) -> int | None:
    return e.value if isinstance(e, N.Const) and type(e.value) is int else None


def _mono(e):
    """How the int expression e moves with the query index iq (the key index counts as fixed):
    +1 / -1 / 0 / None (not proven) through +, -, negation, max / min, products and floor
    divisions by int constants. A table read of iq, a modulo, a select on iq: None."""
    if not _has_key(e, QUERY):
        return 0
    if isinstance(e, N.Name):
        return 1
    if isinstance(e, N.UnaryOp) and e.op == "-":
        return _neg(_mono(e.operand))
    if isinstance(e, N.BinOp) and e.op in ("+", "-"):
        right = _mono(e.right)
        return _combine(_mono(e.left), right if e.op == "+" else _neg(right))
    if isinstance(e, N.BinOp) and e.op in ("*", "//"):
        c, var = _int_const(e.right), e.left
        if c is None and e.op == "*":
            c, var = _int_const(e.left), e.right
        if not c:
            return None
        return _mono(var) if c > 0 else _neg(_mono(var))    # floor(x / c), c < 0: falls as x grows
    if isinstance(e, N.Call) and e.op in ("maximum", "minimum", "max", "min") and not e.kwargs:
        return _combine(*(_mono(a) for a in e.args))
    return None


def _up(m) -> bool:
    return m is not None and m >= 0


class _Analysis:
    def __init__(self, names: dict, tables: dict, select: bool = False):
        self.names, self.tables, self.select = names, tables, select

    def c(self, e, want: str) -> str:
        text, ty = to_c_typed(e, self.names, self.tables)
        if ty != want:
            raise _Refuse()
        return text

    def formula(self, e, negate: bool = False):
        """Rows or Pred of e (of not e when negate)."""
        if not _has_key(e):
            text = self.c(e, "bool")
            return Pred(f"(!{text})" if negate else text, q_free=not _has_key(e, QUERY))
        if isinstance(e, N.UnaryOp) and e.op in ("not", "~"):
            return self.formula(e.operand, not negate)
        if isinstance(e, N.BinOp) and e.op in ("&", "|"):
            parts = [self.formula(e.left, negate), self.formula(e.right, negate)]
            return _join((e.op == "&") ^ negate, *parts, select=self.select)
        if isinstance(e, N.BoolOp):
            parts = [self.formula(v, negate) for v in e.values]
            out = parts[0]
            for p in parts[1:]:
                out = _join((e.op == "and") ^ negate, out, p, select=self.select)
            return out
        if isinstance(e, N.Compare):
            return self.atom(_NEG[e.op] if negate else e.op, e.left, e.right)
        raise _Refuse()

    def atom(self, op: str, left, right) -> tuple:
        return (self._atom(op, left, right),)

    def _atom(self, op: str, left, right) -> Rows:
        if _has_key(left) and _has_key(right):
            sl, rl = self.linear(left)
            sr, rr = self.linear(right)
            if sl - sr not in (1, -1):
                raise _Refuse()
            # (sl - sr) ik + rl - rr  op  0; rl - rr moves with iq as left - right does (ik fixed)
            rest, m = f"({_sub(rl, rr)})", _combine(_mono(left), _neg(_mono(right)))
            return _bound(op, f"(-{rest})", _neg(m)) if sl - sr == 1 else _bound(_FLIP[op], rest, m)
        if _has_key(right):
            left, right, op = right, left, _FLIP[op]
        t = self.c(right, "int")
        div = self.floor_key(left)
        if div is not None:
            return _bound_div(op, t, div, _mono(right))
        sign, rest = self.linear(left)
        t, m = f"({_sub(t, rest)})", _combine(_mono(right), _neg(_mono(left)))   # sign ik op t - rest
        return _bound(op, t, m) if sign == 1 else _bound(_FLIP[op], f"(-{t})", _neg(m))

    def floor_key(self, e):
        """c where e is ik // c with c a positive int constant, else None."""
        if (isinstance(e, N.BinOp) and e.op == "//" and isinstance(e.left, N.Name) and e.left.id == KEY
                and isinstance(e.right, N.Const) and type(e.right.value) is int and e.right.value > 0):
            return e.right.value
        return None

    def linear(self, e) -> tuple[int, str | None]:
        """(s, r) with e = s * ik + r, s in {1, -1}, r key-free int C text (None: 0)."""
        if isinstance(e, N.Name) and e.id == KEY:
            return 1, None
        if isinstance(e, N.UnaryOp) and e.op == "-":
            s, r = self.linear(e.operand)
            return -s, (None if r is None else f"(-{r})")
        if isinstance(e, N.BinOp) and e.op in ("+", "-"):
            if _has_key(e.left) and not _has_key(e.right):
                s, r = self.linear(e.left)
                other = self.c(e.right, "int")
                return s, _add(r, other if e.op == "+" else f"(-{other})")
            if _has_key(e.right) and not _has_key(e.left):
                s, r = self.linear(e.right)
                if e.op == "-":
                    s, r = -s, (None if r is None else f"(-{r})")
                return s, _add(r, self.c(e.left, "int"))
        raise _Refuse()


def _add(a, b):
    return b if a is None else a if b is None else f"{a} + {b}"


def _sub(a, b):
    return a if b is None else f"{a} - ({b})"


def _bound(op: str, t: str, m=None) -> Rows:
    """ik op t (t moves with the query index as m)."""
    u = _up(m)
    if op == "<":
        return Rows(None, t, up=(True, u))
    if op == "<=":
        return Rows(None, f"{t} + 1", up=(True, u))
    if op == ">":
        return Rows(f"{t} + 1", None, up=(u, True))
    if op == ">=":
        return Rows(t, None, up=(u, True))
    if op == "==":
        return Rows(t, f"{t} + 1", up=(u, u))
    raise _Refuse()                                   # !=: two pieces


def _bound_div(op: str, t: str, c: int, m=None) -> Rows:
    """ik // c op t (floor division, c > 0): ik // c < t iff ik < t c, <= t iff ik < (t + 1) c."""
    u = _up(m)
    if op == "<":
        return Rows(None, f"({t}) * {c}", up=(True, u))
    if op == "<=":
        return Rows(None, f"(({t}) + 1) * {c}", up=(True, u))
    if op == ">":
        return Rows(f"(({t}) + 1) * {c}", None, up=(u, True))
    if op == ">=":
        return Rows(f"({t}) * {c}", None, up=(u, True))
    if op == "==":
        return Rows(f"({t}) * {c}", f"(({t}) + 1) * {c}", up=(u, u))
    raise _Refuse()


def _both(f, a, b):
    return a if b is None else b if a is None else f"{f}({a}, {b})"


MAX_PIECES = 2          # intervals per row the kernel merges per tile (kMaskPieces)


def _cond(pred: Pred, r: Rows, full: bool) -> Rows:
    """p ? everything : r (full), or p ? r : nothing. A p that reads the query index breaks the
    bounds' direction (a row whole or empty by its own index)."""
    p, up = pred.c, r.up if pred.q_free else (False, False)
    if full:
        return Rows(None if r.lo is None else f"({p} ? -{BIG} : {r.lo})",
                    None if r.hi is None else f"({p} ? {BIG} : {r.hi})", up=up)
    return Rows(r.lo, f"({p} ? {r.hi or BIG} : -{BIG})", guard=(p, r.lo, r.hi, all(up)), up=up)


def _meet(a: Rows, b: Rows) -> Rows:
    return Rows(_both("max", a.lo, b.lo), _both("min", a.hi, b.hi), up=_and(a.up, b.up))


def _and(u: tuple, v: tuple) -> tuple:
    return (u[0] and v[0], u[1] and v[1])


def _either(f, a, b):
    """The looser of two bounds of a union (None: unbounded wins)."""
    return None if a is None or b is None else f"{f}({a}, {b})"


def _complement(a: str, b: str) -> bool:
    return a == f"(!{b})" or b == f"(!{a})"


def _select(p: str, a, b) -> str | None:
    """p ? a : b for two bounds of one side (None: unbounded, BIG with the side's sign)."""
    return None if a is None and b is None else f"({p} ? {a} : {b})"


def _unite(pieces: list, select: bool = False) -> tuple:
    """Pieces with those that provably form one interval merged (both unbounded below or above;
    with select, p & R and !p & R2: exactly one holds per row, so p ? R : R2)."""
    out = []
    for r in pieces:
        for i, o in enumerate(out):
            if select and r.guard and o.guard and _complement(r.guard[0], o.guard[0]):
                (p, lo1, hi1, ok1), (_, lo2, hi2, ok2) = o.guard, r.guard
                out[i] = Rows(_select(p, lo1 or f"-{BIG}", lo2 or f"-{BIG}") if (lo1 or lo2) else None,
                              _select(p, hi1 or BIG, hi2 or BIG) if (hi1 or hi2) else None,
                              up=(ok1 and ok2, ok1 and ok2))
                break
            if r.lo is None and o.lo is None:
                out[i] = Rows(None, _either("max", o.hi, r.hi), up=(True, o.up[1] and r.up[1]))
                break
            if r.hi is None and o.hi is None:
                out[i] = Rows(_either("min", o.lo, r.lo), None, up=(o.up[0] and r.up[0], True))
                break
        else:
            out.append(r)
    if len(out) > MAX_PIECES:
        raise _Refuse()
    return tuple(out)


def _join(conj: bool, a, b, select: bool = False):
    """a & b (conj) or a | b: Pred, or a tuple of Rows whose union is the kept keys."""
    if isinstance(a, Pred) and isinstance(b, Pred):
        return Pred(f"({a.c} {'&' if conj else '|'} {b.c})", q_free=a.q_free and b.q_free)
    if isinstance(b, Pred):
        a, b = b, a
    if isinstance(a, Pred):                            # p & R: R or nothing; p | R: everything or R
        return tuple(_cond(a, r, not conj) for r in b)
    if conj:
        return _unite([_meet(x, y) for x in a for y in b], select)
    return _unite([*a, *b], select)


def row_pieces(mask, names: dict, tables: dict, select: bool = False) -> tuple | None:
    """The mask's kept keys per row as a union of at most MAX_PIECES intervals, or None where that
    is not proven (select: a key-free choice between two intervals is one piece, _unite)."""
    if mask is None:
        return None
    try:
        out = _Analysis(names, tables, select).formula(mask)
    except (_Refuse, LowerError):
        return None
    return None if isinstance(out, Pred) else out      # a key-free mask: no per-key work to save


def row_range(mask, names: dict, tables: dict) -> Rows | None:
    """The mask's kept keys per row as one interval [lo, hi) whose bounds never decrease as the
    query index grows (a key-free choice between two intervals, select, allowed), else None: the
    keys a query tile may attend then lie in [lo(first row), hi(last row)), and a KV tile is fully
    attended where it lies in [lo(last row), hi(first row)) (fa3_sm90's arithmetic kv_range)."""
    for select in (False, True):
        pieces = row_pieces(mask, names, tables, select=select)
        if pieces is not None and len(pieces) == 1 and all(pieces[0].up):
            return pieces[0]
    return None


def row_interval(mask, names: dict, tables: dict) -> Rows | None:
    """The mask's kept keys per row as one interval, or None."""
    pieces = row_pieces(mask, names, tables)
    return pieces[0] if pieces is not None and len(pieces) == 1 else None


# Session 14 early call (H100, ag_head_mask 8k, x our dense causal): 128x128 0.841, +variant_codegen
# 0.848, +row_select 0.854 (checks passed).
ROW_SELECT_DEFAULT = True


def mask_rows_region(mask, names: dict, tables: dict, enabled: bool) -> str:
    """mask_rows() and the defines kernel.cu's score_and_mask reads, or "" where refused. Where a
    key-free choice between two intervals (ag_head_mask: causal or window per head) is one piece
    with select (row_pieces), that form follows under CUIR_ROW_SELECT (knob row_select, row
    intervals on): not the default until a GPU run measures it against the two-piece merge."""
    pieces = row_pieces(mask, names, tables)
    if pieces is None:
        return ""
    sel = row_pieces(mask, names, tables, select=True)
    if sel is None or len(sel) >= len(pieces):
        return _rows_region(pieces, enabled)
    return (f"#ifndef CUIR_ROW_SELECT   // 1: the per-row choice of interval as one piece (knob row_select)\n"
            f"#define CUIR_ROW_SELECT {int(ROW_SELECT_DEFAULT)}\n#endif\n#if CUIR_ROW_SELECT\n"
            + _rows_region(sel, True) + "#else\n" + _rows_region(pieces, enabled) + "#endif\n")


def _rows_region(pieces: tuple, enabled: bool) -> str:
    has_lo = len(pieces) > 1 or pieces[0].lo is not None
    sets = "".join(f"  lo[{i}] = {r.lo or '-' + BIG};\n  hi[{i}] = {r.hi or BIG};\n" for i, r in enumerate(pieces))
    return (f"// Row intervals (cubridge/lower/rowint.py): row q_idx keeps the keys lo[i] <= kv_idx < hi[i], i < kMaskPieces.\n"
            f"// CUIR_MASK_ROWS 1: partial tiles compare each column against them (0: mask_pred per element).\n"
            f"#define CUIR_MASK_ROWS {1 if enabled else 0}\n"
            f"constexpr bool kMaskRowLo = {'true' if has_lo else 'false'};\n"
            f"constexpr int kMaskPieces = {len(pieces)};\n"
            "__device__ __forceinline__ void mask_rows(const VariantArgs& va, int b, int h, int q_idx,\n"
            "                                          int (&lo)[kMaskPieces], int (&hi)[kMaskPieces]) {\n"
            f"{sets}}}\n")
