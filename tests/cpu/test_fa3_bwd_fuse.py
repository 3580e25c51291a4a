"""CPU checks of the fused dQ convert (kernel.cu DQ_FUSE, CUBRIDGE_BWD_FUSED_CONVERT=1; session 16): the switch (off
by default: compile options and cache keys as before it), which options can take it, and spill-free sm_90a builds of
every entry (count, preprocess, convert, backward) on the runs, the exact list, the dense kernel with GQA_SPLIT,
both head dims (the converter warps run under the producer warpgroup's 24 registers)."""
from __future__ import annotations

import shutil

import pytest

from cubridge.errors import LaunchError
from cubridge.runtime import fa3_bwd_sm90 as hb
from support import sm90_builds

DQW_EARLY = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early"


def test_fused_convert_switch(monkeypatch):
    monkeypatch.delenv(hb.FUSED_CONVERT_ENV, raising=False)
    assert not hb.fused_convert_enabled()
    assert not any("DQ_FUSE" in o for o in hb.options(128, False, True, hb.VARIANT_OPTION))
    assert "-DDQ_FUSE=1" in hb.options(128, False, True, hb.VARIANT_OPTION, fuse=True)
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "1")
    assert hb.fused_convert_enabled() == 1
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "2")
    assert hb.fused_convert_enabled() == 2 and "-DDQ_FUSE=2" in hb.options(128, False, True, hb.VARIANT_OPTION, fuse=2)
    monkeypatch.setenv(hb.FUSED_CONVERT_ENV, "on")
    with pytest.raises(LaunchError, match=hb.FUSED_CONVERT_ENV):
        hb.fused_convert_enabled()


def test_fuse_capable_options():
    assert hb.fuse_capable(hb.OPTIONS[DQW_EARLY]) and hb.fuse_capable(hb.OPTIONS[hb.VARIANT_OPTION])
    assert hb.fuse_capable(hb.OPTIONS[hb.CAUSAL_OPTION])
    for option in ("bulk_overlap_lse_lean_issue_pf32_epi", "bulk_overlap_lse_lean",
                   "bulk_overlap_lse_lean_issue_pf32_epi_l2lpt_persist", "bulk_overlap_lse_lean_issue_epi_dqw_early_m80"):
        assert not hb.fuse_capable(hb.OPTIONS[option]), option
    with pytest.raises(LaunchError, match="DQ_WRITER"):
        hb.build_cubin(128, False, True, option="bulk_overlap_lse_lean_issue_pf32_epi", fuse=True)
    with pytest.raises(LaunchError, match="bnhd"):
        hb.build_cubin(128, False, True, option=DQW_EARLY, fuse=True, bnhd=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_fused_builds_spill_free(tmp_path):
    from cubridge.lower.fa3_bwd_sm90 import lower_source
    from cubridge.runtime.variant_bwd import VariantBackward
    dense = hb.KERNEL_SOURCE.read_text()
    share, doc = VariantBackward("share_question"), VariantBackward("document")
    jobs = [("prefixlm", VariantBackward("prefixlm").hopper.source, 128, False, True, hb.VARIANT_OPTION, {}),
            ("share_question_list", lower_source(dense, share.ir, q_list=True), 128, False, True, hb.VARIANT_OPTION, {}),
            ("document_list", lower_source(dense, doc.ir, q_list=True), 64, False, False, hb.VARIANT_OPTION, {}),
            ("dense_causal_split2", dense, 128, True, True, hb.CAUSAL_OPTION, {"gqa_split": 2}),
            ("dense_full_d64", dense, 64, False, False, DQW_EARLY, {}),
            # DQ_FUSE 2 (per-CTA counts): the runs, the exact list, the dense kernel with GQA_SPLIT
            ("prefixlm_fuse2", VariantBackward("prefixlm").hopper.source, 128, False, True, hb.VARIANT_OPTION, {"fuse": 2}),
            ("share_question_list_fuse2", lower_source(dense, share.ir, q_list=True), 64, False, False,
             hb.VARIANT_OPTION, {"fuse": 2}),
            ("dense_causal_split2_fuse2", dense, 128, True, True, hb.CAUSAL_OPTION, {"gqa_split": 2, "fuse": 2})]
    results = sm90_builds.build_all([(name, src, hb.options(d, causal, bf16, option, **{"fuse": 1, **extra}))
                                     for name, src, d, causal, bf16, option, extra in jobs], tmp_path)
    for name, proc in results:
        sm90_builds.assert_clean(name, proc, "fa3_bwd_dq_count", min_reports=4)
