"""CuIR static checker: the reference programs pass and report their shared memory; broken
variants (made by text replacement of the .cuir files) fail with CuIRCheckError at the right line."""
from __future__ import annotations

import pytest

from cubridge.cuir.absval import SMEM_LIMIT
from cubridge.cuir.checker import check
from cubridge.cuir.parser import parse
from cubridge.errors import CuIRCheckError
from cubridge.paths import ref_kernel_dir

FA2 = (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text()
FA3 = (ref_kernel_dir("fa3_sm90") / "kernel.cuir").read_text()
TEXTS = {"fa2": FA2, "fa3": FA3}


def mutate(text: str, old: str, new: str) -> str:
    """Replace the one occurrence of old (so a test cannot silently test nothing)."""
    assert text.count(old) == 1, f"expected exactly one {old!r} in the program"
    return text.replace(old, new)


def drop_line(text: str, snippet: str) -> str:
    """Delete the one line containing snippet."""
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if snippet in ln]
    assert len(hits) == 1, f"expected exactly one line with {snippet!r}"
    del lines[hits[0]]
    return "".join(lines)


def insert_after(text: str, snippet: str, stmt: str) -> str:
    """Insert stmt as a new line after the one line containing snippet, at its indentation."""
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if snippet in ln]
    assert len(hits) == 1, f"expected exactly one line with {snippet!r}"
    ln = lines[hits[0]]
    lines.insert(hits[0] + 1, ln[: len(ln) - len(ln.lstrip())] + stmt + "\n")
    return "".join(lines)


def line_of(text: str, snippet: str) -> int:
    """1-based line of the single occurrence of snippet."""
    assert text.count(snippet) == 1, f"expected exactly one {snippet!r}"
    return text[: text.index(snippet)].count("\n") + 1


def check_fails(text, *, line, words, **kw):
    with pytest.raises(CuIRCheckError) as ei:
        check(parse(text, source="prog.cuir"), **kw)
    err = ei.value
    assert err.line == line, str(err)
    assert str(err).startswith(f"prog.cuir:{line}: ")
    for w in words:
        assert w in str(err), (w, str(err))
    return err


# ------------------------------------------------------------------ the reference programs pass
@pytest.mark.parametrize("name, D, smem, buffers", [
    ("fa2", 64, 49152, {"Qs": 128 * 64 * 2, "Ks": 2 * 64 * 64 * 2, "Vs": 2 * 64 * 64 * 2}),
    ("fa2", 128, 98304, {"Qs": 128 * 128 * 2, "Ks": 2 * 64 * 128 * 2, "Vs": 2 * 64 * 128 * 2}),
    # fa3: Q, a 2-stage ring of 128-row K and V tiles, and 11 mbarriers of 8 bytes.
    ("fa3", 64, 16384 + 2 * 32768 + 11 * 8, {"Qs": 16384, "Ks": 32768, "Vs": 32768}),
    ("fa3", 128, 32768 + 2 * 65536 + 11 * 8, {"Qs": 32768, "Ks": 65536, "Vs": 65536}),
])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_reference_programs_pass(name, D, smem, buffers, dtype):
    r = check(parse(TEXTS[name]), dims={"D": D}, dtype=dtype)
    assert r.smem_bytes == smem
    assert r.buffers == buffers
    if name == "fa2":
        assert r.roles == [("compute", 4, 1)]
        assert r.params == {"BLOCK_M": 128, "BLOCK_N": 64, "STAGES": 2, "WARPS": 4, "CAUSAL": 1}
    else:
        assert r.roles == [("producer", 4, 1), ("consumer", 4, 2)]


def test_fa2_d128_smem_is_98304():
    assert check(parse(FA2), dims={"D": 128}).smem_bytes == 98304


@pytest.mark.parametrize("name", ["fa2", "fa3"])
@pytest.mark.parametrize("causal", [0, 1])
def test_params_override(name, causal):
    r = check(parse(TEXTS[name]), params={"CAUSAL": causal, "STAGES": 3}, dims={"D": 64})
    assert r.params["CAUSAL"] == causal and r.params["STAGES"] == 3
    assert r.buffers["Ks"] == 3 * r.params["BLOCK_N"] * 64 * 2


# ------------------------------------------------------------------ shapes, dtypes, memory spaces
def test_copy_async_shape_mismatch():
    # destination tile [BLOCK_N, D], source slice of extent BLOCK_M
    old = "copy_async(Qs, Q[b, h, q0:q0 + BLOCK_M, :])"
    new = "copy_async(Ks[0], Q[b, h, q0:q0 + BLOCK_M, :])"
    text = mutate(FA2, old, new)
    check_fails(text, line=line_of(text, new), words=["copy_async()", "[128, 64]", "[64, 64]"])


def test_tma_load_shape_mismatch():
    old = "tma_load(Vs[st], V[b, hk, j * BLOCK_N:j * BLOCK_N + BLOCK_N, :], v_full[st])"
    new = "tma_load(Vs[st], V[b, hk, j * BLOCK_N:j * BLOCK_N + 64, :], v_full[st])"
    text = mutate(FA3, old, new)
    check_fails(text, line=line_of(text, new), words=["tma_load()", "[64, 64]", "[128, 64]"])


def test_mma_inner_dim_mismatch_missing_transpose():
    new = "s = mma(Qs, Ks[st])"
    text = mutate(FA2, "s = mma(Qs, transpose(Ks[st]))", new)
    check_fails(text, line=line_of(text, new), dims={"D": 128},
                words=["inner dims differ", "128x128", "64x128", "transpose(K_tile)"])


def test_mma_inner_dim_invisible_when_tiles_are_square():
    # D == BLOCK_N: Q K (no transpose) has matching shapes, so the checker cannot see it;
    # the interpreter and verification catch it (wrong numbers against the spec).
    from cubridge.spec import load_spec
    from cubridge.verify import Case, verify_program
    text = mutate(FA2, "s = mma(Qs, transpose(Ks[st]))", "s = mma(Qs, Ks[st])")
    check(parse(text), dims={"D": 64})                 # the checker cannot see it ...
    rep = verify_program(parse(text), load_spec("causal"), cases=[Case(1, 1, 1, 70, 70, 64, 0)])
    assert not rep.passed and "exceeds bound" in rep.first_failure.verdict.reason      # ... verification does


def test_mma_async_inner_dim_mismatch():
    old = "s = mma_async(Qs[wg * ROWS:wg * ROWS + ROWS, :], transpose(Ks[st]))"
    new = "s = mma_async(Qs[wg * ROWS:wg * ROWS + ROWS, :], Ks[st])"
    text = mutate(FA3, old, new)
    check_fails(text, line=line_of(text, new), words=["mma_async()", "inner dims differ", "64x64", "128x64"])


@pytest.mark.parametrize("name, old, new", [
    ("fa2", "acc = mma(cast(p, T), Vs[st], acc)", "acc = mma(p, Vs[st], acc)"),
    ("fa3", "\n                    acc = mma_async(cast(p, T), Vs[st_prev], acc)",
     "\n                    acc = mma_async(p, Vs[st_prev], acc)"),
])
def test_f32_mma_operand_missing_cast(name, old, new):
    text = mutate(TEXTS[name], old, new)
    check_fails(text, line=line_of(text, new.lstrip("\n")), words=["operand a is f32", "16-bit", "cast(x, T)"])


def test_mma_accumulator_must_be_f32_tile_of_result_shape():
    new = "acc = mma(cast(p, T), Vs[st], cast(acc, T))"
    text = mutate(FA2, "acc = mma(cast(p, T), Vs[st], acc)", new)
    check_fails(text, line=line_of(text, new), words=["accumulator must be an f32 [128, 64]"])


def test_mma_async_b_must_be_shared():
    new = "                    acc = mma_async(cast(p, T), cast(p, T), acc)"
    text = mutate(FA3, "                    acc = mma_async(cast(p, T), Vs[st_prev], acc)", new)
    check_fails(text, line=line_of(text, new), words=["operand b must be in shared memory"])


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_store_f32_into_T_output_without_cast(dtype):
    old = "store(O[b, h, q0:q0 + BLOCK_M, :], cast(out, T))"
    new = "store(O[b, h, q0:q0 + BLOCK_M, :], out)"
    text = mutate(FA2, old, new)
    check_fails(text, line=line_of(text, new), dtype=dtype,
                words=[f"value is f32 but the destination is {dtype}", "cast(x, T)"])


def test_store_into_input():
    old = "store(O[b, h, r0:r0 + ROWS, :], cast(out, T))"
    new = "store(Q[b, h, r0:r0 + ROWS, :], cast(out, T))"
    text = mutate(FA3, old, new)
    check_fails(text, line=line_of(text, new), words=["store into input Q", "global_output"])


def test_store_shape_mismatch():
    old = "store(LSE[b, h, q0:q0 + BLOCK_M], where(l_i == 0.0, -inf, m_i + log(l_i)))"
    new = "store(LSE[b, h, q0:q0 + BLOCK_N], where(l_i == 0.0, -inf, m_i + log(l_i)))"
    text = mutate(FA2, old, new)
    with pytest.raises(CuIRCheckError) as ei:
        check(parse(text))
    assert ei.value.line == line_of(text, new)


@pytest.mark.parametrize("new", ["s = Ks[st] * sm_scale", "s = s * sm_scale + Qs"])
def test_elementwise_on_shared_buffer(new):
    text = mutate(FA2, "s = s * sm_scale", new)
    check_fails(text, line=line_of(text, new), words=["elementwise", "shared-memory tile", "load(...)"])


def test_elementwise_on_global_tensor():
    new = "s = s * sm_scale + K[b, hk, k0:k0 + BLOCK_N, :]"
    text = mutate(FA2, "s = s * sm_scale", new)
    check_fails(text, line=line_of(text, new), words=["global memory", "load(...)"])


def test_broadcast_mismatch():
    new = "acc = acc * row_max(transpose(s))"
    text = mutate(FA2, "acc = acc * alpha", new)
    check_fails(text, line=line_of(text, new), words=["do not broadcast"])


@pytest.mark.parametrize("old, new", [
    ("copy_async(Qs, Q[b, h, q0:q0 + BLOCK_M, :])", "copy_async(Qs, Q[b, h, q0:NQ, :])"),
    ("copy_async(Qs, Q[b, h, q0:q0 + BLOCK_M, :])", "copy_async(Qs, Q[b, h, q0:q0 + NQ, :])"),
    ("copy_async(Qs, Q[b, h, q0:q0 + BLOCK_M, :])", "copy_async(Qs, Q[b, h, :, :])"),
])
def test_slice_without_compile_time_extent(old, new):
    text = mutate(FA2, old, new)
    err = check_fails(text, line=line_of(text, new), words=[])
    assert "compile-time extent" in str(err) or "run-time sized dim" in str(err)


def test_smem_index_out_of_range():
    new = "s = mma(Qs, transpose(Ks[2]))"
    text = mutate(FA2, "s = mma(Qs, transpose(Ks[st]))", new)
    check_fails(text, line=line_of(text, new), words=["index 2 out of range for Ks"])


def test_tma_load_needs_one_barrier():
    old = "tma_load(Ks[st], K[b, hk, j * BLOCK_N:j * BLOCK_N + BLOCK_N, :], k_full[st])"
    new = "tma_load(Ks[st], K[b, hk, j * BLOCK_N:j * BLOCK_N + BLOCK_N, :], k_full)"
    text = mutate(FA3, old, new)
    check_fails(text, line=line_of(text, new), words=["third argument must be one mbarrier"])


# ------------------------------------------------------------------ names
def test_name_used_before_definition():
    text = drop_line(FA2, "sm_scale = rsqrt(D)")
    check_fails(text, line=line_of(text, "s = s * sm_scale"), words=["name 'sm_scale' is not defined"])


def test_name_defined_later_is_still_undefined():
    text = drop_line(FA2, "sm_scale = rsqrt(D)")
    text = insert_after(text, "out = acc / where(l_i == 0.0, 1.0, l_i)", "sm_scale = rsqrt(D)")
    check_fails(text, line=line_of(text, "s = s * sm_scale"), words=["'sm_scale' is not defined"])


def test_names_are_per_role():
    # ROWS is the consumer's; the producer cannot use it.
    old = "tma_load(Qs, Q[b, h, q0:q0 + BLOCK_M, :], q_full)"
    new = "tma_load(Qs, Q[b, h, q0:q0 + ROWS * CONSUMERS, :], q_full)"
    text = mutate(FA3, old, new)
    check_fails(text, line=line_of(text, new), words=["'ROWS' is not defined"])


def test_if_branches_with_different_types():
    old = "s = where((ik <= iq if CAUSAL else ik >= 0) & (ik < NK), s, -inf)"
    text = mutate(FA2, old, f"s = cast({old[4:]}, T)")
    check_fails(text, line=line_of(text, "if partial:"), words=["'s' has different types after the two branches"])


# ------------------------------------------------------------------ waits and barriers
def test_fa2_missing_wait_group():
    text = drop_line(FA2, "wait_group(STAGES - 2)")
    check_fails(text, line=line_of(text, "s = mma(Qs, transpose(Ks[st]))"),
                words=["before waiting for the asynchronous copy", "wait_group(n)"])


@pytest.mark.parametrize("wait, reader", [
    ("wait(k_full[st], phase)", "s = mma_async(Qs[wg * ROWS:wg * ROWS + ROWS, :], transpose(Ks[st]))"),
    ("                    wait(v_full[st_prev], phase_prev)",
     "                    acc = mma_async(cast(p, T), Vs[st_prev], acc)"),
    ("wait(q_full, 0)", "s = mma_async(Qs[wg * ROWS:wg * ROWS + ROWS, :], transpose(Ks[st]))"),
])
def test_fa3_missing_full_wait(wait, reader):
    text = drop_line(FA3, wait)
    bar = wait.strip()[5:].split("[")[0].split(",")[0]
    check_fails(text, line=line_of(text, reader), words=["before waiting for the asynchronous copy", f"wait({bar}"])


def test_fa3_missing_empty_wait_is_caught_statically():
    text = drop_line(FA3, "wait(k_empty[st]")
    check_fails(text, line=line_of(text, "arrive(k_empty[st])"),
                words=["k_empty is arrived on but no role waits on it"])


def test_fa3_missing_arrive_is_caught_statically():
    text = drop_line(FA3, "arrive(k_empty[st])")
    check_fails(text, line=line_of(text, "wait(k_empty[st]"),
                words=["k_empty is waited on but nothing arrives on it"])


def test_barrier_waited_on_that_nothing_arrives_on():
    text = mutate(FA3, "k_empty = mbarrier(count=CONSUMERS, n=STAGES)\n",
                  "k_empty = mbarrier(count=CONSUMERS, n=STAGES)\nextra = mbarrier(count=1)\n")
    text = insert_after(text, "wait(q_full, 0)", "wait(extra, 0)")
    check_fails(text, line=line_of(text, "wait(extra, 0)"), words=["barrier extra is waited on but nothing arrives"])


def test_barrier_declared_but_unused():
    text = mutate(FA3, "k_empty = mbarrier(count=CONSUMERS, n=STAGES)\n",
                  "k_empty = mbarrier(count=CONSUMERS, n=STAGES)\nextra = mbarrier(count=1)\n")
    check_fails(text, line=line_of(text, "extra = mbarrier"), words=["extra is declared but never used"])


@pytest.mark.parametrize("count, need", [("3", 3), ("CONSUMERS + 1", 3), ("2 * CONSUMERS", 4)])
def test_barrier_count_larger_than_arriving_instances(count, need):
    new = f"k_empty = mbarrier(count={count}, n=STAGES)"
    text = mutate(FA3, "k_empty = mbarrier(count=CONSUMERS, n=STAGES)", new)
    check_fails(text, line=line_of(text, new), words=[f"k_empty needs {need} arrivals per phase",
                                                      "only 2 role instance(s)"])


def test_barrier_count_vs_fewer_role_instances():
    # The barrier still wants CONSUMERS (2) arrivals, but only one consumer instance runs.
    text = mutate(FA3, 'with role("consumer", warps=4, count=CONSUMERS) as wg:',
                  'with role("consumer", warps=4, count=CONSUMERS - 1) as wg:')
    text = mutate(text, "ROWS = BLOCK_M // CONSUMERS", "ROWS = BLOCK_M")
    check_fails(text, line=line_of(text, "k_empty = mbarrier"), words=["needs 2 arrivals", "only 1 role instance"])


def test_barrier_count_matching_instances_passes():
    text = mutate(FA3, "k_empty = mbarrier(count=CONSUMERS, n=STAGES)", "k_empty = mbarrier(count=2, n=STAGES)")
    r = check(parse(text))
    assert ("consumer", 4, 2) in r.roles               # two consumer instances make the two arrivals


def test_sync_outside_role():
    text = insert_after(FA3, "q0 = m_blk * BLOCK_M", "sync()")
    check_fails(text, line=line_of(text, "sync()"), words=["sync() outside any role"])


# ------------------------------------------------------------------ resources and parameters
def test_smem_over_the_arch_limit():
    p = parse(FA3, source="prog.cuir")
    check(p, params={"STAGES": 4}, dims={"D": 64})           # fits
    with pytest.raises(CuIRCheckError) as ei:
        check(p, params={"STAGES": 8}, dims={"D": 128})
    err = ei.value
    need = 32768 + 2 * 8 * 128 * 128 * 2 + 8 * (1 + 8 + 8 + 8 + 8 + 2)   # q_full, k/v full, k/v empty, wg_turn
    assert f"shared memory {need} bytes exceeds the sm_90a limit of {SMEM_LIMIT['sm_90a']}" in str(err)
    assert "fewer stages" in err.hint
    decl_lines = {line_of(FA3, s) for s in ("m_blk, h, b = grid(", "Qs = smem(", "Ks = smem(", "Vs = smem(")}
    assert err.line in decl_lines


def test_smem_limit_depends_on_arch():
    p = parse(FA2)
    assert check(p, params={"STAGES": 3}, dims={"D": 128}).smem_bytes == 32768 * 4   # fits sm_80 (163 KiB)
    with pytest.raises(CuIRCheckError, match="sm_86 limit"):
        check(p, params={"STAGES": 3}, dims={"D": 128}, arch="sm_86")


@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_unknown_param(name):
    text = TEXTS[name]
    err = check_fails(text, line=line_of(text, "kernel("), params={"BLOCK_Q": 64},
                      words=["unknown parameter(s) ['BLOCK_Q']", "BLOCK_M"])
    assert "STAGES" in err.hint


def test_check_does_not_execute_anything(tmp_path):
    # A program text is parsed and checked, never run: a payload in a string constant stays a string.
    marker = tmp_path / "pwned"
    text = mutate(FA2, 'kernel("fa2_sm80", arch="sm_80")',
                  f'kernel("fa2_sm80", arch="sm_80")\n"__import__(\'os\').system(\'touch {marker}\')"')
    check(parse(text))
    assert not marker.exists()
