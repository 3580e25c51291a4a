"""Session 17b's forward option without a GPU (issue 18, D 64): tree_max (ref_kernels/fa3_sm90/tree_max.cuh, TREE_MAX)
takes each row half's max as a pairwise tree, both halves side by side, instead of the softmax region's 17-deep
chain. Off by default; its builds keep every value in registers (no stack frame, no spills) and its steady KV step
has the same MUFU count with 2 fewer FMNMX (the chains' -inf starts). tests/gpu/test_fa3_sm90.py -k s17b runs it
under the rule, bitwise equal to the default."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from cubridge.runtime.fa3_sm90 import KERNEL_SOURCE, default_config
from test_fa3_sm90_build import _disassembler, _nvcc   # tests/cpu is on sys.path (no __init__.py)
from test_fa3_sm90_d256_build import _build

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS_TOOLS = pytest.mark.skipif(_nvcc() is None or _disassembler() is None,
                                 reason="nvcc and a SASS disassembler not found (needs the CUDA toolkit, no GPU)")


def test_tree_max_off_by_default_and_its_flag():
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (1024, 8192, 16384):
                cfg = default_config(d, causal, True, n)
                assert not cfg.tree_max and not any("TREE_MAX" in f for f in cfg.defines())
    assert "-DTREE_MAX=1" in replace(default_config(64, False, True, 8192), tree_max=True).defines()


def _frame_and_spill(log: str) -> tuple[int, int]:
    m = re.search(r"Function properties for fa3_sm90_fwd\s+(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    assert m, log
    return int(m.group(1)), int(m.group(2))


@NEEDS_TOOLS
def test_tree_max_in_registers_and_its_step(tmp_path, monkeypatch):
    """D 64 192 x 128 (three consumers: softmax_update) and 128 x 128 causal 1k, D 128 128 x 176 + tail_split (two
    consumers: softmax_args, the split P V wait, BLOCK_N 176: 22 column groups, an odd fold), D 64 with exp2_emu:
    no stack frame (the tree's array in registers), no spills; the steady step's MUFU as the default's."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    for name in [m for m in sys.modules if m == "expkit" or m.startswith("expkit.")]:
        monkeypatch.delitem(sys.modules, name)
    from expkit.sass_stalls_fwd import fwd_step_counts
    d64f, d128f = default_config(64, False, True, 8192), default_config(128, False, True, 8192)
    cfgs = {"d64f": d64f, "d64f_t": replace(d64f, tree_max=True),
            "d64c1k_t": replace(default_config(64, True, True, 1024), tree_max=True),
            "d128f_t": replace(d128f, tree_max=True), "d64f_te2": replace(d64f, tree_max=True, exp2_emu=2)}
    logs = {k: _build(c.defines(), KERNEL_SOURCE, tmp_path / f"{k}.cubin") for k, c in cfgs.items()}   # one at a time
    assert {k: _frame_and_spill(v) for k, v in logs.items()} == dict.fromkeys(cfgs, (0, 0))
    ops = {}
    for k in ("d64f", "d64f_t"):
        text = subprocess.run([*_disassembler(), str(tmp_path / f"{k}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        ops[k] = fwd_step_counts(text[text.find(".text.fa3_sm90_fwd:"):])["opcodes"]
    assert ops["d64f"]["MUFU"] == ops["d64f_t"]["MUFU"] == 66, ops
    assert ops["d64f_t"]["FMNMX"] == ops["d64f"]["FMNMX"] - 2, (ops["d64f"]["FMNMX"], ops["d64f_t"]["FMNMX"])
