"""CPU checks of ref_kernels/fa2_sm80: it compiles with nvcc for sm_80 and sm_90 (both dtypes,
both head dims, causal and not), its lifting-map regions are present and balanced, and the runtime's
cache key, config validity and pre-launch checks behave -- all without a GPU."""
from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cubridge.errors import BuildError, LaunchError
from cubridge.runtime.build import cache_key, compile_cubin
from cubridge.runtime.fa2_sm80 import KERNEL_PATH, Config, Fa2Sm80, default_config
from cubridge.runtime.launch import check_attention_args

REGIONS = ["head_map", "extra_io", "kv_range", "qk", "score", "mask", "softmax", "pv", "epilogue", "load_q", "load_kv"]
HAS_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="nvcc not on PATH: the CUDA toolkit is not installed here")

# ---------------------------------------------------------------- compiles


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """8 specialisations x 2 archs, two nvcc processes at a time (~1 s each)."""
    cache = tmp_path_factory.mktemp("kernels")
    jobs = [(arch, d, dt, c) for arch in ("sm_80", "sm_90") for d in (64, 128)
            for dt in (torch.float16, torch.bfloat16) for c in (False, True)]

    def build(job):
        arch, d, dt, c = job
        fa2 = Fa2Sm80(compiler="nvcc", cache_dir=cache)
        return job, compile_cubin(fa2.source, arch=arch, options=[*fa2.options(d, dt, c), "--resource-usage"],
                                  compiler="nvcc", cache_dir=cache)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, jobs))


@needs_nvcc
def test_compiles_for_sm80_and_sm90(builds):
    assert len(builds) == 16
    for (arch, d, dt, causal), res in builds.items():
        assert res.cubin[:4] == b"\x7fELF", f"{arch} D={d} {dt} causal={causal}: not a cubin"
        assert f"'{arch}'" in res.log, res.log   # --resource-usage names the target


@needs_nvcc
def test_resource_usage_is_sane(builds):
    """255 registers at most, no huge spill (the default tiling spills ~100 bytes at D=128)."""
    for job, res in builds.items():
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", res.log)]
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", res.log)]
        assert regs and max(regs) <= 255, (job, res.log)
        assert spills and max(spills) <= 512, (job, res.log)


@needs_nvcc
def test_kv_split_builds_and_refuses_a_non_divisor(tmp_path):
    """KV_SPLIT=2 (an option, off by default: experiments/ab_fa2_spills.py) builds at both head dims;
    a split that does not divide BLOCK_N stops at its static_assert."""
    fa2 = Fa2Sm80(compiler="nvcc", cache_dir=tmp_path)
    for d in (64, 128):
        opts = [*fa2.options(d, torch.bfloat16, True), "-DKV_SPLIT=2"]
        assert compile_cubin(fa2.source, arch="sm_90", options=opts, compiler="nvcc", cache_dir=tmp_path).cubin
    with pytest.raises(BuildError, match="KV_SPLIT divides BLOCK_N"):
        compile_cubin(fa2.source, arch="sm_90", options=[*fa2.options(128, torch.bfloat16, False), "-DKV_SPLIT=3"],
                      compiler="nvcc", cache_dir=tmp_path)


@needs_nvcc
def test_split_with_rolled_qk_is_spill_free_at_d128(tmp_path):
    """KV_SPLIT=2 with QK_ROLLED=1 (options, off by default; session 13, issue 19 item 7): the reference
    at the default 128 x 64 x 4-warp tile builds with 0 spilled bytes at D 128, causal and full, sm_80
    and sm_90 (experiments/fa2_spills.py --define KV_SPLIT=2 QK_ROLLED=1: every built-in variant too)."""
    fa2 = Fa2Sm80(compiler="nvcc", cache_dir=tmp_path)

    def build(job):
        arch, causal = job
        opts = [*fa2.options(128, torch.bfloat16, causal), "-DKV_SPLIT=2", "-DQK_ROLLED=1", "--resource-usage"]
        return job, compile_cubin(fa2.source, arch=arch, options=opts, compiler="nvcc", cache_dir=tmp_path).log

    with ThreadPoolExecutor(2) as pool:
        logs = dict(pool.map(build, [(a, c) for a in ("sm_80", "sm_90") for c in (False, True)]))
    for job, log in logs.items():
        stores = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
        loads = [int(x) for x in re.findall(r"(\d+) bytes spill loads", log)]
        frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
        assert stores and max(stores + loads + frames) == 0, (job, log)


@needs_nvcc
def test_build_error_carries_the_log(tmp_path):
    with pytest.raises(BuildError) as e:
        compile_cubin('extern "C" __global__ void k() { this is not cuda; }', arch="sm_80",
                      compiler="nvcc", cache_dir=tmp_path)
    assert "error" in str(e.value)


@needs_nvcc
def test_cache_hit_and_dir_override(tmp_path):
    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 2.f; }'
    a = compile_cubin(src, arch="sm_80", compiler="nvcc", cache_dir=tmp_path)
    b = compile_cubin(src, arch="sm_80", compiler="nvcc", cache_dir=tmp_path)
    assert not a.cached and b.cached and a.cubin == b.cubin and a.key == b.key
    assert (tmp_path / f"{a.key}.cubin").is_file()


def test_bad_arch_is_rejected():
    with pytest.raises(BuildError, match="sm_80"):
        compile_cubin("", arch="ampere", compiler="nvcc")


# ---------------------------------------------------------------- lifting map


def test_regions_present_and_balanced():
    lines = KERNEL_PATH.read_text().splitlines()
    open_name, seen, spans = None, [], {}
    for no, line in enumerate(lines, 1):
        m = re.fullmatch(r"\s*// @cuir-(region|end) (\w+)", line)
        if not m:
            assert not line.strip().startswith("// @cuir"), f"line {no}: malformed marker {line!r}"
            continue
        kind, name = m.groups()
        if kind == "region":
            assert open_name is None, f"line {no}: region {name} opens inside {open_name}"
            open_name, start = name, no
        else:
            assert open_name == name, f"line {no}: end {name} closes {open_name}"
            seen.append(name)
            spans[name] = (start, no)
            open_name = None
    assert open_name is None, f"region {open_name} never closed"
    assert sorted(seen) == sorted(set(seen)), f"a region appears twice: {seen}"
    assert set(REGIONS) <= set(seen), f"missing regions: {set(REGIONS) - set(seen)}"

    def body(name):
        a, b = spans[name]
        return "\n".join(lines[a:b - 1])
    assert "float score_mod(const VariantArgs& va, float s, int b, int h, int q_idx, int kv_idx)" in body("score")
    assert "bool mask_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx)" in body("mask")
    for hook in ("KvRange kv_range(", "int kv_count(", "int tile_at(", "bool tile_partial("):
        assert hook in body("kv_range")
    assert "KvRange kv_range(" in body("kv_range")
    assert "struct OnlineSoftmax" in body("softmax")
    assert "lse_head" in body("epilogue")


def test_full_tiles_have_no_mask_code():
    """The main loop is split: full tiles instantiate step<false>, whose score loop skips mask_pred."""
    text = KERNEL_PATH.read_text()
    assert "step<false>(i, tile" in text and "step<true>(i, tile_at(" in text
    assert "if (PARTIAL && !((kv_idx < len_k) & mask_pred(" in text


def test_every_macro_has_a_default():
    text = KERNEL_PATH.read_text()
    for macro in ("BLOCK_M", "BLOCK_N", "STAGES", "WARPS", "HEAD_DIM", "IS_CAUSAL", "IS_BF16"):
        assert f"#ifndef {macro}\n#define {macro} " in text, macro
    assert len(re.findall(r'extern "C" __global__', text)) == 1


# ---------------------------------------------------------------- cache key


def test_cache_key_covers_every_input():
    base = cache_key("src", ["-DA=1"], "sm_90", "nvcc", "V13.0")
    assert base == cache_key("src", ["-DA=1"], "sm_90", "nvcc", "V13.0")
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    others = [cache_key("src2", ["-DA=1"], "sm_90", "nvcc", "V13.0"),
              cache_key("src", ["-DA=2"], "sm_90", "nvcc", "V13.0"),
              cache_key("src", ["-DA=1"], "sm_80", "nvcc", "V13.0"),
              cache_key("src", ["-DA=1"], "sm_90", "nvrtc", "V13.0"),
              cache_key("src", ["-DA=1"], "sm_90", "nvcc", "V13.1"),
              cache_key("src", ["-DA=1", "-DB=1"], "sm_90", "nvcc", "V13.0")]
    assert len({base, *others}) == len(others) + 1
    # Field boundaries matter: moving text between fields changes the key.
    assert cache_key("ab", ["c"], "sm_90", "nvcc", "v") != cache_key("a", ["bc"], "sm_90", "nvcc", "v")
    assert cache_key("s", ["-DA=1", "-DB=1"], "sm_90", "nvcc", "v") != \
        cache_key("s", ["-DB=1", "-DA=1"], "sm_90", "nvcc", "v")


# ---------------------------------------------------------------- configs


def test_config_validity():
    assert default_config(128).is_valid(128) and default_config(64).is_valid(64)
    assert Config.parse(str(Config(256, 64, 3, 8))) == Config(256, 64, 3, 8)
    assert any("multiple of 16 * warps" in p for p in Config(96, 64, 2, 4).problems(128))
    assert any("stages" in p for p in Config(128, 64, 1, 4).problems(128))
    assert any("multiple of 16" in p for p in Config(128, 40, 2, 4).problems(128))
    assert any("shared memory" in p for p in Config(128, 128, 4, 8).problems(128))
    assert any("shared memory" in p for p in Config(128, 128, 2, 8).problems(128, smem_limit=101376))
    assert any("registers" in p for p in Config(256, 32, 2, 4).problems(128))
    assert any("rows per pass" in p for p in Config(64, 64, 2, 2).problems(128))
    assert Config(128, 64, 2, 4).smem_bytes(128) == 2 * 128 * (128 + 2 * 2 * 64)
    space = Config.space(128)
    assert default_config(128) in space and all(c.is_valid(128) for c in space)


def test_invalid_config_is_rejected_before_compiling():
    with pytest.raises(LaunchError, match="invalid"):
        Fa2Sm80(Config(96, 64, 2, 4), compiler="nvcc").build(128, torch.float16, False, "sm_90")


# ---------------------------------------------------------------- pre-launch checks


def _qkv(b=2, hq=8, hkv=2, nq=33, nk=45, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, hq, nq, d).to(dtype), torch.randn(b, hkv, nk, d).to(dtype),
            torch.randn(b, hkv, nk, d).to(dtype))


def test_valid_args_give_the_shape():
    q, k, v = _qkv()
    shape = check_attention_args(q, k, v, require_cuda=False)
    assert (shape.batch, shape.heads_q, shape.heads_kv, shape.len_q, shape.len_k, shape.head_dim) == \
        (2, 8, 2, 33, 45, 128)
    check_attention_args(q, k, v, torch.empty_like(q), torch.empty(2, 8, 33), require_cuda=False)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q.float(), k, v), "float16 or bfloat16"),
    (lambda q, k, v: (q, k.half(), v.half()), "q, k, v all"),
    (lambda q, k, v: (q[0], k, v), "4 dims"),
    (lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v), "contiguous"),
    (lambda q, k, v: (q, k[:, :, :, :64].contiguous(), v), "same B and D"),
    (lambda q, k, v: (q, k, v[:, :, :40].contiguous()), "shape of k"),
    (lambda q, k, v: (q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1)), "multiple of Hkv"),
    (lambda q, k, v: (q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous()), "head dim"),
])
def test_bad_inputs_say_what_was_expected(mutate, match):
    with pytest.raises(LaunchError, match=match) as e:
        check_attention_args(*mutate(*_qkv()), require_cuda=False)
    assert "expected" in str(e.value)


def test_bad_outputs_are_rejected():
    q, k, v = _qkv()
    with pytest.raises(LaunchError, match="out"):
        check_attention_args(q, k, v, torch.empty(2, 8, 33, 64, dtype=q.dtype), require_cuda=False)
    with pytest.raises(LaunchError, match="lse"):
        check_attention_args(q, k, v, None, torch.empty(2, 8, 33, dtype=torch.bfloat16), require_cuda=False)
    with pytest.raises(LaunchError, match="overlaps q"):
        check_attention_args(q, k, v, q, require_cuda=False)
    with pytest.raises(LaunchError, match="overlaps k"):
        lse_on_k = torch.empty(0, dtype=torch.float32).set_(k.untyped_storage(), 0, (2, 8, 33))
        check_attention_args(q, k, v, None, lse_on_k, require_cuda=False)


def test_cpu_tensors_are_rejected_without_touching_a_gpu():
    with pytest.raises(LaunchError, match="CUDA tensors"):
        Fa2Sm80(compiler="nvcc")(*_qkv(), causal=True)


def test_cache_key_covers_included_headers(tmp_path):
    """An edited header in an -I directory must not hit a cubin built from the old one."""
    from cubridge.runtime.build import _included_headers
    (tmp_path / "helpers.cuh").write_text("#define X 1\n")
    before = _included_headers([f"-I{tmp_path}", "-DY=2"])
    (tmp_path / "helpers.cuh").write_text("#define X 2\n")
    assert _included_headers([f"-I{tmp_path}"]) != before and "#define X 2" in _included_headers([f"-I{tmp_path}"])


def test_concurrent_requests_for_one_key_compile_once(tmp_path, monkeypatch):
    """Processes asking for the same cubin at once (xdist workers, local tuner workers) wait on one
    per-key lock: the first compiles, the rest read its file. Threads stand in for processes here
    (flock locks are per open file, so two threads of one process exclude each other too)."""
    import threading
    import time
    from cubridge.runtime import build as build_mod

    calls = []

    def slow_build(source, options, arch, name):
        calls.append(name)
        time.sleep(0.2)          # long enough that the other thread asks while this one builds
        return b"CUBIN" + source.encode(), "log"

    monkeypatch.setattr(build_mod, "_compile_nvcc", slow_build)
    monkeypatch.setattr(build_mod, "compiler_version", lambda c: "nvcc test")
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        compile_cubin("src", arch="sm_90", compiler="nvcc", cache_dir=tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1, calls
    assert sorted(r.cached for r in results) == [False, True, True]
    assert {r.cubin for r in results} == {b"CUBINsrc"}
