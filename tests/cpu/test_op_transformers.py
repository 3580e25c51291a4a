"""cubridge.integrations.transformers on CPU: a random-init Llama whose attention is a tuned causal
run (launch stubbed by a float64 causal attention on CPU, so the layout and GQA mapping is what is
tested) gives SDPA's logits; padding masks, custom masks and decode steps are refused."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cubridge.errors import LaunchError                              # noqa: E402
from cubridge.integrations.transformers import register              # noqa: E402
from support.tuned_run import cpu_op, replayed_run                   # noqa: E402

HQ, HKV, D = 4, 2, 128


@pytest.fixture(scope="module")
def causal_op(tmp_path_factory):
    def launch(q, k, v, out, lse, scale):
        kk, vv = (t.double().repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
        out.copy_(torch.nn.functional.scaled_dot_product_attention(q.double(), kk, vv, is_causal=True, scale=scale))
    run = replayed_run(tmp_path_factory.mktemp("tf"), "causal",
                       f"{{heads_q: {HQ}, heads_kv: {HKV}, head_dim: {D}, lengths: [1024, 8192]}}")
    return cpu_op(run.output, launch)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def test_llama_with_the_tuned_kernel_matches_sdpa(causal_op):
    model = _model()
    ids = torch.randint(0, 128, (2, 48))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits.float()
    name = register(causal_op)
    assert name == "cubridge_causal"
    model.set_attn_implementation(name)
    with torch.no_grad():
        ours = model(ids, use_cache=False).logits.float()
        ones = model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()      # bf16 model, float64 attention
    assert torch.equal(ours, ones)                                 # an all-ones mask pads nothing


def test_llama_refuses_what_the_kernel_cannot_honour(causal_op):
    model = _model()
    model.set_attn_implementation(register(causal_op, "cubridge_test"))
    ids = torch.randint(0, 128, (2, 16))
    pad = torch.ones_like(ids)
    pad[0, :3] = 0
    with torch.no_grad():
        with pytest.raises(LaunchError, match="attention_mask has zeros \\(padding\\)"):
            model(ids, attention_mask=pad, use_cache=False)
        with pytest.raises(LaunchError, match="cannot take another"):
            model(ids, attention_mask=torch.ones(2, 1, 16, 16, dtype=torch.bool), use_cache=False)
        out = model(ids, use_cache=True)                               # the prefill itself is fine
        with pytest.raises(LaunchError, match="a decode step or a cached prefix"):
            model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
