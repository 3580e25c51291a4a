"""CPU checks of ref_kernels/fa2_bwd_sm80 (the portable backward): it compiles with nvcc for sm_80
and sm_90 (both dtypes, both head dims, causal or not, deterministic or not), register use and
spills stay bounded, its lifting-map regions are present and balanced, Config mirrors the kernel's
static_asserts, and the launcher's input checks name the bad argument -- all without a GPU."""
from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cubridge.errors import BuildError, LaunchError
from cubridge.runtime.build import compile_cubin
from cubridge.runtime.fa2_bwd_sm80 import KERNEL_DIR, Config, Fa2BwdSm80, check_backward_args

REGIONS = ["extra_io", "q_range", "kv_range", "score", "mask", "softmax_bwd", "load_q", "load_kv", "head_map",
           "dq_accum", "epilogue", "dq_epilogue"]
SOURCES = ["kernel.cu", "dkdv.cuh", "dq.cuh"]
HAS_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="nvcc not on PATH: the CUDA toolkit is not installed here")

F16, BF16 = torch.float16, torch.bfloat16
# Every (arch, D, dtype, causal) with atomics; deterministic on a spread of them (only the dK/dV
# kernel changes with it: the dQ pass is in every cubin).
JOBS = [(arch, d, dt, c, False) for arch in ("sm_80", "sm_90") for d in (64, 128) for dt in (F16, BF16)
        for c in (False, True)]
JOBS += [("sm_90", 128, BF16, True, True), ("sm_80", 64, F16, False, True), ("sm_80", 128, F16, True, True)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kernels")

    def build(job):
        arch, d, dt, c, det = job
        bwd = Fa2BwdSm80(compiler="nvcc", cache_dir=cache)
        return job, bwd.build(d, dt, c, det, arch, extra_options=("--resource-usage",))

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, JOBS))


def _usage(log: str) -> dict[str, tuple[int, int]]:
    """entry -> (registers, spill store bytes) from nvcc --resource-usage."""
    out = {}
    for block in re.split(r"Compiling entry function ", log)[1:]:
        name = re.match(r"'(\w+)'", block).group(1)
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        spill = int(re.search(r"(\d+) bytes spill stores", block).group(1))
        out[name] = (regs, spill)
    return out


@needs_nvcc
def test_compiles_every_specialisation(builds):
    assert len(builds) == len(JOBS)
    for job, res in builds.items():
        assert res.cubin[:4] == b"\x7fELF", job
        usage = _usage(res.log)
        assert set(usage) == {"fa2_bwd_preprocess", "fa2_bwd_dkdv", "fa2_bwd_dq_convert", "fa2_bwd_dq"}, (job, res.log)


@needs_nvcc
def test_registers_and_spills_bounded(builds):
    """Measured with nvcc 13.0: the dK/dV kernel at D=128 uses 255 registers and spills 60-68 bytes
    (68 on sm_90); everything else spills nothing. 256 bytes is the alarm line."""
    for job, res in builds.items():
        for name, (regs, spill) in _usage(res.log).items():
            assert regs <= 255, (job, name, regs)
            assert spill <= 256, (job, name, spill)
            if name != "fa2_bwd_dkdv" or job[1] == 64:
                assert spill == 0, (job, name, spill)


@needs_nvcc
def test_invalid_config_fails_static_assert_and_problems_says_why(tmp_path):
    bad = Config(block_m=32)   # the dS tile's rows must be 64 elements (128 bytes) or more
    assert any("block_m" in p for p in bad.problems(128))
    src = (KERNEL_DIR / "kernel.cu").read_text()
    opts = ["-std=c++17", f"-I{KERNEL_DIR}", *bad.defines(128, F16, False, False)]
    if HAS_NVCC:
        with pytest.raises(BuildError, match="multiples of 64"):
            compile_cubin(src, arch="sm_90", options=opts, compiler="nvcc", cache_dir=tmp_path)
    with pytest.raises(LaunchError, match="block_m"):
        Fa2BwdSm80(bad, compiler="nvcc", cache_dir=tmp_path).build(128, F16, False, False, "sm_90")


def test_config_text_roundtrip_and_defaults_valid():
    c = Config()
    assert Config.parse(str(c)) == c and str(c) == "64x128w8-dq64x64w4"
    for d in (64, 128):
        for det in (False, True):
            assert c.problems(d, deterministic=det) == [], (d, det)
    assert Config(64, 128, 8).smem_bytes(128, False) == 2 * 128 * (256 + 256) + 128 * 64 * 2 + 1024
    assert Config(64, 128, 8).smem_bytes(128, True) == 2 * 128 * (256 + 256) + 1024
    assert Config(block_n=96).problems(128) and Config(dq_block_n=48).problems(128)
    with pytest.raises(ValueError, match="MxNwW"):
        Config.parse("64x128s2w8")


# ---------------------------------------------------------------- lifting map


def test_regions_present_and_balanced():
    seen, bodies = [], {}
    for fname in SOURCES:
        lines = (KERNEL_DIR / fname).read_text().splitlines()
        open_name = None
        for no, line in enumerate(lines, 1):
            m = re.fullmatch(r"\s*// @cuir-(region|end) (\w+)", line)
            if not m:
                assert not line.strip().startswith("// @cuir"), f"{fname}:{no}: malformed marker"
                continue
            kind, name = m.groups()
            if kind == "region":
                assert open_name is None, f"{fname}:{no}: {name} opens inside {open_name}"
                open_name, start = name, no
            else:
                assert open_name == name, f"{fname}:{no}: end {name} closes {open_name}"
                seen.append(name)
                bodies[name] = "\n".join(lines[start:no - 1])
                open_name = None
        assert open_name is None, f"{fname}: region {open_name} never closed"
    assert len(seen) == len(set(seen)), seen
    assert set(REGIONS) <= set(seen), set(REGIONS) - set(seen)
    assert "bool mask_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx)" in bodies["mask"]
    assert "float score_grad(" in bodies["score"] and "float score_mod(" in bodies["score"]
    assert "float dscore(float p, float dp, float dvec)" in bodies["softmax_bwd"]
    for hook in ("QRange q_range(", "int q_count(", "int q_tile_at(", "bool q_tile_partial("):
        assert hook in bodies["q_range"]


# ---------------------------------------------------------------- launcher checks (CPU tensors)


def _args(b=1, hq=4, hkv=2, nq=33, nk=40, d=64, dtype=F16):
    q = torch.randn(b, hq, nq, d, dtype=dtype)
    k, v = torch.randn(b, hkv, nk, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(b, hq, nq, dtype=torch.float32)
    return dout, q, k, v, out, lse


def test_checks_accept_valid_and_return_scale():
    shape, scale = check_backward_args(*_args(), require_cuda=False)
    assert (shape.heads_q, shape.heads_kv, shape.len_q, shape.len_k) == (4, 2, 33, 40)
    assert scale == pytest.approx(64 ** -0.5)
    assert check_backward_args(*_args(), sm_scale=0.3, require_cuda=False)[1] == pytest.approx(0.3)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.__setitem__(5, a[5][..., :-1]), r"lse: expected float32 of shape \(1, 4, 33\)"),
    (lambda a: a.__setitem__(5, a[5].double()), "lse: expected float32"),
    (lambda a: a.__setitem__(0, a[0].transpose(2, 3).contiguous().transpose(2, 3)), "dout: expected a contiguous"),
    (lambda a: a.__setitem__(4, a[4][:, :, :-1]), r"out: expected shape \(1, 4, 33, 64\)"),
    (lambda a: a.__setitem__(0, a[0].to(BF16)), "dout: expected shape"),
    (lambda a: a.__setitem__(slice(2, 4), [t[:, :1].repeat(1, 3, 1, 1) for t in a[2:4]]), "Hq a multiple of Hkv"),
])
def test_checks_name_the_bad_argument(mutate, match):
    args = list(_args())
    mutate(args)
    with pytest.raises(LaunchError, match=match):
        check_backward_args(*args, require_cuda=False)


def test_checks_reject_bad_outputs_and_scale():
    args = _args()
    with pytest.raises(LaunchError, match="dk"):
        check_backward_args(*args, dk=torch.empty(1, 2, 39, 64, dtype=F16), require_cuda=False)
    with pytest.raises(LaunchError, match="dq memory"):
        check_backward_args(*args, dq=args[0], require_cuda=False)
    with pytest.raises(LaunchError, match="sm_scale"):
        check_backward_args(*args, sm_scale=float("nan"), require_cuda=False)
    with pytest.raises(LaunchError, match="CUDA"):
        check_backward_args(*args)


def test_nvrtc_builds_the_same_text(tmp_path):
    """The GPU runtime compiles with NVRTC by default: the headers resolve through -I there too."""
    from cubridge.runtime.build import BuildError as _BuildError, _nvrtc
    try:
        _nvrtc()
    except _BuildError as e:
        pytest.skip(f"NVRTC not importable here: {e.message}")
    res = Fa2BwdSm80(compiler="nvrtc", cache_dir=tmp_path).build(128, BF16, True, False, "sm_90")
    assert res.cubin[:4] == b"\x7fELF"
