"""experiments/ imports: scripts share helpers through experiments/expkit.py only (no sys.path
edits, no script importing another script's helpers), and every script still imports."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
# Scripts of the FA4 comparison share their own helper module (peer_systems, ab_peer_patches).
PEER_HELPERS = {"peer_systems", "ab_peer_patches"}


def _sibling_imports(path: Path) -> set[str]:
    siblings = {p.stem for p in EXPERIMENTS.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in siblings:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in siblings}
    return found


def test_scripts_import_only_expkit_of_experiments():
    bad = {p.name: sorted(_sibling_imports(p) - {"expkit"} - PEER_HELPERS) for p in EXPERIMENTS.glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_only_expkit_edits_sys_path():
    edits = [p.name for p in EXPERIMENTS.glob("*.py") if "sys.path.insert" in p.read_text()]
    assert edits == ["expkit.py"]


def test_every_script_imports():
    names = sorted(p.stem for p in EXPERIMENTS.glob("*.py"))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=EXPERIMENTS, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
