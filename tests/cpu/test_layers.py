"""The import rules of docs/DESIGN.md ("Layers"), checked by parsing every module of cubridge/:
each layer imports only its own layer and those below it, no module imports itself back through
others (lazy imports inside functions count: they hide a cycle, they do not remove it), and no
underscore name crosses a module boundary."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "cubridge"

# Bottom to top; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    ("vocabulary", ("cubridge.errors", "cubridge.paths", "cubridge.rule", "cubridge.vocab",
                    "cubridge.registry", "cubridge.version", "cubridge.timelimit")),
    ("ir", ("cubridge.cuir", "cubridge.spec", "cubridge.specs", "cubridge.inputs")),
    ("kernels", ("cubridge.transfer", "cubridge.lower", "cubridge.runtime", "cubridge.verify",
                 "cubridge.analysis")),
    ("llm", ("cubridge.llm",)),
    ("search", ("cubridge.search", "cubridge.config")),
    ("top", ("cubridge.cli", "cubridge.load", "cubridge")),
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


def test_layers_import_only_downwards():
    bad = [f"{m}:{line} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
           for m in MODULES for t, _, line in imports(m) if t in MODULES and layer_of(t) > layer_of(m)]
    bad = sorted(set(bad))
    assert not bad, "imports against the layer order (docs/DESIGN.md):\n" + "\n".join(bad)


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of g, or None (depth-first search with colours)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == "open":
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _private_attribute_uses(module: str) -> list[str]:
    """`alias._name` where alias is a cubridge module imported into `module`."""
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _resolve(module, node).startswith("cubridge"):
            for a in node.names:
                if f"{_resolve(module, node)}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{_resolve(module, node)}.{a.name}"
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
    return [f"{module}:{n.lineno} uses {aliases[n.value.id]}.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
            and n.attr.startswith("_") and not n.attr.startswith("__")]


def test_no_private_name_crosses_modules():
    bad = [f"{m}:{line} imports {name} from {t}" for m in MODULES for t, name, line in imports(m)
           if name.startswith("_") and not name.startswith("__") and t != m]
    bad += [use for m in MODULES for use in _private_attribute_uses(m)]
    assert not bad, "private names used across modules (make them public or move them):\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_design_document_names_each_layer(layer):
    text = (ROOT.parent / "docs" / "DESIGN.md").read_text()
    assert f"`{layer}`" in text, f"docs/DESIGN.md does not describe layer {layer}"
