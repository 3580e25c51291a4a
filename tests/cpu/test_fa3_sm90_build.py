"""CPU checks of the Hopper reference kernel: the lifting map is well formed, and a few configs
compile to sm_90a cubins with no spills, no ignored setmaxnreg and no serialized wgmma (and, where
cuobjdump is installed, the SASS holds HGMMA and TMA loads and no local-memory traffic)."""
from __future__ import annotations

import glob
from dataclasses import replace
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cubridge.errors import LaunchError
from cubridge.runtime.fa3_sm90 import KERNEL_DIR, KERNEL_SOURCE, NVCC_FLAGS, Fa3Config, fa3_forward

REGIONS = ["head_map", "extra_io", "kv_range", "load_q", "load_kv", "qk", "score", "mask", "softmax", "pv",
           "epilogue"]
CONFIGS = [Fa3Config(head_dim=128, causal=True, bf16=True),
           Fa3Config(head_dim=64, causal=False, bf16=False),
           Fa3Config(head_dim=64, block_m=192, causal=True, bf16=True),
           Fa3Config(head_dim=128, block_n=176, causal=False, bf16=True)]
MARKER = re.compile(r"^\s*// @cuir-(region|end) (\w+)\s*$")


def _nvcc() -> str | None:
    return shutil.which("nvcc") or (p if Path(p := "/usr/local/cuda/bin/nvcc").exists() else None)


def test_region_markers_present_and_balanced():
    open_regions: list[str] = []
    seen: list[str] = []
    for lineno, line in enumerate(KERNEL_SOURCE.read_text().splitlines(), 1):
        if "@cuir-" not in line or "Lifting map" in line:
            continue
        m = MARKER.match(line)
        assert m, f"kernel.cu:{lineno}: malformed marker {line.strip()!r}"
        kind, name = m.groups()
        if kind == "region":
            assert name not in seen, f"kernel.cu:{lineno}: region {name} opened twice"
            assert not open_regions, f"kernel.cu:{lineno}: {name} opens inside {open_regions[-1]}"
            open_regions.append(name)
            seen.append(name)
        else:
            assert open_regions and open_regions[-1] == name, f"kernel.cu:{lineno}: stray end {name}"
            open_regions.pop()
    assert not open_regions, f"unclosed regions {open_regions}"
    assert sorted(seen) == sorted(REGIONS), f"regions {seen}, expected {REGIONS}"


def test_hooks_live_in_their_regions():
    text = KERNEL_SOURCE.read_text()
    body = lambda name: text.split(f"// @cuir-region {name}\n")[1].split(f"// @cuir-end {name}")[0]
    flat = lambda name: " ".join(body(name).split())
    assert "float score_mod(const VariantArgs& va, float x, float scale, int b, int h, int q_idx, int kv_idx)" in flat("score")
    assert "constexpr float kScoreFactor" in flat("score")
    assert "bool mask_pred(const VariantArgs& va, int b, int h, int q_idx, int kv_idx)" in flat("mask")
    assert "struct VariantArgs" in flat("extra_io")
    for hook in ("KvRange kv_range(", "int kv_count(", "int tile_at(", "bool tile_partial("):
        assert hook in flat("kv_range")
    # the attention entry and the tile-count entry (the same kv_range, for the longest-first order)
    assert text.count('extern "C" __global__') == 2
    assert "fa3_sm90_fwd(" in text and "fa3_sm90_tile_counts(" in text


def _compile(config: Fa3Config, out_dir: Path) -> tuple[Fa3Config, subprocess.CompletedProcess, Path]:
    cubin = out_dir / (("_".join(config.defines())).replace("-D", "").replace("=", "") + ".cubin")
    proc = subprocess.run([_nvcc(), *NVCC_FLAGS, *config.defines(), f"-I{KERNEL_DIR}", "-Xptxas", "-v",
                           "-o", str(cubin), str(KERNEL_SOURCE)], capture_output=True, text=True)
    return config, proc, cubin


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_configs_compile_for_sm90a(tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _compile(c, tmp_path), CONFIGS))
    cuobjdump = shutil.which("cuobjdump")
    for config, proc, cubin in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{config}: nvcc failed\n{log[-3000:]}"
        assert "0 bytes spill stores, 0 bytes spill loads" in log, f"{config}: spills\n{log}"
        assert "0 bytes stack frame" in log, f"{config}: stack frame (local memory)\n{log}"
        for warning in ("C7508", "C7510", "C7515", "serializ"):   # setmaxnreg ignored / wgmma serialized
            assert warning not in log, f"{config}: ptxas warning {warning}\n{log}"
        if cuobjdump:
            sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
            assert "HGMMA" in sass and "UTMALDG" in sass and "UTMASTG" in sass, f"{config}: SASS"
            assert not re.search(r"\b(LDL|STL)\b", sass), f"{config}: local memory in SASS"


def _nvrtc_or_skip():
    from cubridge.errors import CubridgeError
    from cubridge.runtime.build import _nvrtc
    try:
        _nvrtc()
    except CubridgeError as e:
        pytest.skip(f"NVRTC is not importable here ({str(e).splitlines()[0]}); the test extra installs it")


@pytest.mark.parametrize("variant", [None, "share_question", "composite", "relative_pos"],
                         ids=lambda v: v or "dense")
def test_nvrtc_compiles_the_kernel(variant, tmp_path):
    """The run-time path of a machine without nvcc: kernel.cu and its headers need no toolkit
    header under NVRTC, for the dense kernel and for lowered variants (block table, score_mod,
    normalisation)."""
    _nvrtc_or_skip()
    from cubridge.runtime.fa3_sm90 import build_cubin, default_config
    source, config = None, Fa3Config(head_dim=128, causal=True, bf16=True)
    if variant:
        from cubridge.cuir.parser import parse_file
        from cubridge.lower import lower
        from cubridge.paths import ref_kernel_dir
        from cubridge.spec import load_spec
        from cubridge.transfer.rules import transfer
        ref = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
        source = lower(transfer(ref, load_spec(variant)).program, "fa3_sm90").source
        config = default_config(128, False, True, 8192, variant=True)
    cubin = build_cubin(config, cache_dir=tmp_path, source=source, compiler="nvrtc")
    assert b"fa3_sm90_fwd" in cubin and b"fa3_sm90_tile_counts" in cubin


def test_without_nvcc_the_build_falls_back_to_nvrtc(monkeypatch, tmp_path):
    """A GPU box with the driver and the pip NVRTC library but no toolkit: default_compiler()
    and build_cubin(compiler=None) take NVRTC; with neither, available_compiler() says so."""
    _nvrtc_or_skip()
    from cubridge.runtime import build
    from cubridge.runtime.fa3_sm90 import build_cubin
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build.default_compiler() == "nvrtc" and build.available_compiler() == "nvrtc"
    cubin = build_cubin(Fa3Config(head_dim=64, causal=False, bf16=False), cache_dir=tmp_path)
    assert b"fa3_sm90_fwd" in cubin
    [entry] = list(tmp_path.glob("*.cubin"))
    assert entry.read_bytes() == cubin

    def no_nvrtc():
        raise build.BuildError("NVRTC is not available through CuPy: test")
    monkeypatch.setattr(build, "_nvrtc", no_nvrtc)
    assert build.available_compiler() is None and "nvcc is not on PATH" in build.NO_COMPILER


def test_q_slots_and_shared_memory_follow_the_layout():
    """Two Q slots where three Q tiles (two slots, a separate O stage) fit beside the rings, one
    otherwise; the kernel static_asserts its size against HOST_SMEM_BYTES from these numbers."""
    d128 = Fa3Config(head_dim=128, block_m=128, block_n=128, stages=2)
    assert d128.q_slots_used == 2 and d128.separate_o
    assert d128.smem_bytes == 3 * 32768 + 2 * 2 * 32768 + 8 * (4 + 4 + 8) + 256 + 1024
    wide = Fa3Config(head_dim=128, block_m=128, block_n=176, stages=2)
    assert wide.q_slots_used == 1 and not wide.separate_o       # O staged in the only Q slot
    one = Fa3Config(head_dim=64, q_slots=1)
    assert one.q_slots_used == 1 and one.separate_o and "-DQ_SLOTS=1" in one.defines()
    assert f"-DHOST_SMEM_BYTES={one.smem_bytes}" in one.defines()
    assert "-DQ_SLOTS=1" not in Fa3Config(head_dim=64).defines()



def _disassembler() -> list[str] | None:
    """cuobjdump -sass, or nvdisasm (toolkit or the nvidia-cuda-nvdisasm wheel); None: neither."""
    if shutil.which("cuobjdump"):
        return [shutil.which("cuobjdump"), "-sass"]
    found = shutil.which("nvdisasm") or next(iter(glob.glob(
        str(Path(sys.prefix) / "lib" / "python3*" / "site-packages" / "nvidia" / "*" / "bin" / "nvdisasm"))), None)
    return [found, "-c"] if found else None


# The SASS tests' skip (session 16 / 17 build tests import it): nvcc to build, a disassembler to read the result.
NEEDS_SASS_TOOLS = pytest.mark.skipif(_nvcc() is None or _disassembler() is None,
                                      reason="nvcc and a SASS disassembler not found (needs the CUDA toolkit, no GPU)")


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_full_attention_options_build_spill_free_and_compile_out_under_causal(tmp_path):
    """kv_rotate / l2_hints (off by default) set their macros, build spill-free, change a full-
    attention build and leave a causal one as it is (the kernel gates them on !kCausal)."""
    assert {"-DKV_ROTATE=1", "-DL2_HINTS=1"} <= set(Fa3Config(kv_rotate=True, l2_hints=True).defines())
    assert not any("KV_ROTATE" in f or "L2_HINTS" in f for f in Fa3Config().defines())
    both = dict(kv_rotate=True, l2_hints=True)
    configs = [Fa3Config(head_dim=128, block_n=176, **both), Fa3Config(head_dim=128, block_n=176),
               Fa3Config(head_dim=128, causal=True, **both), Fa3Config(head_dim=128, causal=True),
               Fa3Config(head_dim=64, block_m=192, **both)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _compile(c, tmp_path), configs))
    for config, proc, _ in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{config}: nvcc failed\n{log[-3000:]}"
        assert "0 bytes spill stores, 0 bytes spill loads" in log, f"{config}: spills\n{log}"
    tool = _disassembler()
    if tool is None:
        return
    sass = [[ln for ln in subprocess.run([*tool, str(cubin)], capture_output=True, text=True, check=True)
             .stdout.splitlines() if str(tmp_path) not in ln] for _, _, cubin in results]
    assert sass[0] != sass[1], "the options changed nothing in a full-attention build"
    assert sass[2] == sass[3], "the options changed a causal build"


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_tail_split_builds_spill_free_at_the_default_full_tiles(tmp_path):
    """tail_split (off by default, session 13) sets TAIL_SPLIT, changes a full-attention build and
    builds spill-free at the tiles default_config picks for full attention at D 64 / 128."""
    assert "-DTAIL_SPLIT=1" in Fa3Config(tail_split=True).defines()
    assert not any("TAIL_SPLIT" in f for f in Fa3Config().defines())
    configs = [Fa3Config(head_dim=128, block_n=176, tail_split=True), Fa3Config(head_dim=128, block_n=176),
               Fa3Config(head_dim=128, tail_split=True), Fa3Config(head_dim=64, block_m=192, tail_split=True),
               Fa3Config(head_dim=64, tail_split=True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _compile(c, tmp_path), configs))
    for config, proc, _ in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{config}: nvcc failed\n{log[-3000:]}"
        assert "0 bytes spill stores, 0 bytes spill loads" in log, f"{config}: spills\n{log}"
        assert "C7512" not in log, f"{config}: wgmma serialised\n{log}"
    tool = _disassembler()
    if tool is not None:
        sass = [[ln for ln in subprocess.run([*tool, str(cubin)], capture_output=True, text=True, check=True)
                 .stdout.splitlines() if str(tmp_path) not in ln] for _, _, cubin in results[:2]]
        assert sass[0] != sass[1], "tail_split changed nothing in a full-attention build"


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_o_half_builds_spill_free_at_128x176_and_changes_nothing_with_an_o_stage(tmp_path):
    """o_half (off by default, session 14) sets O_HALF, builds 128 x 176 spill-free with no serialised
    wgmma (full / causal, bf16 / fp16, with tail_split), adds 16 KB + an mbarrier to its shared memory, and is a no-op
    where O has its own stage (128 x 128: the same cubin text)."""
    assert "-DO_HALF=1" in Fa3Config(o_half=True).defines()
    assert not any("O_HALF" in f for f in Fa3Config().defines())
    wide = Fa3Config(head_dim=128, block_n=176, persistent=True)
    assert replace(wide, o_half=True).smem_bytes == wide.smem_bytes + 64 * 128 * 2 + 8
    assert Fa3Config(o_half=True).smem_bytes == Fa3Config().smem_bytes
    configs = [replace(wide, o_half=True), replace(wide, o_half=True, causal=True),
               replace(wide, o_half=True, bf16=False), replace(wide, o_half=True, tail_split=True),
               Fa3Config(o_half=True), Fa3Config(o_half=False)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _compile(c, tmp_path), configs))
    for config, proc, _ in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{config}: nvcc failed\n{log[-3000:]}"
        assert "0 bytes spill stores, 0 bytes spill loads" in log, f"{config}: spills\n{log}"
        assert "C7512" not in log, f"{config}: wgmma serialised\n{log}"
    text = [_text_section(cubin) for _, _, cubin in results[4:]]
    assert text[0] == text[1], "o_half changed a build that has an O stage of its own"


def _text_section(cubin: Path, name: str = ".text.fa3_sm90_fwd") -> bytes:
    """The bytes of one ELF64 section of a cubin (no disassembler needed)."""
    import struct
    b = cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", b, 0x28)
    entsize, num, strndx = struct.unpack_from("<HHH", b, 0x3A)
    hdr = lambda i: struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * entsize)
    names = hdr(strndx)[4]
    for i in range(num):
        h = hdr(i)
        if b[names + h[0]: b.index(b"\0", names + h[0])].decode() == name:
            return b[h[4]: h[4] + h[5]]
    raise KeyError(name)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_softmax_first_reaches_three_consumers_spill_free(tmp_path):
    """softmax_first at D 64 192 x 128 (three consumers; session 14) changes the build and spills nothing."""
    configs = [Fa3Config(head_dim=64, block_m=192, causal=c, softmax_first=f) for c in (False, True) for f in (True, False)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _compile(c, tmp_path), configs))
    for config, proc, _ in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{config}: nvcc failed\n{log[-3000:]}"
        assert "0 bytes spill stores, 0 bytes spill loads" in log, f"{config}: spills\n{log}"
    text = [_text_section(cubin) for _, _, cubin in results[:2]]
    assert text[0] != text[1], "softmax_first changed nothing at three consumers"


def test_o_half_is_refused_where_it_does_not_fit():
    q = torch.zeros(1, 1, 8, 256, dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="o_half"):
        fa3_forward(q, q, q, config=Fa3Config(head_dim=256, block_n=80, o_half=True))


def test_tail_split_is_refused_at_head_dim_256():
    q = torch.zeros(1, 1, 8, 256, dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="tail_split"):
        fa3_forward(q, q, q, config=Fa3Config(head_dim=256, block_n=80, tail_split=True))


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_d256_without_turns_builds_spill_free_and_drops_the_turn_barriers(tmp_path):
    """wg_turns=False (off by default: WG_TURNS=0), alone and with rescale_before_pv (and
    softmax_first), builds D 256 128 x 80 spill-free, and
    removes the consumers' turn barriers (BAR.SYNC / BAR.ARV of 256 threads, 0x100: the only
    named barriers that count both consumers; the epilogue's count 128)."""
    assert "-DWG_TURNS=0" in Fa3Config(wg_turns=False).defines()
    assert not any("WG_TURNS" in f for f in Fa3Config().defines())
    assert "-DRESCALE_BEFORE_PV=1" in Fa3Config(rescale_before_pv=True).defines()
    assert "-DSOFTMAX_FIRST=1" in Fa3Config(softmax_first=True).defines()
    configs = [Fa3Config(head_dim=256, block_n=80, causal=True, wg_turns=False),
               Fa3Config(head_dim=256, block_n=80, causal=True),
               Fa3Config(head_dim=256, block_n=80, causal=True, wg_turns=False, rescale_before_pv=True),
               Fa3Config(head_dim=256, block_n=80, causal=False, wg_turns=False, rescale_before_pv=True,
                         softmax_first=True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _compile(c, tmp_path), configs))
    for config, proc, _ in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{config}: nvcc failed\n{log[-3000:]}"
        assert "0 bytes spill stores, 0 bytes spill loads" in log, f"{config}: spills\n{log}"
    tool = _disassembler()
    if tool is None:
        return
    sass = [subprocess.run([*tool, str(cubin)], capture_output=True, text=True, check=True).stdout
            for _, _, cubin in results[:2]]
    turn_bars = [len(re.findall(r"BAR\.(?:SYNC|ARV)[^;]*,\s*0x100\s*;", s)) for s in sass]
    assert turn_bars[1] > 0, "the default build has no turn barrier: the pattern needs updating"
    assert turn_bars[0] == 0, f"WG_TURNS=0 left {turn_bars[0]} turn barriers"
