"""Races among the warps of one role (issue 20, item 2): the interpreter runs a role's warps as one
thread of control, so it tracks what only sync() orders among them and reports, with the line, a
read of cp.async data other warps copied before a sync(), and an async refill of a slot the role
read since its last sync()."""
from __future__ import annotations

from cubridge.cuir.parser import parse
from cubridge.paths import ref_kernel_dir
from cubridge.spec import load_spec
from cubridge.verify import Case, verify_program

FA2 = (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text()
FA3 = (ref_kernel_dir("fa3_sm90") / "kernel.cuir").read_text()
CASES = [Case(1, 2, 1, 200, 200, 16, 0)]
WAIT_SYNC = "            wait_group(STAGES - 2)\n            sync()\n"
REFILL = "copy_async(Ks[(it + STAGES - 1) % STAGES], K[b, hk, nxt * BLOCK_N:nxt * BLOCK_N + BLOCK_N, :])"


def error_of(text):
    rep = verify_program(parse(text), load_spec("causal"), cases=CASES)
    assert not rep.passed
    return rep.first_failure.error


def line_of(text, needle):
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


def test_reference_programs_have_no_race():
    for text in (FA2, FA3):
        assert verify_program(parse(text), load_spec("causal"), cases=CASES).passed


def test_fa2_without_the_sync_before_the_ring_refill_is_rejected():
    text = FA2.replace(WAIT_SYNC, "            wait_group(STAGES - 2)\n")
    err = error_of(text)
    assert err.startswith(f"<cuir>:{line_of(text, 's = mma(Qs, transpose(Ks[st]))')}: race in compute[0] (4 warps)")
    assert "no sync() after its wait_group" in err


def test_a_refill_of_the_slot_just_read_is_a_race():
    # Slot st was read by this iteration's mma; refilling it before a sync() races slower warps.
    text = FA2.replace(REFILL, REFILL.replace("Ks[(it + STAGES - 1) % STAGES]", "Ks[st]"))
    err = error_of(text)
    assert err.startswith(f"<cuir>:{line_of(text, 'copy_async(Ks[st]')}: race in compute[0] (4 warps): "
                          "copy_async into Ks[") and "while other warps may still read it" in err
    assert f"read at line {line_of(text, 's = mma(Qs, transpose(Ks[st]))')}" in err


def test_one_warp_roles_need_no_sync():
    text = FA2.replace('with role("compute", warps=WARPS):', 'with role("compute", warps=1):')
    text = text.replace(WAIT_SYNC, "            wait_group(STAGES - 2)\n")
    assert verify_program(parse(text), load_spec("causal"), cases=CASES, static_check=False).passed
