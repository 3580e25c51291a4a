"""`from cubridge.op import build` is the function whatever was imported before (a shuffled CI
order imported the submodule cubridge.op.build first, which rebound the package's `build` to the
module, and test_op's build test called a module). A fresh interpreter: import state is global."""
from __future__ import annotations

import subprocess
import sys

from cubridge.paths import REPO_DIR


def test_the_op_build_function_survives_importing_its_submodule():
    code = ("import sys, cubridge.op.build; from cubridge.op.build import build_run; "
            "from cubridge.op import build; import cubridge.op; "
            "assert callable(build) and build is cubridge.op.build and build.__module__ == 'cubridge.op', build; "
            "assert 'torch' not in sys.modules, 'cubridge.op imported torch'")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
