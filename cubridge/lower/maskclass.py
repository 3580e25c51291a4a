"""Mask classes: on a partial tile, evaluate only the part of the mask that varies there.

A mask is a boolean formula of atoms (comparisons such as `kv <= q`, `q - kv < 256`, `kv < 64`).
On one tile, interval analysis (cubridge.transfer.intervals.classify, per atom) often finds every
atom but one constant; the mask then *is* that atom there (when the formula, with the others'
constants, is true for the atom true and false for it false). global_sliding_window's partial
tiles are like that: the diagonal tile is `kv <= q`, the window's first tile `q - kv < 256`, the
global-column tile `kv < 64`, query tile 0's far tiles `q < 64`. Its whole mask costs ~7.2 SASS
instructions per score (459 per 64 scores of a thread, nvcc 13.0, 128 x 128) against ~2.9 for
causal's one comparison, on 3 of its ~4.8 tiles per query tile.

Classes (what the generated `tile_mask_class` returns for KV tile n of a query tile):
    0            the tile is full: no mask (tile_partial false)
    1            the whole mask (mask_pred)
    2            every pair attended; only the key bound applies (a ragged last tile)
    3 + j        the mask equals atom j on this tile
`mask_pred_class<C>` is the per-element predicate of class C (C >= 1). The consumer that
dispatches on the class is a kernel-side change (experiments/patches/mask_classes.patch); the
reference kernel without it calls tile_partial / mask_pred, and these functions go unused.
"""
from __future__ import annotations

from cubridge.cuir import nodes as N
from cubridge.lower.cexpr import to_c
from cubridge.transfer.intervals import classify

MAX_ATOMS = 6          # more atoms: classes 0-2 only (the instantiations grow the consumer's code)
FIRST_ATOM_CLASS = 3


def _is_bool(e) -> bool:
    if isinstance(e, (N.Compare, N.BoolOp)):
        return True
    if isinstance(e, N.Const):
        return isinstance(e.value, bool)
    if isinstance(e, N.UnaryOp):
        return e.op == "not" or (e.op == "~" and _is_bool(e.operand))
    if isinstance(e, N.BinOp) and e.op in ("&", "|", "^"):
        return _is_bool(e.left) and _is_bool(e.right)
    return False


def _connective(e) -> bool:
    """A boolean connective whose operands are formulas (not an atom)."""
    if isinstance(e, N.BoolOp):
        return True
    if isinstance(e, N.UnaryOp) and e.op in ("not", "~"):
        return _is_bool(e.operand)
    return isinstance(e, N.BinOp) and e.op in ("&", "|") and _is_bool(e.left) and _is_bool(e.right)


def atoms(mask) -> list:
    """The mask's atoms in order of occurrence (each occurrence separately)."""
    if mask is None or not _is_bool(mask):
        return []
    out = []

    def walk(e):
        if not _connective(e):
            if not isinstance(e, N.Const):
                out.append(e)
            return
        kids = e.values if isinstance(e, N.BoolOp) else (e.operand,) if isinstance(e, N.UnaryOp) else (e.left, e.right)
        for k in kids:
            walk(k)
    walk(mask)
    return out


def substitute(mask, values: list):
    """mask with its k-th atom occurrence replaced by values[k] (a CuIR expression)."""
    it = iter(values)

    def sub(e):
        if not _connective(e):
            return e if isinstance(e, N.Const) else next(it)
        if isinstance(e, N.BoolOp):
            return N.BoolOp(e.op, tuple(sub(v) for v in e.values))
        if isinstance(e, N.UnaryOp):
            return N.UnaryOp(e.op, sub(e.operand))
        return N.BinOp(e.op, sub(e.left), sub(e.right))
    return sub(mask)


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _is_ik(e) -> bool:
    return isinstance(e, N.Name) and e.id == "ik"


def isolate_key(atom):
    """`X - ik OP Y` as `ik FLIP(OP) X - Y`, `ik - X OP Y` as `ik OP X + Y` (Y free of ik): the key
    index alone on one side, so per score nvcc compares it with a per-row value and an immediate
    (global_sliding_window's `q - kv < 256`: 128 fewer SASS instructions per masked tile pair,
    nvcc 13.0). Indices and offsets are far from int overflow, as in the interval analysis."""
    if not isinstance(atom, N.Compare) or _mentions_ik(atom.right):
        return atom
    left = atom.left
    if isinstance(left, N.BinOp) and left.op == "-" and _is_ik(left.right) and not _mentions_ik(left.left):
        return N.Compare(_FLIP[atom.op], left.right, N.BinOp("-", left.left, atom.right))
    if isinstance(left, N.BinOp) and left.op == "-" and _is_ik(left.left) and not _mentions_ik(left.right):
        return N.Compare(atom.op, left.left, N.BinOp("+", left.right, atom.right))
    return atom


def _mentions_ik(e) -> bool:
    """Conservative: True for anything but constants, other names and arithmetic of them."""
    if isinstance(e, N.Const):
        return False
    if isinstance(e, N.Name):
        return _is_ik(e)
    if isinstance(e, N.BinOp):
        return _mentions_ik(e.left) or _mentions_ik(e.right)
    if isinstance(e, N.UnaryOp):
        return _mentions_ik(e.operand)
    return True


def candidate_atoms(ir) -> list:
    """The atoms that get a class of their own: none for a block-table mask (its tiles come from
    the table) or one with more than MAX_ATOMS atoms."""
    if ir.table or ir.mask is None:
        return []
    found = atoms(ir.mask)
    return found if 1 < len(found) <= MAX_ATOMS else []


def mask_classes(ir) -> int:
    return FIRST_ATOM_CLASS + len(candidate_atoms(ir))


def tile_class_fn(ir, names: dict, tables: dict, block_n: str, len_k: str) -> str:
    """C++ of kMaskClasses and tile_mask_class(va, r, n) (kv_range region; after tile_must)."""
    found = candidate_atoms(ir)
    # (an enumerator: a constexpr variable draws nvcc's "declared but never referenced" warning in a
    # kernel whose consumer does not dispatch on the classes)
    lines = [f"enum : int {{ kMaskClasses = {FIRST_ATOM_CLASS + len(found)} }};",
             "// A partial tile's mask class (cubridge/lower/maskclass.py): 0 full, 1 the whole mask, 2 the key",
             "// bound only, 3 + j atom j alone (every other atom constant on the tile).",
             "__device__ __forceinline__ int tile_mask_class(const VariantArgs& va, const KvRange& r, int n) {",
             f"  const int k_lo = n * {block_n}, k_hi = min(k_lo + {block_n}, r.{len_k}) - 1;",
             f"  const bool ragged = k_lo + {block_n} > r.{len_k};",
             "  if (tile_must(va, r, n, k_lo, k_hi)) return ragged ? 2 : 0;"]
    if found:
        known = {**names, **{f"__m{i}": (f"m{i}", "bool") for i in range(len(found))}}
        for i, atom in enumerate(found):
            must, may = classify(atom)
            lines.append(f"  const bool m{i} = {to_c(must, names, tables)}, y{i} = {to_c(may, names, tables)};")
        mixed = [f"(y{i} & !m{i})" for i in range(len(found))]
        lines.append(f"  const int mixed = {' + '.join(f'int{x}' for x in mixed)};")
        lines.append("  if (mixed != 1) return 1;")
        for j in range(len(found)):
            vals = [N.Name(f"__m{i}") for i in range(len(found))]
            on = substitute(ir.mask, vals[:j] + [N.Const(True)] + vals[j + 1:])
            off = substitute(ir.mask, vals[:j] + [N.Const(False)] + vals[j + 1:])
            lines.append(f"  if ({mixed[j]} & {to_c(on, known, tables)} & !{to_c(off, known, tables)}) "
                         f"return {FIRST_ATOM_CLASS + j};")
    lines += ["  return 1;", "}"]
    return "\n".join(lines) + "\n" + _wg_class_fn(ir, block_n, len_k)


def _wg_class_fn(ir, block_n: str, len_k: str) -> str:
    """tile_mask_class_wg(va, r, n, c): the class for consumer c's rows of the query tile, -1 where
    none of them attends a key of the tile (that warpgroup may skip the tile's GEMMs;
    experiments/patches/wg_skip.patch). A block table says nothing per warpgroup: there only rows
    past the last query give -1."""
    empty = "" if ir.table else (
        f"  const int k_lo = n * {block_n}, k_hi = min(k_lo + {block_n}, r.{len_k}) - 1;\n"
        "  if (!tile_may(va, w, n, k_lo, k_hi, 1)) return -1;\n")
    return ("// Consumer c's class of KV tile n: its kWgRows rows of the query tile; -1: they attend none of it.\n"
            "__device__ __forceinline__ int tile_mask_class_wg(const VariantArgs& va, const KvRange& r, int n, int c) {\n"
            "  KvRange w = r;\n"
            "  w.q_lo = r.q_lo + c * kWgRows;\n"
            "  w.q_hi = min(w.q_lo + kWgRows - 1, r.q_hi);\n"
            "  if (w.q_lo > w.q_hi) return -1;\n"
            f"{empty}"
            "  return tile_mask_class(va, w, n);\n"
            "}\n")


def mask_class_fn(ir, names: dict, tables: dict) -> str:
    """C++ of mask_pred_class<C> (mask region; after mask_pred)."""
    lines = ["#define CUIR_MASK_CLASSES 1   // the kernel's defaults (one class: mask_pred) are not needed",
             "template <int C>",
             "__device__ __forceinline__ bool mask_pred_class(const VariantArgs& va, int b, int h, int q_idx, int kv_idx) {",
             "  if constexpr (C == 2) {",
             "    return true;",
             "  }"]
    for j, atom in enumerate(candidate_atoms(ir)):
        lines += [f"  else if constexpr (C == {FIRST_ATOM_CLASS + j}) {{", f"    return {to_c(isolate_key(atom), names, tables)};", "  }"]
    lines += ["  else {", "    return mask_pred(va, b, h, q_idx, kv_idx);", "  }", "}"]
    return "\n".join(lines) + "\n"
