"""No code outside a reference kernel's own modules branches on a kernel's name (docs/DESIGN.md,
"Reference kernels"): what differs between kernels goes through runtime.kernels.ReferenceKernel.
Checked on the syntax tree of every module of cubridge/: a comparison or membership test against a
kernel name, a startswith / endswith with (a prefix of) one, a dict keyed by one or a subscript with
one is a name branch. Naming a kernel as a default (`--ref` defaults to fa3_sm90) is not."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cubridge.paths import REF_KERNELS_DIR

ROOT = Path(__file__).resolve().parents[2] / "cubridge"
NAMES = sorted(p.name for p in REF_KERNELS_DIR.iterdir() if (p / "kernel.cu").is_file())


def own_module(path: Path) -> bool:
    """runtime/<name>.py, lower/<name>.py, runtime/kernels/<name>.py: the kernel's own code."""
    return path.stem in NAMES


def is_name(node) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def names_in(node) -> bool:
    """node is a kernel name, or a tuple / list / set literal holding one."""
    return is_name(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(is_name, node.elts)))


def is_prefix(node) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 3
            and any(n.startswith(node.value) or n.endswith(node.value) for n in NAMES))


def name_branches(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and any(map(names_in, [n.left, *n.comparators])):
            out.append((n.lineno, "compares with a kernel name"))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr in ("startswith", "endswith") and any(names_in(a) or is_prefix(a) for a in n.args)):
            out.append((n.lineno, f"{n.func.attr} a kernel name"))
        elif isinstance(n, ast.Dict) and any(k is not None and is_name(k) for k in n.keys):
            out.append((n.lineno, "a dict keyed by kernel names"))
        elif isinstance(n, ast.Subscript) and is_name(n.slice):
            out.append((n.lineno, "looks up by a kernel name"))
    return out


def test_the_kernels_are_known():
    assert {"fa2_sm80", "fa3_sm90"} <= set(NAMES)


def test_no_name_branch_outside_a_kernels_own_modules():
    bad = [f"{p.relative_to(ROOT.parent)}:{line}: {what}" for p in sorted(ROOT.rglob("*.py")) if not own_module(p)
           for line, what in name_branches(ast.parse(p.read_text()))]
    assert not bad, "ask runtime.kernels.reference_kernel(name) instead:\n" + "\n".join(bad)


@pytest.mark.parametrize("code", ['if ref == "fa3_sm90": pass', 'x = ref in ("fa2_sm80", "other")',
                                  'ref.startswith("fa3")', 'D = {"fa2_sm80": 1}', 'SPACES["fa3_sm90"]',
                                  'if "fa2_sm80" != ref: pass'])
def test_the_check_finds_each_form(code):
    assert name_branches(ast.parse(code))


def test_a_default_is_not_a_branch():
    assert not name_branches(ast.parse('p.add_argument("--ref", default="fa3_sm90")\nd.get("reference", "fa3_sm90")'))
