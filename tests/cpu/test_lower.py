"""Lowering: region regeneration onto both reference kernels, golden files of the generated code
(so that a refactor shows its codegen diff), and nvcc compiles of every lowered variant (sm_80 for
fa2_sm80, sm_90a for fa3_sm90). Update the golden files with `pytest tests/cpu/test_lower.py
--update-golden` and review the diff."""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cubridge.cuir.parser import parse, parse_file
from cubridge.cuir.printer import to_text
from cubridge.lower import LowerError, lower, regions
from cubridge.paths import ref_kernel_dir
from cubridge.spec import builtin_specs, load_spec
from cubridge.transfer.rules import transfer

GOLDEN = Path(__file__).parent / "golden"
REFS = {"fa2_sm80": ["-arch=sm_80", "-DHEAD_DIM=128", "-DIS_BF16=1"],
        "fa3_sm90": ["-gencode=arch=compute_90a,code=sm_90a", "-DHEAD_DIM=128"]}
GENERATED = ("extra_io", "kv_range", "score", "mask", "softmax", "epilogue")


def _lowered(ref, name):
    program = parse_file(ref_kernel_dir(ref) / "kernel.cuir")
    return lower(transfer(program, load_spec(name)).program, ref)


def _regions_text(source: str) -> str:
    return "".join(f"// ===== region {n}\n{regions.body(source, n)}" for n in GENERATED)


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("name", builtin_specs())
def test_generated_regions_match_golden(ref, name, request):
    text = _regions_text(_lowered(ref, name).source)
    path = GOLDEN / ref / f"{name}.cu"
    if request.config.getoption("--update-golden"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run pytest {__file__} --update-golden"
    assert text == path.read_text(), f"generated code for {ref}/{name} changed: diff it against {path}"


@pytest.mark.parametrize("ref", REFS)
def test_only_generated_regions_change(ref):
    reference = (ref_kernel_dir(ref) / "kernel.cu").read_text()
    k = _lowered(ref, "composite")
    ref_spans, new_spans = regions.spans(reference), regions.spans(k.source)
    assert set(ref_spans) == set(new_spans)
    outside = lambda src, sp: [src[e:s] for (_, e), (s, _) in zip(
        sorted([(0, 0)] + list(sp.values())), sorted(list(sp.values()) + [(len(src), len(src))]))]
    assert outside(reference, ref_spans) == outside(k.source, new_spans)
    for name in set(ref_spans) - set(GENERATED):
        assert regions.body(reference, name) == regions.body(k.source, name)


def test_the_reference_program_lowers_to_the_reference_kernel():
    for ref in REFS:
        program = parse_file(ref_kernel_dir(ref) / "kernel.cuir")
        assert lower(program, ref).source == (ref_kernel_dir(ref) / "kernel.cu").read_text()


def test_unknown_region_shape_is_a_lower_error():
    program = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
    text = to_text(transfer(program, load_spec("causal")).program)
    assert "s = s * sm_scale" in text
    extra = "\n                t = exp(s)\n                s = t * s"      # a form the generator does not know
    bad = parse(text.replace("s = s * sm_scale", "s = s * sm_scale" + extra))
    with pytest.raises(LowerError, match="score region"):
        lower(bad, "fa3_sm90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_lowered_variant_compiles(tmp_path):
    jobs = [(ref, name) for ref in REFS for name in builtin_specs()]
    for ref, name in jobs:     # lowering (torch, the interpreter) on this thread; only nvcc in the pool
        (tmp_path / f"{ref}_{name}.cu").write_text(_lowered(ref, name).source)

    def build(job):
        ref, name = job
        src = tmp_path / f"{ref}_{name}.cu"
        cmd = ["nvcc", "-cubin", "-std=c++17", "-O3", *REFS[ref], f"-I{ref_kernel_dir(ref)}",
               "-o", str(src.with_suffix(".cubin")), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return job, r.returncode, r.stderr[-2000:]

    with ThreadPoolExecutor(2) as ex:
        failures = [(job, err) for job, rc, err in ex.map(build, jobs) if rc != 0]
    assert not failures, failures


def test_fa3_dense_code_paths_stay_out_of_lowered_variants():
    """kernel.cu's kDenseKernel comes from a mark inside the reference's own kv_range region: every
    lowered variant replaces that region, so it keeps session 9's wgmma code (ref_kernels/fa3_sm90
    NOTES, session 10: the new code spilled more in some variant builds)."""
    reference = (ref_kernel_dir("fa3_sm90") / "kernel.cu").read_text()
    mark = "#define FA3_DENSE_KV_RANGE 1"
    assert mark in regions.body(reference, "kv_range") and reference.count(mark) == 1
    for name in builtin_specs():
        if name not in ("full", "causal"):                 # those two are the reference itself
            assert mark not in _lowered("fa3_sm90", name).source, name
