"""Head dim 256 on fa3_sm90 without a GPU (issue 19 item 3): the config and shared-memory
arithmetic, the tuner space, the CuIR check / interpreter at the kernel's own D = 256 tile, and
nvcc builds of the dense kernel and of the lowered Gemma-2 local layer (softcap + window) with
their register and spill reports. tests/gpu/test_fa3_sm90_d256.py runs them."""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cubridge.cli import main
from cubridge.cuir.checker import check
from cubridge.cuir.parser import parse_file
from cubridge.paths import ref_kernel_dir
from cubridge.runtime.fa3_sm90 import (KERNEL_DIR, KERNEL_SOURCE, NVCC_FLAGS, SMEM_LIMIT, SUPPORTED_HEAD_DIMS,
                                       Fa3Config, default_config)
from cubridge.runtime.kernels import fit_params, reference_kernel
from cubridge.spec import load_spec
from cubridge.verify import Case, verify_program, verify_transfer

from test_fa3_sm90_build import _disassembler, _nvcc   # tests/cpu is on sys.path (no __init__.py)

GEMMA2 = Path(__file__).resolve().parents[1] / "corpus" / "gemma2_local.py"
NEEDS_NVCC = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")


@pytest.fixture(scope="module")
def program():
    return parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")


def test_default_tiles_and_shared_memory():
    """FlashAttention-3's hdim-256 tiles: 128 x 80 dense, 128 x 64 for a lowered variant; 64 KB of
    Q and 2 x 2 stages of K / V: one Q slot, O staged in it, under 227 KB."""
    assert 256 in SUPPORTED_HEAD_DIMS
    dense, variant = default_config(256, causal=True), default_config(256, causal=True, variant=True)
    assert (dense.block_m, dense.block_n, dense.stages) == (128, 80, 2) and dense.persistent
    assert (variant.block_m, variant.block_n, variant.stages) == (128, 64, 2)
    # dense: FA4's D 256 schedule (session 14: fr over the turns in three H100 runs); a variant keeps the turns
    assert not dense.wg_turns and dense.rescale_before_pv and not dense.pv_wait_early
    assert variant.wg_turns and not variant.rescale_before_pv
    # causal: the Q descriptors in uniform registers (session 15 mid: 706.2 vs 702.2 TFLOPS, 62 GPU tests)
    assert dense.uniform_q and "-DUNIFORM_Q=1" in dense.defines()
    # causal: tiles in L2-sized sections of heads (session 16 mid: see default_config)
    assert dense.tile_sections == 1 and "-DTILE_SECTIONS=1" in dense.defines()
    assert not default_config(256, causal=False).tile_sections and not variant.tile_sections
    assert dense.k_before_v and not default_config(256, causal=False).k_before_v
    assert not default_config(256, causal=False).uniform_q and not variant.uniform_q
    assert "-DWG_TURNS=0" in dense.defines() and "-DRESCALE_BEFORE_PV=1" in dense.defines()
    bars = 8 * (2 * 1 + 2 * 2 + 4 * 2) + 2 * 128
    assert dense.smem_bytes == 128 * 256 * 2 + 2 * 2 * 80 * 256 * 2 + bars + 1024 == 230768
    assert variant.smem_bytes == 128 * 256 * 2 + 2 * 2 * 64 * 256 * 2 + bars + 1024
    for cfg in (dense, variant):
        assert cfg.q_slots_used == 1 and not cfg.separate_o and cfg.smem_bytes <= SMEM_LIMIT
        assert f"-DHOST_SMEM_BYTES={cfg.smem_bytes}" in cfg.defines() and "-DHEAD_DIM=256" in cfg.defines()


def test_tuner_space_at_256():
    s = reference_kernel("fa3_sm90").space
    pts = {(p["block_m"], p["block_n"], p["stages"]) for p in s.points(256, "sm_90a")}
    assert pts == {(128, 64, 2), (128, 80, 2)}
    wide = s.problems({"block_m": 128, "block_n": 96, "stages": 2, "persistent": True}, 256, "sm_90a")
    assert any(p.startswith("shared memory:") for p in wide) and any(p.startswith("registers:") for p in wide)
    three = s.problems({"block_m": 192, "block_n": 64, "stages": 2, "persistent": True}, 256, "sm_90a")
    assert three and three[0].startswith("registers:")
    assert [p["block_n"] for p in s.best_known(256)] == [64, 80]     # the variant tile first


def test_cuir_takes_the_kernels_tile_at_256(program, capsys):
    """The CuIR's own defaults (128 x 128) overflow shared memory at D = 256; check, verify and the
    CLI take the kernel's D = 256 tile instead, and keep the program's defaults at 64 / 128."""
    with pytest.raises(Exception, match="shared memory"):
        check(program, dims={"D": 256})
    at = fit_params(program, 256)
    assert at == {"BLOCK_M": 128, "BLOCK_N": 64, "STAGES": 2, "CONSUMERS": 2}
    assert check(program, params=at, dims={"D": 256}).smem_bytes <= SMEM_LIMIT
    assert fit_params(program, 128) == {} and fit_params(program, 64) == {}
    assert fit_params(program, 256, {"BLOCK_N": 80}) == {"BLOCK_N": 80}      # what the user says stays
    assert main(["check-ir", "fa3_sm90", "--head-dim", "256"]) == 0
    out = capsys.readouterr().out
    assert "fa3_sm90: ok (D=256; BLOCK_M=128, BLOCK_N=64" in out and "NOT BUILDABLE" not in out


def test_interpreter_verifies_dense_and_gemma2_at_256(program):
    causal = verify_program(program, load_spec("causal"), cases=[Case(1, 2, 1, 100, 100, 256, 0)])
    assert causal.passed, causal.table()
    assert causal.params["BLOCK_N"] == 64
    gemma = verify_transfer(program, load_spec(GEMMA2), spec_params={"window": 40},
                            cases=[Case(1, 4, 2, 180, 180, 256, 1)])
    assert gemma.passed, gemma.table()


def _build(defines: list[str], source: Path, out: Path) -> str:
    proc = subprocess.run([_nvcc(), *NVCC_FLAGS, *defines, f"-I{KERNEL_DIR}", "-Xptxas", "-v", "-o", str(out),
                           str(source)], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{defines}: nvcc failed\n{log[-3000:]}"
    for warning in ("C7508", "C7510", "C7515", "serializ"):   # setmaxnreg ignored / wgmma serialized
        assert warning not in log, f"{defines}: ptxas warning {warning}\n{log}"
    return log


def _fwd_spill(log: str) -> int:
    """Spill-store bytes of fa3_sm90_fwd from a -Xptxas -v log."""
    m = re.search(r"Function properties for fa3_sm90_fwd\s+\d+ bytes stack frame, (\d+) bytes spill stores", log)
    assert m, log
    return int(m.group(1))


@NEEDS_NVCC
def test_dense_d256_builds(tmp_path):
    """128 x 64 (40 / 232 registers) compiles (nearly) spill-free; 128 x 80 (24 / 240) spills a few bytes
    (nvcc 13.0: 2 in the consumers, once per tile, the rest in the one producer thread)."""
    cfgs = [Fa3Config(256, 128, 64, 2, causal=True), Fa3Config(256, 128, 80, 2, causal=True),
            Fa3Config(256, 128, 80, 2, causal=False, bf16=False)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = list(pool.map(lambda c: _build(c.defines(), KERNEL_SOURCE, tmp_path / f"{c.block_n}{c.bf16}.cubin"),
                             cfgs))
    # 128 x 64 was spill-free at d256's start; 2 bytes since main's end-aligned queries (kernel.cu)
    assert _fwd_spill(logs[0]) <= 8
    assert _fwd_spill(logs[1]) <= 32 and _fwd_spill(logs[2]) <= 32


@NEEDS_NVCC
def test_three_consumers_are_refused_at_256(tmp_path):
    proc = subprocess.run([_nvcc(), *NVCC_FLAGS, "-DHEAD_DIM=256", "-DBLOCK_M=192", "-DBLOCK_N=64", f"-I{KERNEL_DIR}",
                           "-o", str(tmp_path / "x.cubin"), str(KERNEL_SOURCE)], capture_output=True, text=True)
    assert proc.returncode != 0 and "HEAD_DIM 256 needs BLOCK_M 128" in proc.stderr


@NEEDS_NVCC
def test_gemma2_local_lowers_and_builds_at_256(program, tmp_path):
    """The Gemma-2 local layer (softcap 50 + sliding window, causal) lowered onto fa3_sm90 compiles
    at the variant tile 128 x 64 (nvcc 13.0: 36 bytes spilled in the consumers, a few per KV tile)."""
    from cubridge.lower import lower
    from cubridge.transfer.rules import transfer
    cand = transfer(program, load_spec(GEMMA2), spec_params={"window": 4096})
    src = tmp_path / "gemma2.cu"
    src.write_text(lower(cand.program, "fa3_sm90").source)
    cfg = reference_kernel("fa3_sm90").config({"block_m": 128, "block_n": 64, "stages": 2}, 256, "bf16")
    log = _build(cfg.defines(), src, tmp_path / "gemma2.cubin")
    assert _fwd_spill(log) <= 64, log


def test_lift_check_runs_the_cuir_at_its_tile_at_256(tmp_path):
    """The lift check job at a D = 256 shape: kernel and CuIR agree. (The job hands the interpreter
    fa3_sm90's D = 256 tile; the interpreter itself does not count shared memory, so this checks
    that the flow runs at 256, not which tile it used.)"""
    from cubridge.search.lift_check import lift_check_job
    launcher = tmp_path / "launch.py"
    launcher.write_text("from cubridge.spec import load_spec\n_spec = load_spec('causal')\n"
                        "def launch(q, k, v):\n    return _spec.run_reference(q, k, v)\n")
    cuir = (ref_kernel_dir("fa3_sm90") / "kernel.cuir").read_text()
    outcome, detail = lift_check_job({"spec": "causal", "cuir": cuir, "launcher": str(launcher), "device": "cpu",
                                      "shapes": [(1, 2, 1, 90, 256, 0)]})
    assert outcome.state.value == "ok", (outcome, detail)


@NEEDS_NVCC
def test_session14_options_build_spill_free_and_only_at_256(tmp_path):
    """k_before_v (K_BEFORE_V=1; FA4's producer order) and pv_wait_early (PV_WAIT_EARLY=1), off by default,
    are D 256 options: they build 128 x 80 causal spill-free with turns and in FA4's schedule (no turns, O
    rescaled before the P V), change the SASS there, and leave a D 128 build as it was (the macros are
    ignored). mbar_sleep (MBAR_SLEEP=1) builds spill-free here too (every head dim since session 15:
    tests/cpu/test_fa3_sm90_s15_build.py has D 64 / 128)."""
    assert "-DK_BEFORE_V=1" in Fa3Config(k_before_v=True).defines()
    assert "-DPV_WAIT_EARLY=1" in Fa3Config(pv_wait_early=True).defines()
    assert "-DMBAR_SLEEP=1" in Fa3Config(mbar_sleep=True).defines()
    assert not any("K_BEFORE_V" in f or "PV_WAIT" in f for f in Fa3Config(256, 128, 80, 2, causal=True).defines())
    fr = dict(causal=True, wg_turns=False, rescale_before_pv=True)
    cfgs = [Fa3Config(256, 128, 80, 2, causal=True, k_before_v=True, pv_wait_early=True),
            Fa3Config(256, 128, 80, 2, **fr, k_before_v=True),
            Fa3Config(256, 128, 80, 2, **fr, pv_wait_early=True),
            Fa3Config(256, 128, 80, 2, **fr),
            Fa3Config(256, 128, 80, 2, **fr, mbar_sleep=True)]
    d128 = [Fa3Config(128, 128, 128, 2, causal=True),
            Fa3Config(128, 128, 128, 2, causal=True, k_before_v=True, pv_wait_early=True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = list(pool.map(lambda ic: _build(ic[1].defines(), KERNEL_SOURCE, tmp_path / f"{ic[0]}.cubin"),
                             enumerate(cfgs + d128)))
    assert [_fwd_spill(log) for log in logs[:5]] == [0, 0, 0, 0, 0]
    cubins = [(tmp_path / f"{i}.cubin").read_bytes() for i in range(len(cfgs + d128))]
    assert cubins[1] != cubins[3] and cubins[2] != cubins[3], "an option built the same code as without it"
    tool = _disassembler()
    if tool is not None:
        sass = [subprocess.run([*tool, str(tmp_path / f"{i}.cubin")], capture_output=True, text=True, check=True).stdout
                for i in (2, 5, 6, 4)]
        # pv_wait_early: the steady step waits for the QK (wait_group 1) and at once for the P V (0)
        assert re.search(r"DEPBAR\.LE gsb0, 0x1 ;.*\n(?:.*\n){0,10}.*DEPBAR\.LE gsb0, 0x0 ;", sass[0]), \
            "pv_wait_early: no wait_group 0 right after the wait_group 1"
        assert sass[1] == sass[2], "K_BEFORE_V / PV_WAIT_EARLY changed a D 128 build"
        # mbar_sleep: the waits' retry paths sleep in the barrier (the suspend-time hint)
        assert "NANOSLEEP.SYNCS" in sass[3], "mbar_sleep: no NANOSLEEP.SYNCS in the build"
