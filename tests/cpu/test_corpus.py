"""The public corpus of real mods (tests/corpus/, issue 19 item 2): each spec, written as its
authors write it, transfers unchanged onto both reference kernels, verifies in the interpreter at
a length where its structure shows (windows, documents, buckets smaller than the sequence), and
lowers to CUDA."""
from __future__ import annotations

from pathlib import Path

import pytest

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.paths import ref_kernel_dir
from cubridge.spec import Hooks, load_spec
from cubridge.transfer.pairs import count_attended
from cubridge.transfer.rules import transfer
from cubridge.verify import Case, verify_transfer

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
NAMES = sorted(p.stem for p in CORPUS.glob("[a-z]*.py"))
REFS = ("fa2_sm80", "fa3_sm90")
N = 192
# Test-size parameters: every window, chunk, document and canvas smaller than N, so that the
# structure is exercised (the defaults are the published values, for the benchmark at 8k).
SMALL = {
    "ag_sliding_window": {"window": 40}, "ag_prefix_lm": {"prefix": 50},
    "ag_document_causal": {"lengths": (37, 61, 23, 90)},
    "ag_document_sliding": {"lengths": (37, 61, 23, 90), "window": 16},
    "ag_dilated_sliding_window": {"window": 40, "dilation": 3},
    "ag_natten": {"canvas": (12, 16), "kernel": (5, 7)}, "ag_head_mask": {"window": 24},
    "longt5_local": {"radius": 30}, "mistral_sliding_window": {"window": 40},
    "phi3_sliding_window": {"window": 47}, "qwen2_sliding_window": {"window": 64},
    "gemma2_local": {"window": 48}, "llama4_chunked": {"chunk": 48},
    "streaming_sinks": {"window": 40}, "longformer_global": {"window": 20, "global_tokens": 8},
    "fa_local_softcap": {"left": 40, "right": 12, "softcap": 5.0}, "bitpacked_blocks": {"block": 16},
    "modernbert_local": {"local_attention": 32},
}
# Masks that read b or h get two batches and two kv heads.
CASE = {"default": Case(1, 2, 1, N, N, 32, 0), "bh": Case(2, 4, 2, N, N, 32, 1)}
PER_BH = {"ag_head_mask", "padded_causal", "packed_sequences"}
# Causal masks whose variant is in the score_mod.
CAUSAL_ONLY = {"ag_causal", "gemma2_global", "ag_softcap", "ag_softcap_approx", "ag_alibi",
               "ag_relative_positional", "t5_decoder_bias", "bloom_alibi", "mpt_alibi", "sigmoid_alibi"}
SOURCES = {"ag_": "attention-gym", "t5_": "transformers", "longt5": "transformers", "bloom": "transformers",
           "mpt": "transformers", "gemma2": "transformers", "mistral": "transformers", "phi3": "transformers",
           "qwen2": "transformers", "llama4": "transformers", "padded": "transformers",
           "packed": "transformers", "modernbert": "transformers", "streaming": "papers",
           "sigmoid": "papers", "longformer": "papers", "fa_": "flash-attention"}


@pytest.fixture(scope="module")
def refs():
    return {n: parse_file(ref_kernel_dir(n) / "kernel.cuir") for n in REFS}


def test_corpus_size_and_sources():
    sources = {src for n in NAMES for p, src in SOURCES.items() if n.startswith(p)}
    assert len(NAMES) >= 25 and len(sources) >= 4, (len(NAMES), sources)


@pytest.mark.parametrize("name", NAMES)
def test_structure_shows_at_test_length(name):
    """The mask at test size is neither every pair nor plain causal (else the test proves little)."""
    spec = load_spec(str(CORPUS / f"{name}.py"))
    hooks = spec.hooks_for(N, N, 4, 2, **SMALL.get(name, {}))
    if hooks.mask_mod is None:
        assert hooks.score_mod is not None
        return
    count = count_attended(hooks, 2, 4, N, N)
    causal = count_attended(Hooks(mask_mod=lambda b, h, q, k: k <= q), 2, 4, N, N)
    assert 0 < count < 2 * 4 * N * N
    assert (count == causal) == (name in CAUSAL_ONLY), name


@pytest.mark.parametrize("ref", REFS)
@pytest.mark.parametrize("name", NAMES)
def test_corpus_spec_transfers_verifies_and_lowers(refs, ref, name):
    spec = load_spec(str(CORPUS / f"{name}.py"))
    params = SMALL.get(name)
    case = CASE["bh" if name in PER_BH else "default"]
    report = verify_transfer(refs[ref], spec, cases=[case], spec_params=params)
    assert report.passed, report.table()
    cand = transfer(refs[ref], spec, spec_params=params)
    kernel = lower(cand.program, ref)
    assert "mask_pred" in kernel.source and "score_mod" in kernel.source


def test_approximate_tanh_is_recorded_in_the_transfer(refs):
    from cubridge.transfer.trace import trace_score
    spec = load_spec(str(CORPUS / "ag_softcap_approx.py"))
    notes = trace_score(spec.hooks_for(N, N, 2, 1).score_mod).notes
    assert notes and "approx::tanh traced as exact tanh" in notes[0]
