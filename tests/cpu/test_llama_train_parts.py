"""experiments/expkit/llama_train.py on CPU: the free-attention system (output shape, a gradient
path to every projection), the bracket of the attention's backward (its range holds the
attention's backward ops and nothing of the projections'), the per-part sums of a hand-made
trace, the bound from the step times, and llama_client's options for them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
SHAPE = {"hq": 4, "hkv": 2, "d": 32, "layers": 2, "vocab": 64, "ffn": 64}


@pytest.fixture(scope="module")
def mods():
    """(llama_client, expkit.llama, expkit.llama_train); sys.path and the added modules restored after."""
    before = list(sys.path)
    added = [m for m in ("llama_client", "expkit", "expkit.llama", "expkit.llama_train") if m not in sys.modules]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import llama_client
        from expkit import llama, llama_train
        yield llama_client, llama, llama_train
    finally:
        sys.path[:] = before
        for m in added:
            sys.modules.pop(m, None)


@pytest.fixture()
def registered(mods):
    names = mods[2].register_train_systems()
    yield names
    mods[2].unregister(*set(names.values()))


def _model(llama, impl):
    model = llama.make_model("cpu", train=True, **SHAPE)
    model.set_attn_implementation(impl)
    return model


def test_free_attention_keeps_shapes_and_every_gradient(mods, registered):
    llama, lt = mods[1], mods[2]
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(2))
    out, w = lt.free_attention(None, q, k, v, None)
    assert w is None and out.shape == (2, 6, 4, 8) and torch.equal(out, q.detach().transpose(1, 2))
    (out * torch.arange(8.0)).sum().backward()
    assert torch.equal(q.grad, torch.arange(8.0).expand(2, 4, 6, 8))
    assert k.grad.shape == k.shape and not k.grad.any() and v.grad.shape == v.shape and not v.grad.any()
    assert llama.implementation("none", {}, "prefixlm") == registered["none"]
    masks = {}
    model = _model(llama, registered["none"])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids, use_cache=False, **llama.call_kwargs("none", "prefixlm", 16, masks, "cpu")).loss
    loss.backward()
    attn = model.model.layers[0].self_attn
    assert torch.isfinite(loss) and all(getattr(attn, f"{p}_proj").weight.grad is not None for p in "qkvo")
    assert attn.q_proj.weight.grad.abs().max() > 0 and attn.o_proj.weight.grad.abs().max() > 0


def test_nolse_systems_take_flex_keywords(mods, registered):
    llama = mods[1]
    assert llama.implementation("flex_flash_nolse", {}, "prefixlm") == registered["flex_flash_nolse"]
    assert llama.implementation("flex_flash", {}, "prefixlm") == "flex_attention"


def test_backward_range_holds_the_attentions_backward_only(mods, tmp_path):
    """One CPU step of a tiny model with SDPA bracketed: per layer one forward and one backward
    range, the backward range holds SDPA's backward node and no linear layer's (the projections
    run before and after it)."""
    from torch.profiler import ProfilerActivity, profile
    llama, lt = mods[1], mods[2]
    model = _model(llama, "sdpa")
    model.set_attn_implementation(lt.bracketed("sdpa"))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    step = llama.train_step(model, llama.optimizer(model, 1e-3), ids)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        prof.export_chrome_trace(str(tmp_path / "t.json"))
    finally:
        model.set_attn_implementation("sdpa")
        lt.unregister("parts_sdpa")
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    ranges = {m: [e for e in spans if e["name"] == m] for m in (lt.FWD_MARK, lt.BWD_MARK)}
    assert [len(r) for r in ranges.values()] == [2, 2]
    for r in ranges[lt.BWD_MARK]:
        inside = {e["name"] for e in spans if e["tid"] == r["tid"] and r["ts"] <= e["ts"] <= r["ts"] + r["dur"]}
        assert any("ScaledDotProduct" in n and n.endswith("Backward0") for n in inside), inside
        assert not any("MmBackward" in n or "LinearBackward" in n or n == "aten::mm" for n in inside), inside
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert "parts_sdpa" not in ALL_ATTENTION_FUNCTIONS._global_mapping


def _ev(name, ts, dur, cat, corr=None, tid=1):
    e = {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_step_parts_places_each_kernel(mods):
    """Launch times against the CPU ranges; the GPU timeline's copies of the annotations (which
    span the launches of the GEMMs and the optimizer here) place nothing."""
    lt = mods[2]
    events = [_ev(lt.FWD_MARK, 0, 10, "user_annotation"), _ev(lt.BWD_MARK, 100, 20, "user_annotation", tid=2),
              _ev("cudaLaunchKernel", 5, 1, "cuda_runtime", 1), _ev("cuLaunchKernel", 110, 1, "cuda_driver", 2),
              _ev("cudaLaunchKernel", 50, 1, "cuda_runtime", 3), _ev("cudaLaunchKernel", 60, 1, "cuda_runtime", 4),
              _ev("cudaLaunchKernel", 130, 1, "cuda_runtime", 5), _ev("cudaLaunchKernel", 140, 1, "cuda_runtime", 6),
              _ev("fa3_sm90_fwd", 20, 30, "kernel", 1), _ev("fa3_bwd_sm90", 200, 50, "kernel", 2),
              _ev("nvjet_tst_gemm", 60, 40, "kernel", 3), _ev("sm90_xmma_gemm", 90, 20, "kernel", 4),
              _ev("multi_tensor_apply_kernel adam", 300, 5, "kernel", 5), _ev("silu", 310, 2, "kernel", 6),
              _ev("Memset (Device)", 320, 1, "gpu_memset"),
              _ev(lt.FWD_MARK, 20, 30, "gpu_user_annotation"), _ev(lt.BWD_MARK, 40, 300, "gpu_user_annotation")]
    p = lt.step_parts(events)
    assert p["us"] == {"attention_fwd": 30.0, "attention_bwd": 50.0, "gemm": 60.0, "optimizer": 5.0, "other": 3.0}
    assert p["kernels"]["gemm"] == 2 and p["kernel_us_total"] == 148.0
    assert p["marks"] == {lt.FWD_MARK: 1, lt.BWD_MARK: 1}
    assert p["window_us"] == 301.0 and p["busy_us"] == 30 + 40 + 10 + 50 + 5 + 2 + 1      # the GEMMs overlap 10 us
    assert p["top"]["gemm"][0] == ["nvjet_tst_gemm", 40.0] and "fa3_bwd_sm90" in p["kernel_names"]
    assert lt.step_parts([])["kernel_us_total"] == 0.0


def test_bound(mods):
    lt = mods[2]
    rows = [{"direction": "train_step", "variant": "prefixlm", "system": s, "ms": ms}
            for s, ms in [("cubridge", 92.0), ("none", 76.0), ("flex_triton", 96.0), ("flex_flash_nolse", 94.0)]]
    b = lt.bound(rows + [{"direction": "forward", "variant": "prefixlm", "system": "none", "ms": 1.0}])
    assert b["free_attention_ms"] == 76.0 and b["attention_cost_ms"]["cubridge"] == 16.0
    assert b["vs_flex"]["flex_triton"] == {"max_speedup_free_attention": round(96 / 76, 4),
                                           "cubridge_speedup": round(96 / 92, 4), "bar_reachable": False}
    rows[1]["ms"] = 70.0
    assert lt.bound(rows)["vs_flex"]["flex_triton"]["bar_reachable"] is True       # 96 / 70 >= 1.3
    assert lt.bound(rows[:1]) == {}


def test_client_options(mods, capsys):
    client = mods[0]
    a = client.parse(["--out", "x.json", "--train", "--seeds", "0", "--flex-backend", "both", "--layer-only",
                      "--fwd-variants", "prefixlm"])
    assert a.seeds == 0 and a.flex_backend == "both" and a.layer_only
    assert client.FLEX_TRAIN["both"] == ("flex_flash", "flex_flash_nolse", "flex_triton")
    for argv, message in [(["--seeds", "-1"], "--seeds -1"),
                          (["--layer-only", "--fwd-variants", "causal"], "--layer-only"),
                          (["--train", "--no-forward", "--layer-only"], "--layer-only")]:
        with pytest.raises(SystemExit):
            client.parse(["--out", "x.json", *argv])
        assert message in capsys.readouterr().err


def test_flex_systems_first_or_every(mods, monkeypatch):
    client = mods[0]
    tried = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)     # first_flex waits for the GPU

    def try_fn(s):
        tried.append(s)
        if s == "flex_flash":
            raise RuntimeError("FLASH backend backward does not support differentiating through logsumexp")
    errors = {}
    args = client.parse(["--out", "x.json", "--flex-backend", "both"])
    got = client.flex_systems(args, client.FLEX_TRAIN, try_fn, errors)
    assert got == ["flex_flash_nolse", "flex_triton"] and "logsumexp" in errors["flex_flash"]
    tried.clear()
    args = client.parse(["--out", "x.json"])
    assert client.flex_systems(args, client.FLEX_TRAIN, try_fn, {}) == ["flex_flash_nolse"]
    assert tried == ["flex_flash", "flex_flash_nolse"]


def test_flex_nolse_is_flex_without_the_lse(mods, monkeypatch):
    """FLEX_NOLSE's call (eager flex_attention standing in for the compiled one): the prefix-LM
    BlockMask, GQA and the module's scale give SDPA + the boolean mask's output, in transformers'
    [B, N, Hq, D] (Flex has no backward on CPU: the gradient path is the GPU run's)."""
    from torch.nn.attention.flex_attention import flex_attention
    llama, lt = mods[1], mods[2]
    monkeypatch.setattr(lt, "_FLEX", [flex_attention])
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 256, 16, generator=g)
    k, v = (torch.randn(2, 2, 256, 16, generator=g) for _ in range(2))
    block = llama.flex_block_mask("prefixlm", 256, "cpu")
    out, w = lt.flex_nolse(None, q, k, v, block, scaling=0.3, dropout=0.0)
    mask = llama.prefix_mask(256, device="cpu")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask, scale=0.3).transpose(1, 2)
    assert w is None and out.shape == (2, 256, 4, 16) and out.is_contiguous()
    assert torch.allclose(out, ref, atol=1e-5)
