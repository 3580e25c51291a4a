"""The ReferenceKernel interface (cubridge/runtime/kernels/): each built-in kernel behind it gives
the flags its runtime always gave, and a third kernel (a copy of fa2_sm80 under another name, in
its own folder, with its one class) goes through config, screening, lowering and compiling with no
edit anywhere else."""
from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import replace

import pytest
import torch

import cubridge.runtime.kernels as kernels
import cubridge.runtime.kernels.fa2_sm80 as fa2
import cubridge.search.space
from cubridge.config import load_config
from cubridge.errors import CubridgeError, LaunchError
from cubridge.paths import REF_KERNELS_DIR
from cubridge.runtime import fa2_sm80, fa3_sm90
from cubridge.runtime.build import available_compiler
from cubridge.runtime.kernels import reference_kernel, register, unregister
from cubridge.search.jobs import run_job
from cubridge.search.tuner import tune
from cubridge.vocab import JobResult, Runner, TrialState


def test_the_builtin_kernels_are_registered_by_name():
    assert kernels.kernel_names() == ["fa2_sm80", "fa3_sm90"]
    assert reference_kernel("fa3_sm90").directory == REF_KERNELS_DIR / "fa3_sm90"
    with pytest.raises(CubridgeError, match="unknown reference kernel 'fa9'") as e:
        reference_kernel("fa9")
    assert "fa2_sm80, fa3_sm90" in e.value.hint


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_flags_are_the_runtimes_own(dtype):
    pt3 = {"block_m": 192, "block_n": 80, "stages": 2, "persistent": True}
    want3 = fa3_sm90.Fa3Config(128, 192, 80, 2, False, dtype == "bf16", persistent=True).defines()
    assert reference_kernel("fa3_sm90").defines(pt3, 128, dtype) == want3
    pt2 = {"block_m": 128, "block_n": 64, "stages": 2, "warps": 4}
    want2 = fa2_sm80.Config(128, 64, 2, 4).defines(64, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], False)
    assert reference_kernel("fa2_sm80").defines(pt2, 64, dtype) == want2
    opts = reference_kernel("fa3_sm90").compile_options(pt3, 128, dtype)
    assert opts == ["-std=c++17", *want3, f"-I{REF_KERNELS_DIR / 'fa3_sm90'}"]


def test_one_dtype_vocabulary():
    with pytest.raises(CubridgeError, match="dtype 'f16' is not one of bf16, fp16"):
        reference_kernel("fa2_sm80").defines({"block_m": 128, "block_n": 64, "stages": 2, "warps": 4}, 64, "f16")


@pytest.mark.parametrize("name", ["fa2_sm80", "fa3_sm90"])
def test_input_checks_name_the_problem(name):
    q = torch.randn(1, 2, 16, 64)
    with pytest.raises(LaunchError, match="q"):
        reference_kernel(name).check_inputs(q[0], q, q)


# ------------------------------------------------------------------ a third kernel
class ToySm80(fa2.Fa2Sm80Kernel):
    """fa2_sm80 copied into its own folder under another name: the whole of what adding it takes."""
    name = "toy_sm80"
    space = replace(fa2.SPACE, kernel="toy_sm80")
    folder = None          # set by the fixture: the copy of ref_kernels/fa2_sm80

    @property
    def directory(self):
        return self.folder


@pytest.fixture
def toy(tmp_path):
    ToySm80.folder = tmp_path / "toy_sm80"
    shutil.copytree(REF_KERNELS_DIR / "fa2_sm80", ToySm80.folder)
    register(ToySm80)
    yield reference_kernel("toy_sm80")
    unregister("toy_sm80")


class InProcessRunner(Runner):
    """Runs every job here (the toy kernel is registered in this process only) as a machine
    without a GPU would."""

    def __init__(self):
        self._pending, self.kinds = [], []

    def __repr__(self) -> str:
        return "InProcessRunner()"

    def submit(self, jobs):
        self._pending.extend(jobs)

    def results(self, timeout_s=None) -> list[JobResult]:
        done, self._pending = [run_job(j) for j in self._pending], []
        self.kinds += [r.job.kind for r in done]
        return done

    @property
    def num_workers(self) -> int:
        return 1

    def close(self) -> None:
        pass


def test_a_third_kernel_needs_its_folder_and_its_class_only(toy, tmp_path):
    assert "toy_sm80" in kernels.kernel_names() and cubridge.search.space.SPACES["toy_sm80"] is toy.space
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(f"""\
        spec: prefixlm
        reference: toy_sm80
        arch: sm_80
        shapes: {{heads_q: 4, heads_kv: 2, head_dim: 64, lengths: [1024]}}
        budget: {{trials: 2, minutes: 1}}
        output: {tmp_path / 'out'}
        """))
    cfg = load_config(path)
    runner = InProcessRunner()
    result = tune(cfg, runner=runner, quick_screen=True, say=lambda *_: None)
    assert result.status == "no_gpu"
    assert runner.kinds[0] == "screen"
    manifest = json.loads((cfg.output / "manifest.json").read_text())
    [cand] = manifest["candidates"]
    assert cand["reference"] == "toy_sm80" and cand["state"] == TrialState.VERIFIED.value
    if available_compiler():
        [comp] = manifest["compile"].values()
        assert comp["state"] == "verified", comp["reason"]
        assert "compile" in runner.kinds


def test_a_third_kernel_gets_the_op_path_from_its_class(toy):
    """cubridge.op (build, checks, load) asks the kernel too: the toy inherits fa2's answers."""
    from cubridge.op.build import default_points
    fa2_default = reference_kernel("fa2_sm80").variant_default
    assert default_points("toy_sm80", 64, (1024, 8192)) == {n: fa2_default(64, n) for n in (1024, 8192)}
    q = torch.empty(1, 2, 8, 64)
    assert toy.copy_reason(q) is None and "toy_sm80 reads contiguous" in toy.copy_reason(q.transpose(1, 2))
    assert callable(toy.shape_launch(b"", fa2_default(64, 1024), 64, "bf16", None, torch.device("cpu"),
                                     (1, 2, 2, 8, 8), 0.125))
