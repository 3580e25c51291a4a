"""CPU checks of the Hopper backward ref_kernels/fa3_bwd_sm90: the lifting map is well formed, four
specialisations (both dQ splits, both dtypes, causal and full) compile for sm_90a with the host's
shared-memory size (static_assert HOST_SMEM_BYTES) and no spills, no ignored setmaxnreg and no
serialized wgmma; the launcher refuses bad input with a clear error; autograd keeps the portable
backward when the Hopper one is switched off."""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cubridge.errors import LaunchError
from cubridge.runtime import fa3_bwd_sm90 as hb

REGIONS = ["extra_io", "q_range", "mask_pred", "score", "softmax_bwd"]
SPECS = [(128, True, True), (128, False, False), (64, True, False), (64, False, True)]
# The performance options (params.cuh DQ_MODE / SCHED): the base path at all four specs above, the
# others at the two extremes (their register peaks are at D = 128; D = 64 takes the K-split dQ).
OPTION_SPECS = [("base", s) for s in SPECS] + [
    (o, s) for o in ("bulk", "bulk_overlap", "bulk_overlap_lse")
    for s in ((128, True, True), (128, False, False), (64, True, False))] + [
    # ARRIVE_ALL: one predicate fewer at the stage release; the two D = 128 corners
    ("bulk_overlap_lse_arriveall", (128, True, True)), ("bulk_overlap_lse_arriveall", (128, False, False))] + [
    # LEAN: the tail wait and the preprocess kernel (one row = 16 or 8 lanes: both head dims)
    ("bulk_overlap_lse_lean", (128, True, True)), ("bulk_overlap_lse_lean", (64, False, False))] + [
    # SCHED 2 (dQ issued before the dV wait): its register peak moves, so all four dQ-split /
    # dtype / mask corners; TILE_ORDER 2 only decodes blockIdx.x differently: one each.
    ("bulk_dqfirst_lse", s) for s in SPECS] + [
    ("bulk_overlap_lse_l2lpt", (128, True, True)), ("bulk_dqfirst_lse_l2lpt", (128, False, False)),
    ("bulk_overlap_lse_lean_l2lpt", (128, False, False)),
    ("bulk_overlap_lse_lean_issue_pf32_epi_l2lpt", (128, True, True))] + [
    # ISSUE (uniform descriptors, stmatrix dS stores): its registers move, so all four corners
    ("bulk_overlap_lse_lean_issue", s) for s in SPECS] + [
    ("bulk_dqfirst_lse_lean_issue", (128, True, True)), ("bulk_dqfirst_lse_lean_issue", (128, False, False))] + [
    # EPILOGUE (dK / dV staged through the dQ slots): both head dims (the staged row is D * 2 bytes)
    ("bulk_overlap_lse_lean_issue_epi", (128, True, True)), ("bulk_overlap_lse_lean_issue_epi", (64, False, False))] + [
    # ISSUE 2 keeps the f32 P through the dV GEMM: the register peak moves, all four corners
    ("bulk_overlap_lse_lean_issue_pf32_epi", s) for s in SPECS] + [
    # CARRY keeps dK and its dS^T registers in flight across the loop's back edge: all four corners
    ("bulk_overlap_lse_lean_issue_pf32_epi_carry", s) for s in SPECS] + [
    # DV_LATE moves dV's issue (and P^T's 16-bit registers' lifetime) past the dS pass: all four corners
    ("bulk_overlap_lse_lean_issue_pf32_epi_carry_dvlate", s) for s in SPECS] + [
    # DQ_WRITER adds a writer warp under the producer warpgroup's 24 registers: all four corners
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw", s) for s in SPECS] + [
    # ROWS_EARLY moves 16 LSE registers' birth above the S / dP GEMMs' issue: all four corners
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early", s) for s in SPECS] + [
    # ... and with CARRY's loop-carried dK (ptxas must not inject a wgmma wait: C7517 above)
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_carry", s) for s in SPECS] + [
    # M_ROTATE changes full attention's loops only (causal builds are _dqw_early's): the full corners
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_rot", s) for s in ((128, False, False), (64, False, True))] + [
    # SCHED 2 on the default: dQ's 32 accumulators taken while P^T's registers still feed dV (all four corners)
    ("bulk_dqfirst_lse_lean_issue_pf32_epi_dqw_early", s) for s in SPECS] + [
    ("bulk_dqfirst_lse_lean_issue_pf32_epi_dqw_early_l2lpt", (128, True, True))] + [
    # M_ROTATE 2 (grouped rotation): its full corners, as _rot
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_rot2", s) for s in ((128, False, False), (64, False, True))] + [
    # TILE_ORDER 2 on the default body: only blockIdx.x's decode differs (its causal corners: where it matters)
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt", s) for s in ((128, True, True), (64, True, False))] + [
    # TILE_M80 (session 16): built for full attention at D = 128 only, both dtypes (bf16 is its register peak)
    (o, s) for o in hb.M80_OPTIONS for s in ((128, False, False), (128, False, True))] + [
    # ... and its 64-row twin (ISSUE 1 under the writer warp and early rows): the four corners
    ("bulk_overlap_lse_lean_issue_epi_dqw_early", s) for s in SPECS] + [
    # DESC64 (session 16): ISSUE's descriptors by a 64-bit add (uniform registers move): the default's and the causal
    # default's four corners
    (o, s) for o in ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_u64",
                     "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_u64") for s in SPECS] + [
    # M_ROTATE 3 (session 17, descending sweep): the producer's loop and the consumers' tile per step move; both causal
    # corners on CAUSAL_OPTION's order, the full D 128 one on TILE_ORDER 0's
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_desc", s) for s in ((128, True, True), (64, True, False))] + [
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_desc", (128, False, False))] + [
    # TILE_ORDER 3 (session 17): TILE_ORDER 2's decode from a linearised 3-D grid: its causal corner and a full one
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt3", s) for s in ((128, True, True), (128, False, False))] + [
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_grid1", s) for s in ((128, True, True), (128, False, False))] + [
    # TILE_ORDER 5 (session 17, bwdc17): TILE_ORDER 2's order from a 3-D grid without a division
    ("bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_zsec", s) for s in ((128, True, True), (64, True, False))]
MARKER = re.compile(r"^\s*// @cuir-(region|end) (\w+)\s*$")


def test_region_markers_present_and_balanced():
    open_regions, seen = [], []
    for lineno, line in enumerate(hb.KERNEL_SOURCE.read_text().splitlines(), 1):
        if "@cuir-" not in line or "Lifting map" in line:
            continue
        m = MARKER.match(line)
        assert m, f"kernel.cu:{lineno}: malformed marker {line.strip()!r}"
        kind, name = m.groups()
        if kind == "region":
            assert not open_regions and name not in seen, f"kernel.cu:{lineno}: {name} nested or repeated"
            open_regions.append(name)
            seen.append(name)
        else:
            assert open_regions and open_regions[-1] == name, f"kernel.cu:{lineno}: stray end {name}"
            open_regions.pop()
    assert not open_regions and sorted(seen) == sorted(REGIONS), f"regions {seen}, expected {REGIONS}"


def _compile(option_spec, tmp_path):
    option, (d, causal, bf16) = option_spec
    out = tmp_path / f"{option}_d{d}c{int(causal)}b{int(bf16)}.cubin"
    proc = subprocess.run([shutil.which("nvcc"), "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                           *hb.options(d, causal, bf16, option), "-Xptxas", "-v", "-o", str(out),
                           str(hb.KERNEL_SOURCE)], capture_output=True, text=True)
    return option_spec, proc


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
@pytest.mark.parametrize("option", sorted(set(hb.OPTIONS) - set(hb.VARIANT_ONLY_OPTIONS)))
def test_specialisations_compile_spill_free(option, tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _compile(s, tmp_path), [x for x in OPTION_SPECS if x[0] == option]))
    assert results, f"no specialisation listed for option {option}"
    for spec, proc in results:
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{spec}: nvcc failed\n{log[-3000:]}"
        # two entries (the backward and the tiled dQ convert): every one spill-free
        assert log.count("0 bytes spill stores, 0 bytes spill loads") == log.count("spill stores"), f"{spec}: spills\n{log}"
        assert "0 bytes spill stores, 0 bytes spill loads" in log, f"{spec}: no ptxas report\n{log}"
        assert log.count("bytes stack frame") == log.count("0 bytes stack frame"), f"{spec}: stack frame\n{log}"
        # setmaxnreg ignored / wgmma serialized / a wgmma wait injected by ptxas (CARRY's loop-carried dK)
        for warning in ("C7508", "C7510", "C7515", "C7517", "serializ"):
            assert warning not in log, f"{spec}: ptxas warning {warning}\n{log}"


def test_option_table_matches_the_kernel_macros():
    """Every option maps to macros the kernel accepts; SCHED 1 only with DQ_MODE 1, LSE_SMEM 1 only
    with SCHED 1 (static_asserts)."""
    assert hb.OPTIONS["base"] == (0,) * 16 and hb.DEFAULT_OPTION in hb.OPTIONS
    for name, m in hb.OPTIONS.items():
        opts = hb.options(128, True, True, name)
        assert f"-DDQ_MODE={m.dq_mode}" in opts and f"-DSCHED={m.sched}" in opts and f"-DLSE_SMEM={m.lse_smem}" in opts
        assert f"-DTILE_ORDER={m.tile_order}" in opts and f"-DARRIVE_ALL={m.arrive_all}" in opts
        assert f"-DLEAN={m.lean}" in opts and f"-DISSUE={m.issue}" in opts and f"-DEPILOGUE={m.epilogue}" in opts
        assert f"-DCARRY={m.carry}" in opts and not (m.carry and m.sched != 1), name
        assert f"-DDV_LATE={m.dv_late}" in opts and not (m.dv_late and (m.sched != 1 or m.issue != 2)), name
        assert f"-DDQ_WRITER={m.dq_writer}" in opts and not (m.dq_writer and (m.sched == 0 or m.dq_mode != 1)), name
        assert f"-DROWS_EARLY={m.rows_early}" in opts and not (m.rows_early and (m.sched == 0 or not m.issue)), name
        assert f"-DM_ROTATE={m.m_rotate}" in opts and not (m.m_rotate and (m.sched != 1 or not m.issue)), name
        assert m.sched in (0, 1, 2) and m.tile_order in (0, 2, 3, 4, 5) and m.arrive_all in (0, 1), name
        assert not (m.sched >= 1 and m.dq_mode == 0) and not (m.lse_smem == 1 and m.sched == 0), name
        assert not (m.lean and not m.lse_smem) and not (m.issue and not m.lse_smem), name
        assert not (m.epilogue and not m.dq_mode) and m.issue in (0, 1, 2), name
    with pytest.raises(LaunchError, match="unknown option"):
        hb.options(128, True, True, "fast")
    # PERSIST: the variant options' body (TILE_ORDER 2, LEAN, EPILOGUE, no writer warp; params.cuh static_assert)
    for name in hb.VARIANT_ONLY_OPTIONS:
        m = hb.OPTIONS[name]
        assert m.persist == 1 and m.tile_order == 2 and m.lean and m.epilogue and not (m.dq_writer or m.carry), name
        assert "-DPERSIST=1" in hb.options(128, False, True, name) and name in hb.VARIANT_OPTIONS
        assert hb.smem_bytes(128, name) == hb.smem_bytes(128, hb.VARIANT_OPTION) + 24   # its three mbarriers


def test_variant_only_option_refuses_the_dense_source():
    with pytest.raises(LaunchError, match="lowered variant only"):
        hb.build_cubin(128, True, True, option=hb.VARIANT_ONLY_OPTIONS[0])


def test_variant_option_and_persist_ctas_from_the_environment(monkeypatch):
    monkeypatch.delenv(hb.VARIANT_OPTION_ENV, raising=False)
    assert hb.variant_option() == hb.VARIANT_OPTION
    monkeypatch.setenv(hb.VARIANT_OPTION_ENV, hb.VARIANT_ONLY_OPTIONS[0])
    assert hb.variant_option() == hb.VARIANT_ONLY_OPTIONS[0]
    monkeypatch.setenv(hb.VARIANT_OPTION_ENV, "bulk")   # an option without the variant hooks
    with pytest.raises(LaunchError, match="not a variant option"):
        hb.variant_option()
    monkeypatch.setenv(hb.PERSIST_CTAS_ENV, "3")
    assert hb.persist_ctas(0) == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(hb.PERSIST_CTAS_ENV, bad)
        with pytest.raises(LaunchError, match="positive integer"):
            hb.persist_ctas(0)


def test_variant_options_carry_the_hooks():
    """A lowered variant builds only on the SCHED 1 / LSE_SMEM 1 path (kernel.cu static_assert);
    ARRIVE_ALL changes only who arrives on q_empty and TILE_ORDER only which CTA takes which tile,
    so both settings of each qualify."""
    assert hb.VARIANT_OPTION in hb.VARIANT_OPTIONS
    for name in hb.VARIANT_OPTIONS:
        assert hb.OPTIONS[name][:3] == (1, 1, 1) and hb.OPTIONS[name].tile_order in (0, 2), name
    assert {hb.OPTIONS[n].arrive_all for n in hb.VARIANT_OPTIONS} == {0, 1}
    # the defaults release stages from every thread: racecheck clean (session 10, H100: 0 hazards on the
    # dense and the variant path; bulk_overlap_lse's lane-0 release drew 10240 reports)
    assert hb.OPTIONS[hb.DEFAULT_OPTION].arrive_all == 1 and hb.OPTIONS[hb.VARIANT_OPTION].arrive_all == 1
    # session 12: the default is ISSUE 2 + EPILOGUE (session 11 H100: faster than lean on all four
    # dense shapes, every test_bwd_sm90 case, racecheck 0 hazards), and variants build on the same body
    pf32 = "bulk_overlap_lse_lean_issue_pf32_epi"
    assert hb.OPTIONS[pf32] == hb.OPTIONS["bulk_overlap_lse_lean"]._replace(issue=2, epilogue=1)
    # session 13: variants run that body in TILE_ORDER 2's order (H100 8k: 1.030-1.058x on six variants)
    l2lpt = "bulk_overlap_lse_lean_issue_pf32_epi_l2lpt"
    assert hb.OPTIONS[l2lpt] == hb.OPTIONS[pf32]._replace(tile_order=2) and l2lpt in hb.VARIANT_OPTIONS
    # session 15: ... the dense default's body (writer warp, early rows) in that order (H100 8k: 0.996-1.125x l2lpt)
    # session 17: its _u64 twin (64-bit descriptor arithmetic)
    assert hb.VARIANT_OPTION == "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt_u64"
    assert hb.OPTIONS[hb.VARIANT_OPTION] == hb.OPTIONS[l2lpt]._replace(dq_writer=1, rows_early=2, desc64=1)
    # session 14: the dense default adds the dQ writer warp (H100: +0.8-5.2% in two runs, its 95 rule tests,
    # synccheck and racecheck clean); (session 15: the variants too, VARIANT_OPTION)
    # and (mid call) ROWS_EARLY 2, the LSE / Dvec loads ahead of the GEMMs (H100 TFLOPS causal / full 8k, causal /
    # full 16k: 586 / 650 / 619 / 634 vs _dqw's 556 / 573 / 597 / 564; dK / dV bitwise pf32_epi's)
    assert hb.DEFAULT_OPTION == "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early"
    assert hb.OPTIONS[hb.DEFAULT_OPTION] == hb.OPTIONS[pf32]._replace(dq_writer=1, rows_early=2)
    early = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early"   # session 15: its body in TILE_ORDER 2's order
    # session 15 mid call (GQA causal 8k +9.8% / +6.1% at the default split, MHA causal 8k +2.8%): causal runs it
    assert hb.CAUSAL_OPTION == early + "_l2lpt" and hb.CAUSAL_OPTION not in hb.VARIANT_ONLY_OPTIONS
    assert hb.default_option(True) == hb.CAUSAL_OPTION and hb.default_option(False) == hb.DEFAULT_OPTION
    assert hb.OPTIONS[early + "_l2lpt"] == hb.OPTIONS[early]._replace(tile_order=2)
    assert hb.OPTIONS[early + "_rot2"] == hb.OPTIONS[early]._replace(m_rotate=2)
    assert hb.OPTIONS[early.replace("overlap", "dqfirst")] == hb.OPTIONS[early]._replace(sched=2)
    assert hb.OPTIONS[early.replace("overlap", "dqfirst") + "_l2lpt"] == hb.OPTIONS[early]._replace(sched=2, tile_order=2)
    assert hb.DEFAULT_OPTION not in hb.VARIANT_OPTIONS
    assert hb.OPTIONS["bulk_overlap_lse_arriveall"] == hb.OPTIONS["bulk_overlap_lse"]._replace(arrive_all=1)
    assert hb.OPTIONS["bulk_overlap_lse_lean"] == hb.OPTIONS["bulk_overlap_lse_arriveall"]._replace(lean=1)
    for name in ("bulk_overlap_lse_arriveall", "bulk_overlap_lse_lean"):
        assert hb.smem_bytes(128, name) == hb.smem_bytes(128, "bulk_overlap_lse")
    with pytest.raises(LaunchError, match="variant hooks"):
        hb.build_cubin(128, False, True, option="bulk_dqfirst_lse", source="// a lowered source")
    with pytest.raises(LaunchError, match="unknown option"):
        hb.build_cubin(128, False, True, option="bulk_overlap_lse_lpt")   # removed in session 10


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_lean_needs_the_padded_row_terms(tmp_path):
    """LEAN's preprocess writes LSE_SMEM's padded copies: LEAN=1 without LSE_SMEM=1 is refused at
    compile time by name (params.cuh static_assert), and only LEAN builds carry the preprocess."""
    opts = [o.replace("-DLSE_SMEM=1", "-DLSE_SMEM=0").replace("-DSCHED=1", "-DSCHED=0")
            for o in hb.options(64, False, True, "bulk_overlap_lse_lean") if not o.startswith("-DHOST_SMEM")]
    proc = subprocess.run([shutil.which("nvcc"), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", *opts,
                           "-o", str(tmp_path / "x.cubin"), str(hb.KERNEL_SOURCE)], capture_output=True, text=True)
    assert proc.returncode != 0 and "LEAN=1 needs LSE_SMEM=1" in proc.stderr, proc.stderr[-2000:]
    text = hb.KERNEL_SOURCE.read_text()
    start = text.index("fa3_bwd_preprocess(")
    assert text.rfind("#if LEAN", 0, start) > text.rfind("#endif", 0, start), "the preprocess is built with LEAN only"
    assert hb._modes("bulk_overlap_lse_lean").lean and not hb._modes("bulk_overlap_lse").lean


def test_shared_memory_mirrors_params():
    """K + V + 2 x (Q, dO) + 2 dS^T slots + 5 barriers + alignment slack; under 227 KB at D = 128."""
    assert hb.smem_bytes(128, "base") == 2 * 32768 + 4 * 16384 + 2 * 16384 + 40 + 1024
    assert hb.smem_bytes(64, "base") == 2 * 16384 + 4 * 8192 + 2 * 16384 + 40 + 1024
    assert hb.smem_bytes(128, "base") <= 227 * 1024
    assert f"-DHOST_SMEM_BYTES={hb.smem_bytes(64, 'base')}" in hb.options(64, False, True, "base")
    # DQ_MODE 1: two slots x two consumers x one 64 x 64 f32 part
    for option in ("bulk", "bulk_overlap"):
        assert hb.smem_bytes(128, option) == hb.smem_bytes(128, "base") + 2 * 2 * 16384 <= 227 * 1024
    # LSE_SMEM 1: + 2 stages x (LSE, Dvec) x 64 floats
    assert hb.smem_bytes(128, "bulk_overlap_lse") == hb.smem_bytes(128, "bulk") + 2 * 2 * 256 <= 227 * 1024
    for option in hb.OPTIONS:
        assert f"-DHOST_SMEM_BYTES={hb.smem_bytes(64, option)}" in hb.options(64, False, True, option)


def _decode(idx: int, num_n: int, pairs: int, section: int, heads_kv: int) -> tuple[int, int, int]:
    """kernel.cu tile_coord for TILE_ORDER 2, line for line: blockIdx.x -> (tile, kv head, batch)."""
    per_section = section * num_n
    s, r = divmod(idx, per_section)
    width = min(section, pairs - s * section)
    n, within = divmod(r, width)
    hb = s * section + within
    return n, hb % heads_kv, hb // heads_kv


@pytest.mark.parametrize("batch,heads_kv,tiles", [(1, 1, 1), (2, 32, 64), (3, 5, 7), (1, 32, 128)])
@pytest.mark.parametrize("section", [1, 2, 4, 8, 64])
def test_l2_sections_cover_every_tile_once(batch, heads_kv, tiles, section):
    """TILE_ORDER 2's decode is a bijection onto (tile, kv head, batch), a narrower last section
    included; inside a section the tile is the slow index (causal: the longest tiles first)."""
    pairs = batch * heads_kv
    got = [_decode(i, tiles, pairs, section, heads_kv) for i in range(tiles * pairs)]
    assert sorted(got) == sorted((n, h, b) for n in range(tiles) for h in range(heads_kv) for b in range(batch))
    first = got[:min(section, pairs)]
    assert all(n == 0 for n, _, _ in first), first
    assert hb._grid("bulk_overlap_lse_l2lpt", tiles, heads_kv, batch) == (tiles * pairs, 1, 1)


def test_l2_section_width():
    """Sections hold as many (batch, kv head) pairs as fit L2 (power of two), never more than
    there are, at least one; full attention keeps TILE_ORDER 0's order (width 1)."""
    l2 = 50 << 20   # H100
    # bf16 D = 128: 8k queries are 8 MB per head (Q, dO 4 MB, fp32 dQ 4 MB): 6 fit -> 4
    assert hb.tile_sections(64, 1, 8192, 128, True, l2) == 4
    assert hb.tile_sections(32, 1, 16384, 128, True, l2) == 2
    assert hb.tile_sections(8, 4, 16384, 128, True, l2) == 1          # a GQA group of 4: 64 MB
    assert hb.tile_sections(3, 1, 300, 64, True, l2) == 3              # capped by the pairs there are
    assert hb.tile_sections(8, 1, 8192, 128, True, 1 << 20) == 1       # one head over budget: still 1
    assert hb.tile_sections(64, 1, 8192, 128, False, l2) == 1
    assert hb._grid("bulk_overlap_lse", 64, 32, 2) == (64, 32, 2)


def test_padded_row_terms_for_lse_smem():
    """LSE_SMEM 1's copies: log2 LSE, +inf for rows that saw no key and for padding (P = 0 there),
    Dvec zero-padded; one 64-float tile per (head, query tile)."""
    lse = torch.tensor([[[0.5, -math.inf, 2.0]], [[1.0, 3.0, -1.0]]])       # [B=2, Hq=1, Nq=3]
    dvec = torch.tensor([[[0.1, 0.2, 0.3]], [[0.4, 0.5, 0.6]]])
    lse2, dvec_pad = hb._padded_row_terms(lse, dvec, 2, 3, 1)
    assert lse2.shape == dvec_pad.shape == (2, 64)
    torch.testing.assert_close(lse2[0, :3], torch.tensor([0.5 * hb.LOG2E, math.inf, 2.0 * hb.LOG2E]))
    torch.testing.assert_close(lse2[1, :3], torch.tensor([1.0, 3.0, -1.0]) * hb.LOG2E)
    assert bool((lse2[:, 3:] == math.inf).all()) and bool((dvec_pad[:, 3:] == 0).all())
    assert torch.equal(dvec_pad[:, :3], dvec.reshape(2, 3))


def test_aligned_dvec_is_already_padded():
    """With Nq a multiple of 64 fa3_backward hands the kernel Dvec [B, Hq, Nq] itself: its memory is
    exactly the padded [B * Hq, num_m * 64] copy's."""
    dvec = torch.randn(2, 3, 128)
    padded = hb._padded_dvec(dvec, 6, 128, 2)
    assert padded.shape == (6, 128) and torch.equal(padded.flatten(), dvec.flatten())


def test_bad_input_is_a_clear_error():
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(LaunchError, match="cuda|CUDA"):
        hb.fa3_backward(q, q, q, q, q, lse)
    with pytest.raises(LaunchError, match="head dim"):
        hb.build_cubin(96, False, True)


def test_autograd_takes_the_hopper_backward_unless_switched_off(monkeypatch):
    from cubridge.errors import LaunchError
    from cubridge.runtime import autograd
    q = torch.randn(1, 2, 8, 64)
    monkeypatch.delenv(hb.ENABLE_ENV, raising=False)
    assert hb.enabled()                                                 # the default since session 9
    assert not autograd.hopper_backward_used(q, deterministic=False)   # a CPU tensor: never
    monkeypatch.setenv(hb.ENABLE_ENV, "0")
    assert not hb.enabled()
    monkeypatch.setenv(hb.ENABLE_ENV, "yes")
    with pytest.raises(LaunchError, match="CUBRIDGE_HOPPER_BWD='yes' is neither 0 nor 1"):
        hb.enabled()


def test_tile_m80_option():
    """TILE_M80 (session 16): its macro only in its own options' flags (the others' compile keys unchanged), 80-row
    tiles with one dQ slot under 227 KB, and the option resolved to default_option(causal) where the tile does not
    apply (causal, D = 64), for the build as for the call."""
    assert hb.M80_OPTIONS and hb.DEFAULT_OPTION not in hb.M80_OPTIONS
    for name in hb.OPTIONS:
        flags = hb.options(128, False, True, name)
        assert ("-DTILE_M80=1" in flags) == (name in hb.M80_OPTIONS) and "-DTILE_M80=0" not in flags, name
        assert ("-DDESC64=1" in flags) == name.endswith("_u64") and "-DDESC64=0" not in flags, name
        if name.endswith("_u64"):   # DESC64 on an option that exists without it
            assert hb.OPTIONS[name] == hb.OPTIONS[name[:-4]]._replace(desc64=1), name
    for name in hb.M80_OPTIONS:
        m = hb.OPTIONS[name]
        assert m.lean and m.lse_smem and m.sched == 1 and m.issue == 1 and not (m.carry or m.dv_late or m.m_rotate)
        assert hb.block_m(name) == 80 and hb.block_m(hb.DEFAULT_OPTION) == 64
        # K + V, 2 x (Q, dO) and 2 dS slots of 80 rows, one dQ slot (2 x 80 x 64 floats), 2 x 2 x 80 row terms
        assert hb.smem_bytes(128, name) == 2 * 32768 + 4 * 20480 + 2 * 20480 + 2 * 20480 + 4 * 320 + 40 + 1024
        assert hb.smem_bytes(128, name) <= 227 * 1024
        assert hb.resolve_option(name, 128, False) == name
        assert hb.resolve_option(name, 128, True) == hb.default_option(True)
        assert hb.resolve_option(name, 64, False) == hb.default_option(False)
        assert hb.resolve_option(hb.DEFAULT_OPTION, 128, False) == hb.DEFAULT_OPTION
        assert hb.OPTIONS[name] == hb.OPTIONS["bulk_overlap_lse_lean_issue_epi_dqw_early"]._replace(
            tile_m80=1, desc64=hb.OPTIONS[name].desc64)
    assert hb.default_option(False) == hb.FULL_OPTION and hb.default_option(True) == hb.CAUSAL_OPTION


def test_full_option_from_the_environment(monkeypatch):
    """CUBRIDGE_BWD_FULL_OPTION (session 16): full attention's default option for an A/B of a flip; causal keeps
    CAUSAL_OPTION; a variant-only or unknown name is a clear error."""
    monkeypatch.delenv(hb.FULL_OPTION_ENV, raising=False)
    assert hb.default_option(False) == hb.FULL_OPTION
    monkeypatch.setenv(hb.FULL_OPTION_ENV, hb.M80_OPTIONS[0])
    assert hb.default_option(False) == hb.M80_OPTIONS[0] and hb.default_option(True) == hb.CAUSAL_OPTION
    assert hb.resolve_option(hb.default_option(False), 64, False) == hb.DEFAULT_OPTION
    for bad in ("fast", hb.VARIANT_ONLY_OPTIONS[0]):
        monkeypatch.setenv(hb.FULL_OPTION_ENV, bad)
        with pytest.raises(LaunchError, match="not a dense option"):
            hb.default_option(False)


def test_causal_option_from_the_environment(monkeypatch):
    """CUBRIDGE_BWD_CAUSAL_OPTION (session 17): causal attention's default option for the tests of a flip; full keeps
    full_option(); unknown, variant-only and TILE_M80 (full-only) names are clear errors."""
    monkeypatch.delenv(hb.CAUSAL_OPTION_ENV, raising=False)
    monkeypatch.delenv(hb.FULL_OPTION_ENV, raising=False)
    assert hb.default_option(True) == hb.CAUSAL_OPTION
    desc = hb.CAUSAL_OPTION + "_desc"
    monkeypatch.setenv(hb.CAUSAL_OPTION_ENV, desc)
    assert hb.default_option(True) == desc and hb.default_option(False) == hb.FULL_OPTION
    assert hb.OPTIONS[desc] == hb.OPTIONS[hb.CAUSAL_OPTION]._replace(m_rotate=3)
    assert "-DM_ROTATE=3" in hb.options(128, True, True, desc)
    assert hb._grid(hb.CAUSAL_OPTION + "3", 64, 32, 2) == (64, 32, 2) and hb._grid(hb.CAUSAL_OPTION, 64, 32, 2) == (
        4096, 1, 1) and hb.OPTIONS[hb.CAUSAL_OPTION + "3"] == hb.OPTIONS[hb.CAUSAL_OPTION]._replace(tile_order=3)
    assert hb._grid(hb.DEFAULT_OPTION + "_grid1", 64, 32, 2) == (4096, 1, 1)
    for bad in ("fast", hb.VARIANT_ONLY_OPTIONS[0], hb.M80_OPTIONS[0]):
        monkeypatch.setenv(hb.CAUSAL_OPTION_ENV, bad)
        with pytest.raises(LaunchError, match="not a dense causal option"):
            hb.default_option(True)
