"""Session 17b's forward options without a GPU (issue 18, D 64): tree_max (ref_kernels/fa3_sm90/tree_max.cuh,
TREE_MAX) takes each row half's max as a pairwise tree, both halves side by side, instead of the softmax region's
17-deep chain; split_exps (consumer.cuh SPLIT_EXPS, three consumers) pins the P V wait after row half 0's
exponentials, with O's rescale beside half 1's. Off by default; their builds keep every value in registers (no stack
frame, no spills); tree_max's steady KV step has the same MUFU count with 2 fewer FMNMX (the chains' -inf starts),
split_exps's has its P V wait after >= 30 of the 66 MUFU and O's FMUL before the last MUFU. tests/gpu/test_fa3_sm90.py
-k s17b runs them under the rule, bitwise equal to the default."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from cubridge.runtime.fa3_sm90 import KERNEL_SOURCE, default_config
from test_fa3_sm90_build import NEEDS_SASS_TOOLS as NEEDS_TOOLS, _disassembler   # tests/cpu is on sys.path
from test_fa3_sm90_d256_build import _build

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tree_max_off_by_default_and_its_flag():
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (1024, 8192, 16384):
                cfg = default_config(d, causal, True, n)
                assert not cfg.tree_max and not cfg.split_exps
                assert not any("TREE_MAX" in f or "SPLIT_EXPS" in f for f in cfg.defines())
    flags = replace(default_config(64, False, True, 8192), tree_max=True, split_exps=True).defines()
    assert "-DTREE_MAX=1" in flags and "-DSPLIT_EXPS=1" in flags


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
            "d128f_t": replace(d128f, tree_max=True), "d64f_te2": replace(d64f, tree_max=True, exp2_emu=2),
            "d64f_s": replace(d64f, split_exps=True), "d64c4k_ts": replace(default_config(64, True, True, 4096),
                                                                              tree_max=True, split_exps=True)}
    logs = {k: _build(c.defines(), KERNEL_SOURCE, tmp_path / f"{k}.cubin") for k, c in cfgs.items()}   # one at a time
    assert {k: _frame_and_spill(v) for k, v in logs.items()} == dict.fromkeys(cfgs, (0, 0))
    ops = {}
    for k in ("d64f", "d64f_t", "d64f_s"):
        text = subprocess.run([*_disassembler(), str(tmp_path / f"{k}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        ops[k] = fwd_step_counts(text[text.find(".text.fa3_sm90_fwd:"):])["opcodes"]
    assert ops["d64f"]["MUFU"] == ops["d64f_t"]["MUFU"] == 66, ops
    assert ops["d64f_t"]["FMNMX"] == ops["d64f"]["FMNMX"] - 2, (ops["d64f"]["FMNMX"], ops["d64f_t"]["FMNMX"])
    assert ops["d64f_s"]["MUFU"] == 66 and ops["d64f_s"]["FMUL"] == ops["d64f"]["FMUL"], ops


@NEEDS_TOOLS
def test_split_exps_places_the_wait(tmp_path, monkeypatch):
    """In split_exps's steady step the P V wait (the second and third WARPGROUP.DEPBAR: the pin's two arms) follows
    >= 30 MUFU and O's FMUL end before the last MUFU; by default the wait precedes every MUFU and the FMUL follow."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    for name in [m for m in sys.modules if m == "expkit" or m.startswith("expkit.")]:
        monkeypatch.delitem(sys.modules, name)
    from expkit.sass_stalls_fwd import steady_loop
    d64f = default_config(64, False, True, 8192)
    places = {}
    for k, cfg in {"base": d64f, "split": replace(d64f, split_exps=True)}.items():
        _build(cfg.defines(), KERNEL_SOURCE, tmp_path / f"{k}.cubin")
        text = subprocess.run([*_disassembler(), str(tmp_path / f"{k}.cubin")], capture_output=True, text=True,
                              check=True).stdout
        ops = steady_loop(text[text.find(".text.fa3_sm90_fwd:"):])
        mufu = [i for i, o in enumerate(ops) if o.startswith("MUFU")]
        waits = [i for i, o in enumerate(ops) if o.startswith("WARPGROUP.DEPBAR")]
        fmul = [i for i, o in enumerate(ops) if o == "FMUL"]
        places[k] = (sum(m < waits[-1] for m in mufu), fmul[-1] < mufu[-1])
    assert places["base"] == (0, False) and places["split"][0] >= 30 and places["split"][1], places
