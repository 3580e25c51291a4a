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


def test_spec_mask_skips_the_packed_sequence_sync(causal_op):
    """attention_mask=spec_mask(B, N): the same logits as no mask, and transformers' per-forward
    packed-sequence check (a .all() read back from the device: aten._local_scalar_dense) is
    skipped, as it is for FlexAttention's BlockMask; a spec_mask of another shape, a constant False
    one and a decode step with one are refused."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cubridge.integrations.transformers import is_spec_mask, spec_mask

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kwargs or {}))
    model = _model()
    model.set_attn_implementation(register(causal_op, "cubridge_test_mask"))
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with Reads() as plain:
            ours = model(ids, use_cache=False).logits
        with Reads() as masked:
            with_mask = model(ids, attention_mask=spec_mask(2, 48), use_cache=False).logits
        assert plain.n >= 1 and masked.n == 0 and torch.equal(ours, with_mask)
        with pytest.raises(LaunchError, match="cannot take another"):
            model(ids, attention_mask=spec_mask(2, 40), use_cache=False)
        with pytest.raises(LaunchError, match="cannot take another"):
            model(ids, attention_mask=torch.zeros((), dtype=torch.bool).expand(2, 1, 48, 48), use_cache=False)
        out = model(ids, use_cache=True)
        with pytest.raises(LaunchError, match="a decode step or a cached prefix"):
            model(ids[:, :1], attention_mask=spec_mask(2, 1, 49), past_key_values=out.past_key_values, use_cache=True)
    q, k = torch.empty(2, HQ, 48, 8), torch.empty(2, HKV, 48, 8)
    assert is_spec_mask(spec_mask(2, 48), q, k) and spec_mask(2, 48).untyped_storage().nbytes() == 1
    assert not is_spec_mask(torch.ones(2, 1, 48, 48, dtype=torch.bool), q, k)       # materialised: a custom mask
