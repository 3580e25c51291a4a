"""experiments/ imports: scripts share helpers through the expkit package only (experiments/expkit/:
the shared helpers, and expkit.peers for the FA4 comparison), with no sys.path edit anywhere but
expkit's own bare-checkout fallback, no script importing another script, and every script and the
package still importing."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
SCRIPTS = sorted(EXPERIMENTS.glob("*.py"))


def _sibling_imports(path: Path) -> set[str]:
    siblings = {p.stem for p in SCRIPTS}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in siblings:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in siblings}
    return found


def test_scripts_import_only_expkit_of_experiments():
    bad = {p.name: sorted(_sibling_imports(p)) for p in SCRIPTS}
    assert not {k: v for k, v in bad.items() if v}


# Shell scripts whose Python edits sys.path today, each with its reason and fix; an entry whose
# edit is gone must be deleted.
KNOWN_EDITS: dict[str, str] = {}


def test_only_expkit_edits_sys_path():
    """Python files and the Python inside shell scripts (python3 -c, heredocs) alike."""
    files = sorted(EXPERIMENTS.rglob("*.py")) + sorted(EXPERIMENTS.glob("*.sh"))
    edits = [p.relative_to(EXPERIMENTS).as_posix() for p in files
             if re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert sorted(set(KNOWN_EDITS) - set(edits)) == [], "no longer edits sys.path: delete it from KNOWN_EDITS"
    assert [e for e in edits if e not in KNOWN_EDITS] == ["expkit/__init__.py"]


def test_every_script_imports():
    names = [p.stem for p in SCRIPTS] + ["expkit", "expkit.peers"]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=EXPERIMENTS, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_script_runs_another():
    """Nor through runpy, nor from the Python inside a shell script (a job calls scripts, each alone)."""
    siblings = "|".join(re.escape(p.stem) for p in SCRIPTS)
    runs = [p.name for p in sorted(EXPERIMENTS.rglob("*.py")) if re.search(r"\brunpy\b|\brun_path\(", p.read_text())]
    assert runs == []
    shell = [p.name for p in sorted(EXPERIMENTS.glob("*.sh"))
             if re.search(rf"^\s*(from ({siblings}) import|import ({siblings})\b)", p.read_text(), re.M)]
    assert shell == []
