"""The ReferenceKernel launcher contract on the GPU, the way the tuner and cubridge.load use it:

    prepare = reference_kernel(name).launcher(lowered, cubin, point)
    call = prepare(extra_inputs, device); call(q, k, v, out)

for each built-in kernel and a third one (fa2_sm80 copied under another name, registered from
this file only), at two tile configs each, for variants with and without extra inputs, under the
verification rule (search.measure.gpu_check: poisoned output, inputs unchanged, bitwise rerun)."""
from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

import cubridge.runtime.kernels.fa2_sm80 as fa2
from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.paths import REF_KERNELS_DIR
from cubridge.runtime.build import compile_cubin, default_compiler
from cubridge.runtime.kernels import reference_kernel, register, unregister
from cubridge.search.measure import gpu_check
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = pytest.mark.skipif(CAP < (8, 0), reason="needs an sm_80+ GPU")
ARCH = "sm_90a" if CAP == (9, 0) else "sm_80"
SHAPE = (2, 8, 2, 1000, 128)     # B, Hq, Hkv, N (ragged: no tile multiple), D; GQA


class ToySm80(fa2.Fa2Sm80Kernel):
    name = "toy_sm80"
    space = replace(fa2.SPACE, kernel="toy_sm80")
    folder = None

    @property
    def directory(self):
        return self.folder


@pytest.fixture(scope="module", params=["fa3_sm90", "fa2_sm80", "toy_sm80"])
def kernel(request, tmp_path_factory):
    if request.param == "fa3_sm90" and CAP != (9, 0):
        pytest.skip("fa3_sm90 needs an sm_90 GPU (H100 / H200)")
    if request.param == "toy_sm80":
        ToySm80.folder = tmp_path_factory.mktemp("kernels") / "toy_sm80"
        shutil.copytree(REF_KERNELS_DIR / "fa2_sm80", ToySm80.folder)
        register(ToySm80)
        yield reference_kernel("toy_sm80")
        unregister("toy_sm80")
        return
    yield reference_kernel(request.param)


@pytest.mark.parametrize("name", ["prefixlm", "relative_pos", "composite"])
def test_launcher_contract(kernel, name):
    B, Hq, Hkv, N, D = SHAPE
    spec = load_spec(name)
    cand = transfer(parse_file(kernel.cuir_path()), spec)
    lowered = lower(cand.program, kernel.name)
    points = [p for p in kernel.space.best_known(D) if not kernel.space.problems(p, D, ARCH)][:2]
    assert points, f"{kernel.name} has no valid measured default at D={D} on {ARCH}"
    for point in points:
        cubin = compile_cubin(lowered.source, arch=ARCH, options=kernel.compile_options(point, D, "bf16"),
                              compiler=default_compiler()).cubin
        prepare = kernel.launcher(lowered, cubin, point)
        extra = cand.bind(Nq=N, Nk=N, Hq=Hq, Hkv=Hkv, B=B, params=kernel.space.to_cuir(point), device="cuda")
        call = prepare(extra, torch.device("cuda"))
        why = gpu_check(call, spec, {}, (B, Hq, Hkv, N, D, 3), torch.bfloat16)
        assert why is None, f"{kernel.name} {kernel.space.label(point)} {name}: {why}"
