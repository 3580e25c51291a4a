"""LLM lowering patches written to cheat: the ones that change what is timed or keep state across
launches are refused on CPU (cubridge.llm.patch_guard, through LowerTask); the ones only the
compiled kernel shows pass that guard, apply inside the regions and compile here (nvcc), and
tests/gpu/test_adversarial.py rejects them on the GPU under the rule."""
from __future__ import annotations

import shutil

import pytest

from cubridge.cuir.parser import parse_file
from cubridge.llm.engine import Rejected
from cubridge.llm.lower import LowerTask
from cubridge.llm.patch_guard import forbidden
from cubridge.llm.regions import apply_patch
from cubridge.paths import ref_kernel_dir

from cuda_cheats import FORBIDDEN_PATCHES, KERNEL, OUTPUT_CHEATS

REF = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")


@pytest.fixture(scope="module")
def task():
    return LowerTask(KERNEL, REF, REF, regions=("softmax", "epilogue", "kv_range"), reference_name="fa2_sm80")


@pytest.mark.parametrize("name, patch, words", FORBIDDEN_PATCHES, ids=[c[0] for c in FORBIDDEN_PATCHES])
def test_forbidden_patch_is_refused_before_compiling(task, name, patch, words):
    with pytest.raises(Rejected) as e:
        task.candidate({"regions": patch})
    assert e.value.state.value == "rejected_structure"
    assert "forbidden constructs" in str(e.value) and words in str(e.value)


def test_the_reference_regions_hold_nothing_forbidden():
    from cubridge.llm.regions import find_regions, region_text
    for name in ("fa2_sm80", "fa3_sm90"):
        text = (ref_kernel_dir(name) / "kernel.cu").read_text()
        assert forbidden({r: region_text(text, r) for r in find_regions(text)}) == []


@pytest.mark.parametrize("name, patch", OUTPUT_CHEATS, ids=[c[0] for c in OUTPUT_CHEATS])
def test_output_cheats_pass_the_cpu_guard_and_compile(task, name, patch):
    cand = task.candidate({"regions": patch})          # nothing on CPU can see these: the GPU must
    assert cand.source == apply_patch(KERNEL, patch) and cand.source != KERNEL
    if shutil.which("nvcc") is None:
        return                                         # compiled on the GPU machine by the GPU test
    from cubridge.runtime.build import compile_cubin
    from cubridge.runtime.fa2_sm80 import Fa2Sm80
    import torch
    opts = Fa2Sm80().options(64, torch.bfloat16, True)
    assert compile_cubin(cand.source, arch="sm_80", options=opts, compiler="nvcc", name=f"{name}.cu").cubin
