"""Packaging: `cubridge --version`, declared dependencies all used, and a wheel that works outside
the checkout: built here, installed into a fresh venv (reusing this interpreter's torch through
--system-site-packages, so nothing is downloaded), then `cubridge-tune ... --dry-run` run from
another directory must find the reference kernels inside the installed package."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import cubridge
from cubridge.cli import main

ROOT = Path(__file__).resolve().parents[2]
IMPORT_NAMES = {"pyyaml": "yaml"}


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"cubridge {cubridge.__version__}"
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cubridge.__version__"}


def test_every_declared_dependency_is_imported():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    imported = set()
    for f in (ROOT / "cubridge").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower()
        assert IMPORT_NAMES.get(name, name) in imported, f"{dep} is declared in pyproject.toml but never imported"


def test_wheel_installs_outside_the_checkout_and_tunes_a_dry_run(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, cwd=tmp_path)
    wheel = next(wheels.glob("cubridge-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # --ignore-installed: the checkout's own editable install is visible through the system site-packages
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                   check=True, env=env, cwd=tmp_path)
    where = subprocess.run([py, "-c", "import cubridge.paths as p; print(p.REF_KERNELS_DIR)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(venv)) and (Path(where) / "fa3_sm90" / "kernel.cu").is_file(), where
    run = subprocess.run([venv / "bin" / "cubridge-tune", str(ROOT / "configs" / "h100_prefixlm.yaml"), "--dry-run",
                          "--out", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 verified" in run.stdout + run.stderr
