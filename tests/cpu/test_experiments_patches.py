"""experiments/patches/: the A/B patches and the experiment knobs that left the product kernel
(knobs/: kv_ascending, serial_tiles, timeline, cta_timeline; issue 16) are diffs against ref_kernels/fa3_sm90.
A kernel change that breaks one must regenerate it, so each must still apply, change what it
names and nothing else, and the knob it carries must be absent from the product kernel."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "experiments" / "patches"
NAMES = sorted(p.relative_to(PATCHES).with_suffix("").as_posix() for p in PATCHES.rglob("*.patch"))


@pytest.fixture(scope="module")
def patched() -> dict:
    """name -> the files expkit.patched_files says each patch changed, in one subprocess (expkit
    is imported as the scripts import it, from experiments/)."""
    code = ("import json, sys; from expkit import patched_files; "
            "print(json.dumps({n: sorted(patched_files(n)) for n in sys.argv[1:]}))")
    done = subprocess.run([sys.executable, "-c", code, *NAMES], cwd=ROOT / "experiments", capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:] + done.stdout[-500:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_knobs_are_patches():
    assert {"knobs/kv_ascending", "knobs/serial_tiles", "knobs/timeline", "knobs/cta_timeline"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_patch_applies_to_the_kernel(name, patched):
    touched = {line.split()[1] for line in (PATCHES / f"{name}.patch").read_text().splitlines()
               if line.startswith("+++ ")}
    assert sorted(Path(t).name for t in touched) == patched[name]


def test_the_product_kernel_has_no_experiment_knobs():
    text = "".join((ROOT / "ref_kernels" / "fa3_sm90" / f).read_text() for f in ("kernel.cu", "consumer.cuh"))
    for knob in ("KV_ASCENDING", "OVERLAP_TILES", "CUIR_TIMELINE", "timeline.cuh", "TimelineMark",
                  "CUIR_CTA_TIMELINE", "CtaMark"):
        assert knob not in text, f"{knob} is back in the product kernel: experiments/patches/knobs/ holds it"


# Session 11's A/B patches (pv_wait_first: the P V wait before the whole softmax, as through
# session 10; k_wait_before_turn) compile for sm_90a spill-free at the full-attention tiles they are
# timed at. (Session 10's s9_kernel spills 2 bytes at 128 x 176 full on top of the split softmax;
# it is not timed since session 10's final call.)
FULL_PATCHES = ["pv_wait_first", "k_wait_before_turn"]
FULL_TILES = [(176, False), (176, True), (160, False)]   # (BLOCK_N, causal) at D 128: the A/B's


@pytest.fixture(scope="module")
def full_sources() -> dict:
    code = ("import json, sys; from expkit import patched_source; "
            "print(json.dumps({n: patched_source(n) for n in sys.argv[1:]}))")
    done = subprocess.run([sys.executable, "-c", code, *FULL_PATCHES], cwd=ROOT / "experiments",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:] + done.stdout[-500:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
@pytest.mark.parametrize("name", FULL_PATCHES)
def test_full_attention_patches_compile_spill_free(name, full_sources, tmp_path):
    from cubridge.runtime.fa3_sm90 import Fa3Config
    src = tmp_path / "kernel.cu"
    src.write_text(full_sources[name])
    for block_n, causal in FULL_TILES:
        cfg = Fa3Config(128, 128, block_n, 2, causal, True)
        done = subprocess.run([shutil.which("nvcc"), "-cubin", "-std=c++17", "-O3",
                               "-gencode=arch=compute_90a,code=sm_90a", *cfg.defines(),
                               f"-I{ROOT / 'ref_kernels' / 'fa3_sm90'}", "-Xptxas", "-v",
                               "-o", str(tmp_path / "k.cubin"), str(src)], capture_output=True, text=True)
        log = done.stdout + done.stderr
        assert done.returncode == 0, f"{name} {cfg}: nvcc failed\n{log[-3000:]}"
        fwd = log[log.index("Function properties for fa3_sm90_fwd"):]
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", fwd).groups()
        # 128 x 176 causal spills 2 bytes unpatched (NOTES v15, outside the KV loop): no more here
        assert int(spills[0]) <= (2 if causal else 0), f"{name} {cfg}: spills\n{fwd}"
        for warning in ("C7508", "C7510", "C7515", "serializ"):   # setmaxnreg ignored / wgmma serialized
            assert warning not in log, f"{name} {cfg}: ptxas warning {warning}\n{log}"


def test_the_product_code_has_no_experiment_helpers():
    """cuir_sigmoid_fma (the FMA-pipe sigmoid the lowering never emits) lives in experiments/patches/knobs/."""
    found = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "cubridge").rglob("*.py"))
             if "cuir_sigmoid_fma" in p.read_text() or "SIGMOID_FMA =" in p.read_text()]
    assert found == []
    assert "cuir_sigmoid_fma(float x)" in (PATCHES / "knobs" / "sigmoid_fma.cuh").read_text()
