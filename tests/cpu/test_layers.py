"""The import rules of docs/DESIGN.md ("Layers"), checked by parsing every module of cubridge/:
each layer imports only its own layer and those below it, no module imports itself back through
others (lazy imports inside functions count: they hide a cycle, they do not remove it), and no
underscore name crosses a module boundary."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "cubridge"

# Bottom to top; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    ("vocabulary", ("cubridge.errors", "cubridge.paths", "cubridge.rule", "cubridge.vocab",
                    "cubridge.registry", "cubridge.version", "cubridge.timelimit", "cubridge.archs")),
    ("ir", ("cubridge.cuir", "cubridge.spec", "cubridge.specs", "cubridge.inputs", "cubridge.evalmod")),
    ("kernels", ("cubridge.transfer", "cubridge.lower", "cubridge.runtime", "cubridge.verify",
                 "cubridge.analysis")),
    ("llm", ("cubridge.llm",)),
    ("search", ("cubridge.search", "cubridge.config")),
    ("top", ("cubridge.cli", "cubridge.gate", "cubridge.load", "cubridge.op", "cubridge.integrations", "cubridge")),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/DESIGN.md"
    return best[1]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str) -> list[tuple[str, str, int]]:
    """(imported cubridge module, name or "", line) for every import in `module`."""
    out = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "cubridge"]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            if base.split(".")[0] != "cubridge":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (base, a.name, node.lineno))
    return out


def graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in imports(m) if target in MODULES and target != m} for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


# Upward imports that exist today, with their reasons (the same rules as KNOWN_CYCLES). None now.
KNOWN_UPWARD: dict = {}


def test_layers_import_only_downwards():
    upward = {(m, t): line for m in MODULES for t, _, line in imports(m)
              if t in MODULES and layer_of(t) > layer_of(m)}
    gone = [f"{m} -> {t}" for m, t in KNOWN_UPWARD if (m, t) not in upward]
    assert not gone, "no longer imported upwards, delete it from KNOWN_UPWARD:\n" + "\n".join(gone)
    bad = sorted(f"{m}:{line} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                 for (m, t), line in upward.items() if (m, t) not in KNOWN_UPWARD)
    assert not bad, "imports against the layer order (docs/DESIGN.md):\n" + "\n".join(bad)


# Cycles that exist today, each with its reason; any other cycle fails, and so does an entry here
# once its cycle is gone (delete it then). None now.
KNOWN_CYCLES: dict = {}


def strongly_connected(g: dict[str, set[str]]) -> list[frozenset[str]]:
    """The components of g with more than one module (or a self-import): its import cycles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in g.get(m, ()):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            comp = set()
            while not comp or m not in comp:
                comp.add(stack.pop())
            on_stack.difference_update(comp)
            if len(comp) > 1 or m in g.get(m, ()):
                out.append(frozenset(comp))

    for m in sorted(g):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycle():
    cycles = strongly_connected(graph())
    new = [" <-> ".join(sorted(c)) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "import cycles (docs/DESIGN.md, Layers):\n" + "\n".join(new)
    gone = [" <-> ".join(sorted(c)) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, "no longer a cycle, delete it from KNOWN_CYCLES:\n" + "\n".join(gone)


def test_the_cycle_finder_finds_cycles():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
    assert strongly_connected({"a": {"a"}}) == [frozenset("a")]


def _private_attribute_uses(module: str) -> list[tuple[str, str]]:
    """(where, owner) of each `alias._name` where alias is a cubridge module imported into `module`."""
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _resolve(module, node).startswith("cubridge"):
            for a in node.names:
                if f"{_resolve(module, node)}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{_resolve(module, node)}.{a.name}"
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
    return [(f"{module}:{n.lineno} uses {aliases[n.value.id]}.{n.attr}", aliases[n.value.id]) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
            and n.attr.startswith("_") and not n.attr.startswith("__")]


# Module pairs that share underscore names today, each with its reason (the same rules as
# KNOWN_CYCLES: any other pair fails, a pair that no longer shares any must be deleted). None now.
KNOWN_PRIVATE: dict = {}


def _private_uses() -> dict[tuple[str, str], list[str]]:
    """(importer, owner) -> the underscore names of owner that importer uses."""
    out: dict[tuple[str, str], list[str]] = {}
    for m in MODULES:
        for t, name, line in imports(m):
            if name.startswith("_") and not name.startswith("__") and t != m:
                out.setdefault((m, t), []).append(f"{m}:{line} imports {name} from {t}")
        for use, owner in _private_attribute_uses(m):
            out.setdefault((m, owner), []).append(use)
    return out


def test_no_private_name_crosses_modules():
    uses = _private_uses()
    bad = [u for pair, found in uses.items() if pair not in KNOWN_PRIVATE for u in found]
    gone = [f"{a} -> {b}" for a, b in KNOWN_PRIVATE if (a, b) not in uses]
    assert not gone, "no longer shares private names, delete it from KNOWN_PRIVATE:\n" + "\n".join(gone)
    assert not bad, "private names used across modules (make them public or move them):\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_design_document_names_each_layer(layer):
    text = (ROOT.parent / "docs" / "DESIGN.md").read_text()
    assert f"`{layer}`" in text, f"docs/DESIGN.md does not describe layer {layer}"


def test_design_document_places_every_module():
    """Each top-level module and package of cubridge/ is named in docs/DESIGN.md's layer table, in
    the row of the layer this test gives it (a new module cannot land unplaced or misplaced)."""
    rows = {}
    for line in (ROOT.parent / "docs" / "DESIGN.md").read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().strip("`") in {name for name, _ in LAYERS}:
            rows[cells[1].strip().strip("`")] = {n.rstrip("/") for n in re.findall(r"`([\w/]+)`", cells[2])}
    tops = sorted({m.split(".")[1] for m in MODULES if m.count(".") >= 1})
    misplaced = [f"{t} (layer {LAYERS[layer_of('cubridge.' + t)][0]})" for t in tops
                 if t not in rows.get(LAYERS[layer_of("cubridge." + t)][0], set())]
    assert not misplaced, "docs/DESIGN.md's layer table does not place: " + ", ".join(misplaced)
