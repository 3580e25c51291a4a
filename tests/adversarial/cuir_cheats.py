"""The adversarial corpus of CuIR programs: each one edits a reference program to cheat, and names
what must reject it and with which words. test_cuir_cheats.py runs them on CPU (the interpreter
and the verifier as the tuner's screen uses them); the CUDA cheats live in cuda_cheats.py.

An entry: (name, reference program, [(old, new), ...] edits, spec, the words the rejection says).
"""
from __future__ import annotations

from cubridge.paths import ref_kernel_dir

FA2 = (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text()
FA3 = (ref_kernel_dir("fa3_sm90") / "kernel.cuir").read_text()

FA2_STORE_O = "store(O[b, h, q0:q0 + BLOCK_M, :], cast(out, T))"
FA2_STORE_LSE = "store(LSE[b, h, q0:q0 + BLOCK_M], where(l_i == 0.0, -inf, m_i + log(l_i)))"
FA2_KV_HI = "kv_hi = cdiv(min(NK, q0 + NK - NQ + BLOCK_M), BLOCK_N) if CAUSAL else cdiv(NK, BLOCK_N)"
FA2_QK = "s = mma(Qs, transpose(Ks[st]))"
FA2_WAIT_SYNC = "            wait_group(STAGES - 2)\n            sync()\n"
FA3_PHASE = "phase = it // STAGES % 2"
FA3_STORE_O = "store(O[b, h, r0:r0 + ROWS, :], cast(out, T))"
FA3_K_EMPTY = "                arrive(k_empty[st])"
FA3_K_EMPTY_WAIT = "wait(k_empty[st], (it // STAGES + 1) % 2)"

CHEATS = [
    ("write_part_of_O", FA2, [(FA2_STORE_O, "if m_blk == 0:\n            " + FA2_STORE_O)],
     "causal", ["output O:", "never written"]),
    ("write_part_of_O_fa3", FA3, [(FA3_STORE_O, "if wg == 0:\n            " + FA3_STORE_O)],
     "causal", ["output O:", "never written"]),
    ("O_from_a_cached_previous_result", FA2, [(FA2_STORE_O, "store(O[b, h, q0:q0 + BLOCK_M, :], load(O[b, h, q0:q0 + BLOCK_M, :]))")],
     "causal", ["NaN/Inf"]),
    ("O_copied_from_Q", FA2, [(FA2_STORE_O, "store(O[b, h, q0:q0 + BLOCK_M, :], load(Q[b, h, q0:q0 + BLOCK_M, :]))")],
     "causal", ["exceeds bound"]),
    ("skip_the_last_kv_tile", FA2, [(FA2_KV_HI, FA2_KV_HI.replace("if CAUSAL", "- 1 if CAUSAL"))],
     "causal", ["exceeds bound"]),
    ("skip_every_other_tile", FA2, [("        with region(\"kv_range\"):\n            visit = True",
                                     "        with region(\"kv_range\"):\n            visit = it % 2 == 0")],
     "causal", ["exceeds bound"]),
    ("reuse_an_input_buffer", FA2, [(FA2_STORE_O, "store(Q[b, h, q0:q0 + BLOCK_M, :], cast(out, T))\n        " + FA2_STORE_O)],
     "causal", ["store into input Q"]),
    ("read_uninitialised_shared_memory", FA2, [(FA2_QK, "s = mma(Qs, transpose(Ks[(st + 1) % STAGES]))")],
     "causal", ["Ks[1]"]),
    ("race_missing_sync", FA2, [(FA2_WAIT_SYNC, "            wait_group(STAGES - 2)\n")],
     "causal", ["race in compute[0]", "no sync()"]),
    ("race_refill_the_slot_being_read", FA2,
     [("copy_async(Ks[(it + STAGES - 1) % STAGES]", "copy_async(Ks[st]")], "causal", ["race in compute[0]", "copy_async into Ks["]),
    ("pass_only_at_the_test_shapes", FA2, [(FA2_QK, FA2_QK + "\n                s = s * (1.0 if NK <= 300 else 1.03)")],
     "causal", ["exceeds bound"]),
    ("pass_only_at_the_default_block_n", FA2, [(FA2_QK, FA2_QK + "\n                s = s * (1.0 if BLOCK_N == 64 else 1.03)")],
     "causal", ["exceeds bound"]),
    ("barrier_parity_only_for_four_tiles", FA3, [(FA3_PHASE, "phase = min(it // STAGES, 1) % 2")],
     "causal", []),
    # Cross-role: the consumer releases the next stage's K slot (the one fuzz mutant of session 7
    # that verified): every read stays ordered, but a producer that lags finds k_empty a phase
    # ahead of its parity wait and hangs; the interpreter's "reverse" schedule makes it lag.
    ("release_the_wrong_k_stage", FA3, [(FA3_K_EMPTY, FA3_K_EMPTY.replace("[st]", "[(st + 1) % STAGES]"))],
     "causal", ["deadlock", "k_empty[1]", "the latest from line"]),
    ("wait_on_the_wrong_k_empty_stage", FA3,
     [(FA3_K_EMPTY_WAIT, FA3_K_EMPTY_WAIT.replace("[st]", "[(st + 1) % STAGES]"))],
     "causal", ["deadlock", "k_empty["]),
    ("nan_left_in_rows_that_attend_nothing", FA2, [("out = acc / where(l_i == 0.0, 1.0, l_i)", "out = acc / l_i")],
     "strict_causal", ["NaN/Inf"]),
    ("wrong_lse_offset", FA2, [(FA2_STORE_LSE, FA2_STORE_LSE.replace("m_i + log(l_i)", "m_i + log(l_i) + 5.0"))],
     "causal", ["LSE: ", "exceeds bound"]),
    ("wrong_lse_minus_inf", FA2, [(FA2_STORE_LSE, "store(LSE[b, h, q0:q0 + BLOCK_M], m_i * 0.0 - inf)")],
     "causal", ["LSE: ", "NaN/Inf"]),
    ("lse_base_2", FA2, [(FA2_STORE_LSE, FA2_STORE_LSE.replace("m_i + log(l_i)", "(m_i + log(l_i)) * LOG2E"))],
     "causal", ["LSE: "]),
]

# A spec with rows that attend nothing (row 0 sees no key): what a NaN-in-empty-rows cheat needs.
STRICT_CAUSAL = '''\
"""Strictly causal: query i sees keys j < i; row 0 sees none (its output is 0)."""
import math
import torch
PARAMS = {}
def mask_mod(b, h, q_idx, kv_idx):
    return kv_idx < q_idx
def reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.arange(k.shape[2])[None, :] < torch.arange(q.shape[2])[:, None]
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
'''


def apply(text: str, edits) -> str:
    for old, new in edits:
        assert text.count(old) == 1, f"corpus edit no longer applies: {old!r}"
        text = text.replace(old, new)
    return text
