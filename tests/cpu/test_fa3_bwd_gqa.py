"""CPU checks of the Hopper backward's GQA split (cubridge.runtime.fa3_bwd_gqa, kernel.cu GQA_SPLIT):
the split a launch takes (argument, CUBRIDGE_BWD_GQA_SPLIT, clipped to the group), clear errors for
bad requests, the default build's macros untouched, and dense / lowered-variant builds at several
splits compile for sm_90a spill-free with the dK / dV sum kernel. The numbers are tests/gpu/test_bwd_gqa.py's."""
from __future__ import annotations

import shutil

import pytest

from cubridge.errors import LaunchError
from cubridge.runtime import fa3_bwd_gqa as gqa
from cubridge.runtime import fa3_bwd_sm90 as hb
from support import sm90_builds


def test_requested_split_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv(gqa.SPLIT_ENV, raising=False)
    assert gqa.requested() == 1 and gqa.requested(4) == 4 and gqa.requested("group") == 16
    monkeypatch.setenv(gqa.SPLIT_ENV, "2")
    assert gqa.requested() == 2 and gqa.requested(1) == 1   # the argument wins
    monkeypatch.setenv(gqa.SPLIT_ENV, "3")
    with pytest.raises(LaunchError, match="CUBRIDGE_BWD_GQA_SPLIT: 3 is not a supported split"):
        gqa.requested()
    monkeypatch.setenv(gqa.SPLIT_ENV, "half")
    with pytest.raises(LaunchError, match="not a number or 'group'"):
        gqa.requested()
    with pytest.raises(LaunchError, match="gqa_split: 32 is not"):
        gqa.requested(32)


def test_default_split_is_dense_causal_only(monkeypatch):
    monkeypatch.delenv(gqa.SPLIT_ENV, raising=False)
    assert gqa.default_split(True, False) == gqa.DENSE_CAUSAL_SPLIT == 2
    assert gqa.default_split(False, False) == 1 and gqa.default_split(True, True) == 1
    assert gqa.requested(None, 2) == 2 and gqa.requested(1, 2) == 1
    monkeypatch.setenv(gqa.SPLIT_ENV, "1")
    assert gqa.requested(None, 2) == 1   # the environment switches the default off


@pytest.mark.parametrize("request_,group,want", [(1, 4, 1), (2, 4, 2), (4, 4, 4), (16, 4, 4), (16, 8, 8), (4, 1, 1),
                                                 (4, 6, 2), (8, 3, 1), (16, 32, 16)])
def test_effective_split_divides_the_group(request_, group, want):
    s = gqa.effective(request_, group)
    assert s == want and group % s == 0 and s & (s - 1) == 0


def test_default_macros_unchanged_and_split_macro_added():
    base = hb.options(128, True, True)
    assert not any("GQA_SPLIT" in o for o in base), "split 1 must keep the default build's key"
    assert hb.options(128, True, True, gqa_split=1) == base
    assert hb.options(128, True, True, gqa_split=4) == [*base[:-3], "-DGQA_SPLIT=4", *base[-3:]]


def test_split_needs_the_staged_epilogue():
    with pytest.raises(LaunchError, match="gqa_split=2 with option 'bulk_overlap_lse_lean'"):
        hb.build_cubin(128, True, True, option="bulk_overlap_lse_lean", gqa_split=2)


def test_sum_kernel_refuses_strides_it_cannot_store():
    import torch
    t = torch.empty(2, 4, 16, 130)[..., :128]   # rows of 130 elements: not a multiple of 4
    with pytest.raises(LaunchError, match="dk: strides"):
        gqa._strides("dk", t)
    assert gqa._strides("dv", torch.empty(2, 16, 4, 128).transpose(1, 2)) == (8192, 128, 512)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (needs the CUDA toolkit, no GPU)")
def test_split_builds_compile_spill_free(tmp_path):
    from cubridge.runtime.variant_bwd import VariantBackward
    dense = hb.KERNEL_SOURCE.read_text()
    prefix = VariantBackward("prefixlm").hopper.source
    jobs = [("dense_d128c_s2", dense, 128, True, True, hb.default_option(True), 2),
            ("dense_d64f_s16", dense, 64, False, False, hb.DEFAULT_OPTION, 16),
            ("prefixlm_d128_s4", prefix, 128, False, True, hb.VARIANT_OPTION, 4)]
    results = sm90_builds.build_all([(label, source, hb.options(d, causal, bf16, option, split))
                                     for label, source, d, causal, bf16, option, split in jobs], tmp_path)
    for label, proc in results:
        sm90_builds.assert_clean(label, proc, "fa3_bwd_dkdv_sum", reports=4)
