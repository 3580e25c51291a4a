"""The LLM proposers' pieces without a server: the answer envelope reader, options, prompt
building and size checks, and the marked-region patches of kernel.cu."""
from __future__ import annotations

import json

import pytest

from cubridge.errors import CubridgeError
from cubridge.llm.backend import PromptTooLong, check_fits, estimate_tokens
from cubridge.llm.envelope import LIFT, LOWER, TRANSFER, EnvelopeError, read_envelope
from cubridge.llm.options import parse_options
from cubridge.llm.prompting import ADVICE, numbered, render_ops, render_taxonomy, retry_message
from cubridge.llm.regions import (PatchError, annotate, apply_patch, check_confined, find_regions,
                                  marked_blocks, region_text, strip_markers)
from cubridge.paths import ref_kernel_dir
from cubridge.vocab import TrialState
from cubridge.transfer.taxonomy import TAXONOMY

PROGRAM = "kernel('k')\nx = zeros(f32, [16, 16])\n"


# ------------------------------------------------------------------ envelope
@pytest.mark.parametrize("answer", [
    json.dumps({"cuir": PROGRAM, "notes": "n"}),
    "Sure! Here it is:\n" + json.dumps({"cuir": PROGRAM, "notes": "n"}) + "\nHope this helps.",
    "```json\n" + json.dumps({"cuir": PROGRAM, "notes": "n"}) + "\n```",
    "<think>the mask... {not json}</think>\n" + json.dumps({"cuir": PROGRAM, "notes": "n"}),
    f"The program:\n```cuir\n{PROGRAM}```\n",
    f"```python\n{PROGRAM}```",
])
def test_envelope_reads_json_and_fenced_forms(answer):
    assert read_envelope(answer, "stop", TRANSFER)["cuir"].strip() == PROGRAM.strip()


@pytest.mark.parametrize("answer, finish, words", [
    (json.dumps({"cuir": PROGRAM}), "length", "cut off at max_tokens"),
    ("", "stop", "empty"),
    ("just prose", "stop", "no answer envelope"),
    ('{"code": "x"}', "stop", "no 'cuir' field"),
    ('{"cuir": ["x"]}', "stop", "not a string"),
    ("```cuda\nint x;\n```", "stop", "no answer envelope"),     # a fence of the wrong language
])
def test_envelope_errors_say_what_was_expected(answer, finish, words):
    with pytest.raises(EnvelopeError, match=words) as e:
        read_envelope(answer, finish, TRANSFER)
    assert finish == "length" or '"cuir"' in e.value.hint


def test_schemas_are_closed_objects():
    for env in (TRANSFER, LIFT, LOWER):
        s = env.schema
        assert s["type"] == "object" and s["additionalProperties"] is False
        assert env.main in s["required"] and set(s["required"]) <= set(s["properties"])
    assert LOWER.schema["properties"]["regions"]["additionalProperties"] == {"type": "string"}


# ------------------------------------------------------------------ options
def test_options_defaults_and_types():
    o = parse_options("vllm", {"model": "/m", "tensor_parallel_size": 2, "temperature": 1, "samples": 3})
    assert (o.backend.model, o.backend.tensor_parallel_size, o.temperature, o.samples) == ("/m", 2, 1.0, 3)
    assert o.max_retries == 2 and o.structured is True and o.backend.ray_actor is False
    o = parse_options("openai", {})
    assert o.backend.base_url == "http://127.0.0.1:8000/v1" and o.backend.structured_field == "response_format"


@pytest.mark.parametrize("kind, options, words", [
    ("vllm", {}, "model is required"),
    ("vllm", {"model": "/m", "base_url": "http://x"}, "base_url: unknown option"),
    ("openai", {"model": "/m", "tensor_parallel_size": 2}, "tensor_parallel_size: unknown option"),
    ("openai", {"samples": "4"}, "samples: expected int"),
    ("openai", {"samples": True}, "samples: expected int"),
    ("openai", {"samples": 0}, "samples must be >= 1"),
    ("openai", {"base_url": "127.0.0.1:8000"}, "must start with http"),
    ("openai", {"structured_field": "grammar"}, "structured_field must be one of"),
])
def test_bad_options_are_errors(kind, options, words):
    with pytest.raises(CubridgeError, match=words):
        parse_options(kind, options)


# ------------------------------------------------------------------ prompts
def test_taxonomy_and_ops_are_rendered_from_the_data():
    text = render_taxonomy()
    for rule in TAXONOMY:
        assert rule.name in text and rule.doc in text
    ops = render_ops()
    assert "- mma(a, b, acc=None): a @ b (+ acc)" in ops and "- kernel(name, arch=...)" in ops


def test_retry_message_carries_the_error_and_advice():
    for state in ADVICE:
        msg = retry_message(state, "line 7: boom", "CuIR program")
        assert msg["role"] == "user" and "line 7: boom" in msg["content"] and state.value in msg["content"]
        assert "whole corrected\nCuIR program" in msg["content"]


def test_worked_example_is_never_the_target_itself():
    import dataclasses

    from cubridge.llm.transfer import TransferTask
    from cubridge.search.screen import ScreenContext
    ctx = ScreenContext.build("fa2_sm80", "prefixlm", quick=True)
    task = TransferTask(ctx, example_spec="prefixlm")
    assert "`fa2_sm80` -> `global_sliding_window`" in task.example
    assert "`fa2_sm80` -> `prefixlm`" in TransferTask(dataclasses.replace(ctx, spec=_spec("causal"))).example
    assert "C0 = 48" in TransferTask(dataclasses.replace(ctx, spec=_spec("causal"))).example   # bound at N = 97
    assert TransferTask(ctx, worked_example=False).example == ""


def _spec(name):
    from cubridge.spec import load_spec
    return load_spec(name)


def test_prompt_size_estimate_is_conservative_and_checked():
    msgs = [{"role": "user", "content": "é" * 100}]           # 200 bytes
    assert estimate_tokens(msgs) == 67 + 8
    assert check_fits(msgs, 100, 200) == 75
    with pytest.raises(PromptTooLong, match=r"about 75 tokens .* max_tokens=150, .* max_model_len=200"):
        check_fits(msgs, 150, 200)
    assert check_fits(msgs, 10 ** 6, None) == 75              # unknown context: nothing to check


def test_numbered_lines():
    assert numbered("a\nb") == "1| a\n2| b"


# ------------------------------------------------------------------ marked regions
@pytest.fixture(scope="module", params=["fa2_sm80", "fa3_sm90"])
def kernel_cu(request):
    return (ref_kernel_dir(request.param) / "kernel.cu").read_text()


def test_reference_kernels_mark_their_regions(kernel_cu):
    spans = find_regions(kernel_cu)
    assert {"kv_range", "mask", "score", "softmax", "epilogue"} <= set(spans)
    assert all(s.open < s.close for s in spans.values())


def test_patch_replaces_only_the_region(kernel_cu):
    new = "__device__ __forceinline__ bool mask_pred(int b, int h, int q_idx, int kv_idx) { return true; }"
    patched = apply_patch(kernel_cu, {"mask": new})
    assert region_text(patched, "mask") == new
    assert strip_markers(patched).replace(new + "\n", "") in strip_markers(kernel_cu).replace(
        region_text(kernel_cu, "mask") + "\n", "")
    check_confined(kernel_cu, patched)
    for name in find_regions(kernel_cu):
        if name != "mask":
            assert region_text(patched, name) == region_text(kernel_cu, name)


@pytest.mark.parametrize("patch, allowed, words", [
    ({"warp_tile": "x"}, None, "does not mark"),
    ({"qk": "x"}, {"mask"}, "did not change in the CuIR"),
    ({"mask": "// @cuir-end mask\nint x;"}, None, "marker line"),
])
def test_bad_patches_are_refused(kernel_cu, patch, allowed, words):
    with pytest.raises(PatchError, match=words):
        apply_patch(kernel_cu, patch, allowed=allowed)


def test_changes_outside_the_regions_are_caught(kernel_cu):
    lines = kernel_cu.splitlines()
    spans = find_regions(kernel_cu)
    first = min(s.open for s in spans.values())
    outside = next(i for i in range(first) if lines[i].strip())
    edited = "\n".join(lines[:outside] + ["// sneaky"] + lines[outside + 1:]) + "\n"
    with pytest.raises(PatchError, match=f"line {outside + 1} of the kernel, outside every marked region"):
        check_confined(kernel_cu, edited)
    with pytest.raises(PatchError, match="adds or removes lines"):
        check_confined(kernel_cu, kernel_cu + "int extra;\n")
    renamed = kernel_cu.replace("// @cuir-end mask", "// @cuir-end mask2").replace(
        "// @cuir-region mask\n", "// @cuir-region mask2\n")
    with pytest.raises(PatchError, match="changed the marked regions"):
        check_confined(kernel_cu, renamed)


def test_annotate_inverts_strip_markers(kernel_cu):
    """The lifting map as line ranges of the unmarked source reproduces the marked file."""
    spans = find_regions(kernel_cu)
    ranges, markers_before = {}, 0
    for name, s in sorted(spans.items(), key=lambda kv: kv[1].open):
        lo = s.open - markers_before             # 0-based index of its first line once unmarked
        ranges[name] = (lo + 1, lo + (s.close - s.open - 1))
        markers_before += 2
    assert annotate(strip_markers(kernel_cu), ranges) == kernel_cu


@pytest.mark.parametrize("ranges, words", [({"mask": (5, 3)}, "not a range"), ({"mask": (1, 10 ** 6)}, "not a range"),
                                           ({"mask": (10, 20), "score": (15, 30)}, "overlaps")])
def test_annotate_refuses_bad_maps(ranges, words):
    with pytest.raises(PatchError, match=words):
        annotate("\n".join(f"line {i}" for i in range(100)), ranges)


def test_malformed_markers_are_errors():
    for text, words in [("// @cuir-region a\n// @cuir-region b\n", "opens inside"),
                        ("// @cuir-region a\n", "never closed"), ("// @cuir-end a\n", "closes no open"),
                        ("// @cuir-region a\n// @cuir-end a\n// @cuir-region a\n// @cuir-end a\n", "marked twice")]:
        with pytest.raises(PatchError, match=words):
            find_regions(text)
    assert find_regions("// see `// @cuir-region NAME` below\n") == {}


def test_marked_blocks_fallback():
    answer = "Here:\n```cuda\n// @cuir-region mask\nreturn kv <= q;\n// @cuir-end mask\n```\n"
    assert marked_blocks(answer) == {"mask": "return kv <= q;"}


def test_states_the_advice_covers_are_repairable():
    from cubridge.llm.engine import REPAIRABLE
    assert set(ADVICE) == set(REPAIRABLE)
    assert TrialState.CONFIG_INVALID not in REPAIRABLE and TrialState.PROPOSER_ERROR not in REPAIRABLE
