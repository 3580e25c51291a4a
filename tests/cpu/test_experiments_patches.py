"""experiments/patches/: the A/B patches and the experiment knobs that left the product kernel
(knobs/: kv_ascending, serial_tiles, timeline; issue 16) are diffs against ref_kernels/fa3_sm90.
A kernel change that breaks one must regenerate it, so each must still apply, change what it
names and nothing else, and the knob it carries must be absent from the product kernel."""
from __future__ import annotations

import json
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
    assert {"knobs/kv_ascending", "knobs/serial_tiles", "knobs/timeline"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_patch_applies_to_the_kernel(name, patched):
    touched = {line.split()[1] for line in (PATCHES / f"{name}.patch").read_text().splitlines()
               if line.startswith("+++ ")}
    assert sorted(Path(t).name for t in touched) == patched[name]


def test_the_product_kernel_has_no_experiment_knobs():
    text = "".join((ROOT / "ref_kernels" / "fa3_sm90" / f).read_text() for f in ("kernel.cu", "consumer.cuh"))
    for knob in ("KV_ASCENDING", "OVERLAP_TILES", "CUIR_TIMELINE", "timeline.cuh", "TimelineMark"):
        assert knob not in text, f"{knob} is back in the product kernel: experiments/patches/knobs/ holds it"
