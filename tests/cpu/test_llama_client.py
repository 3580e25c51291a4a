"""experiments/llama_client.py's logic on CPU: argument checks, the loss-curve noise bound and the
step-0 gradient verdict (both must be able to fail), the speedup table's bars, the backward-kernel
record, bench_peers' model-shape options, and a training loop of a tiny transformers Llama whose
attention is a tuned prefixlm op (launches stubbed by a float64 reference and its autograd), which
must track the same model with SDPA + a boolean prefix mask."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from support.tuned_run import cpu_op, replayed_run

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(scope="module")
def mods():
    """(llama_client, expkit.llama, bench_peers) imported from experiments/; sys.path and the
    modules this fixture added are restored after."""
    before, added = list(sys.path), [m for m in ("llama_client", "bench_peers", "expkit", "expkit.llama", "expkit.peers")
                                     if m not in sys.modules]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import bench_peers
        import llama_client
        from expkit import llama
        yield llama_client, llama, bench_peers
    finally:
        sys.path[:] = before
        for m in added:
            sys.modules.pop(m, None)


@pytest.mark.parametrize("argv,message", [
    (["--reps", "0"], "--reps 0"), (["--train", "--steps", "1"], "--steps 1"),
    (["--train", "--lr", "nan"], "--lr nan"), (["--train", "--train-n", "100"], "--train-n 100"),
    (["--train", "--train-n", "40960"], "--train-n 40960"), (["--no-forward"], "nothing to run"),
    (["--alt-configs", "128x176"], "write BMxBNsS"), (["--alt-configs", "128x256s2p"], "registers")])
def test_bad_arguments_are_refused(mods, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        mods[0].parse(["--out", "x.json", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_defaults(mods):
    a = mods[0].parse(["--out", "x.json", "--train"])
    assert (a.steps, a.train_n, a.train_variants, a.flex_backend) == (50, 8192, ["prefixlm", "causal"], "auto")


def test_alt_configs_build_one_run_each(mods, monkeypatch, tmp_path):
    import cubridge.integrations.transformers as tf
    import cubridge.op
    built = []
    monkeypatch.setattr(cubridge.op, "build", lambda spec, out, **kw: built.append((spec, out.name, kw)) or out)
    monkeypatch.setattr(tf, "register", lambda run, name=None: name)
    monkeypatch.setattr(mods[0], "run_info", lambda run: str(run))
    args = mods[0].parse(["--out", "x.json", "--alt-configs", "128x176s2p", "128x160s2p"])
    names, info = mods[0].build_runs(args, tmp_path)
    assert info["prefixlm@128x176s2p"] == str(tmp_path / "prefixlm_128x176s2p")
    assert names == {"causal": "cubridge_causal", "prefixlm": "cubridge_prefixlm",
                     "prefixlm@128x176s2p": "cubridge_prefixlm_128x176s2p",
                     "prefixlm@128x160s2p": "cubridge_prefixlm_128x160s2p"}
    point = {"block_m": 128, "block_n": 176, "stages": 2, "persistent": True}
    assert ("prefixlm", "prefixlm_128x176s2p", {"heads_q": 16, "heads_kv": 4, "head_dim": 128,
                                                "configs": {1024: point, 8192: point}}) in built
    assert ("causal", "causal", {"heads_q": 16, "heads_kv": 4, "head_dim": 128}) in built


def test_prefixlm_run_must_fit_the_model(mods, prefix_op, tmp_path, capsys):
    from cubridge.errors import CubridgeError
    with pytest.raises(SystemExit):
        mods[0].parse(["--out", "x.json", "--prefixlm-run", str(tmp_path)])
    assert "no dispatch.json" in capsys.readouterr().err
    with pytest.raises(CubridgeError, match="Hq=4, Hkv=2, D=64") as e:      # the tiny test run: 4 / 2 heads
        mods[0].tuned_run(prefix_op.directory)
    assert "heads_q: 16" in e.value.hint
    info = mods[0].run_info(prefix_op)
    assert info["dir"] == str(prefix_op.directory) and info["buckets"][0]["backward"] is None


def test_curve_verdict_passes_within_noise_and_fails_outside(mods):
    verdict = mods[1].curve_verdict
    ref = [10.0, 9.0, 8.0]
    sdpa = [10.0, 9.01, 8.02]                          # noise 0.02: bound 0.04 + 1e-5
    ok = verdict([10.0, 9.03, 7.97], ref, {"sdpa": sdpa})
    assert ok["passed"] and ok["noise"] == pytest.approx(0.02) and ok["max_diff"] == pytest.approx(0.03)
    bad = verdict([10.0, 9.0, 8.05], ref, {"sdpa": sdpa})
    assert not bad["passed"] and bad["worst_step"] == 2 and "step 2" in bad["reason"]
    nan = verdict([10.0, math.nan, 8.0], ref, {"sdpa": sdpa})
    assert not nan["passed"] and "NaN" in nan["reason"]
    assert not verdict([1.0, 1.0], [1.0, 1.0], {"sdpa": [1.0, math.inf]})["passed"]
    with pytest.raises(ValueError, match="different lengths"):
        verdict([1.0], [1.0, 2.0], {"sdpa": [1.0, 2.0]})
    with pytest.raises(ValueError, match="at least one other"):
        verdict([1.0], [1.0], {})


def test_seeds_verdict_takes_both_maxima_over_the_seeds(mods):
    """The bound is 2 x the largest spread of the other systems over every seed, against the
    largest difference of ours over every seed: one seed's wide noise covers another seed's
    difference (the same maxima on both sides), a difference past twice every seed's noise fails
    naming its seed and step, and a NaN in any seed fails."""
    verdict = mods[1].seeds_verdict
    ref = [10.0, 9.0, 8.0]
    quiet = {"ours": [10.0, 9.0, 8.05], "ref": ref, "others": {"sdpa": [10.0, 9.0, 8.01]}}   # alone: 0.05 > 0.02
    loud = {"ours": [10.0, 9.0, 8.0], "ref": ref, "others": {"sdpa": [10.0, 9.03, 8.0]}}     # noise 0.03
    ok = verdict([quiet, loud])
    assert ok["passed"] and ok["bound"] == pytest.approx(0.06 + 1e-5) and ok["worst_seed"] == 0
    assert ok["seeds"] == 2 and len(ok["per_seed"]) == 2 and not verdict([quiet])["passed"]
    far = {"ours": [10.0, 9.1, 8.0], "ref": ref, "others": {"sdpa": [10.0, 9.0, 8.0]}}
    bad = verdict([loud, far])
    assert not bad["passed"] and bad["worst_seed"] == 1 and "seed 1, step 1" in bad["reason"]
    nan = {"ours": [10.0, math.nan, 8.0], "ref": ref, "others": {"sdpa": [10.0, 9.0, 8.0]}}
    assert not verdict([loud, nan])["passed"] and "NaN" in verdict([loud, nan])["reason"]
    with pytest.raises(ValueError, match="at least one seed"):
        verdict([])


def test_grad_verdict(mods):
    g = torch.tensor([1.0, -2.0, 4.0])
    ref = {"w": g}
    assert mods[1].grad_verdict({"w": g + 0.01}, ref, {"w": g - 0.01})["passed"]
    out = mods[1].grad_verdict({"w": g + 0.1}, ref, {"w": g - 0.01})
    assert not out["passed"] and out["params"]["w"]["ours_rel"] == pytest.approx(0.025)
    assert not mods[1].grad_verdict({"w": g * math.nan}, ref, {"w": g})["passed"]


def test_backward_kernels_names_the_cubridge_backward(mods):
    bk = mods[1].backward_kernels
    assert bk(["fa2_bwd_dkdv", "fa2_bwd_dq", "gemm", "fa2_sm80_fwd"]) == {
        "cubridge_backward": "fa2_bwd_sm80", "kernels": ["fa2_bwd_dkdv", "fa2_bwd_dq"]}
    assert bk(["fa3_bwd_sm90", "fa3_bwd_dq_convert_tiled"])["cubridge_backward"] == "fa3_bwd_sm90"
    assert bk(["triton_tem_fused_flex_attention_backward_0"])["cubridge_backward"] is None


def test_speedups_and_bars(mods):
    rows = [{"system": s, "variant": "prefixlm", "N": 8192, "direction": d, "ms": ms}
            for s, d, ms in [("cubridge", "train_step", 10.0), ("flex_triton", "train_step", 12.0),
                             ("cubridge", "forward", 4.0), ("sdpa_bool_mask", "forward", 9.0),
                             ("flex_flash", "forward", 3.9)]]
    got = {(s["direction"], s["baseline"]): (round(s["speedup"], 3), s["bar"], s["meets_bar"])
           for s in mods[1].speedups(rows)}
    assert got == {("train_step", "flex_triton"): (1.2, 1.3, False), ("forward", "sdpa_bool_mask"): (2.25, 2.0, True),
                   ("forward", "flex_flash"): (0.975, 1.0, False)}


def test_call_kwargs(mods):
    ck, masks = mods[1].call_kwargs, {}
    assert ck("cubridge_nomask", "prefixlm", 8, masks, "cpu") == {} and ck("sdpa", "causal", 8, masks, "cpu") == {}
    spec = ck("cubridge", "prefixlm", 8, masks, "cpu")["attention_mask"]
    assert spec.shape == (2, 1, 8, 8) and not any(spec.stride()) and ck("cubridge", "causal", 8, masks, "cpu") == {
        "attention_mask": spec}                                         # a spec_mask, built once per length
    m = ck("sdpa_bool_mask", "prefixlm", 8, masks, "cpu")["attention_mask"]
    assert m.shape == (2, 1, 8, 8) and bool(m[0, 0, 0, 3]) and not bool(m[0, 0, 4, 5]) and bool(m[0, 0, 5, 4])
    assert ck("sdpa_bool_mask", "prefixlm", 8, masks, "cpu")["attention_mask"] is m      # built once
    with pytest.raises(ValueError, match="unknown system"):
        ck("fa4", "prefixlm", 8, masks, "cpu")
    impl = mods[1].implementation
    runs = {"prefixlm": "ours", "prefixlm@128x176s2p": "ours_176"}
    assert impl("cubridge", runs, "prefixlm") == "ours" and impl("cubridge@128x176s2p", runs, "prefixlm") == "ours_176"
    assert ck("cubridge@128x176s2p", "prefixlm", 8, masks, "cpu")["attention_mask"] is spec


def test_bench_peers_model_shape_plan(mods):
    bp = mods[2]
    args = bp.parse(["--n", "8192", "--dense-d", "--variants", "prefixlm", "--variant-heads", "gqa16/4", "mha",
                     "--layout", "bhnd", "bnhd"])
    assert bp.plan(args) == [("prefixlm", 128, 16, 4, 8192, "bhnd"), ("prefixlm", 128, 16, 4, 8192, "bnhd"),
                             ("prefixlm", 128, 32, 32, 8192, "bhnd"), ("prefixlm", 128, 32, 32, 8192, "bnhd")]
    assert bp.parse([]).layout == ["bhnd"] and bp.plan(bp.parse(["--quick"]))[0] == ("causal", 128, 32, 32, 1024, "bhnd")


# ------------------------------------------------------------------ a tiny model trains through the op
HQ, HKV, D = 4, 2, 64


def _probs(q, k, scale):
    """float64 prefix-LM attention probabilities (prefix N // 2), [B, Hq, N, N]; K already repeated."""
    n = q.shape[2]
    i = torch.arange(n)
    mask = (i[None, :] <= i[:, None]) | (i[None, :] < n // 2)
    return torch.softmax((q @ k.transpose(-2, -1) * scale).masked_fill(~mask, -math.inf), -1)


def _prefixlm(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    return _probs(q, k.repeat_interleave(group, 1), scale) @ v.repeat_interleave(group, 1)


def _prefixlm_grads(dout, q, k, v, scale):
    """The softmax-attention backward by hand (the op's backward runs below autograd, where no
    graph is recorded): dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = dS K s, dK = dS^T Q s,
    K / V gradients summed over each GQA group."""
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    p = _probs(q, kr, scale)
    out = p @ vr
    ds = p * (dout @ vr.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
    fold = lambda t: t.unflatten(1, (k.shape[1], group)).sum(2)    # noqa: E731
    return ds @ kr * scale, fold(ds.transpose(-2, -1) @ q * scale), fold(p.transpose(-2, -1) @ dout)


@pytest.fixture(scope="module")
def prefix_op(tmp_path_factory):
    calls = {"forward": 0, "backward": 0}

    def launch(q, k, v, out, lse, scale):
        calls["forward"] += 1
        out.copy_(_prefixlm(q.double(), k.double(), v.double(), scale))
        lse.zero_()

    def backward_impl(dout, q, k, v, out, lse, scale, rt):
        calls["backward"] += 1
        grads = _prefixlm_grads(*(t.double() for t in (dout, q, k, v)), scale)
        return tuple(g.to(q.dtype).contiguous() for g in grads)
    run = replayed_run(tmp_path_factory.mktemp("llama_train"), "prefixlm",
                       f"{{heads_q: {HQ}, heads_kv: {HKV}, head_dim: {D}, lengths: [1024]}}", trials=2)
    attn = cpu_op(run.output, launch, backward_impl)
    attn.calls = calls
    return attn


def test_hand_backward_matches_autograd():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 10, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(1, 4, 10, 8, generator=g, dtype=torch.float64)
    _prefixlm(q, k, v, 0.3).backward(dout)
    for got, want in zip(_prefixlm_grads(dout, q.detach(), k.detach(), v.detach(), 0.3), (q.grad, k.grad, v.grad)):
        assert torch.allclose(got, want, atol=1e-12)


def test_tiny_llama_trains_through_the_op_like_sdpa_with_the_mask(mods, prefix_op):
    from cubridge.integrations.transformers import register
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    name = register(prefix_op, "cubridge_llama_client_test")
    prefix_op.calls.update(forward=0, backward=0)   # the op is shared by this module's tests (any order)
    try:
        _train_tiny(mods[1], name, prefix_op)
    finally:      # no registration left behind for later tests
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def _train_tiny(llama, name, prefix_op):
    shape = {"hq": HQ, "hkv": HKV, "d": D, "layers": 2, "vocab": 96, "ffn": 256}
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 96, (2, 48), generator=gen) for _ in range(2)]
    curves, grads, masks = {}, {}, {}
    for system in ("cubridge", "sdpa_bool_mask"):
        model = llama.make_model("cpu", train=True, **shape)
        model.set_attn_implementation(llama.implementation(system, {"prefixlm": name}, "prefixlm"))
        params = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
        curves[system], grads[system] = llama.loss_curve(model, batches, 6, 1e-3, params,
                                                         **llama.call_kwargs(system, "prefixlm", 48, masks, "cpu"))
    assert prefix_op.calls == {"forward": 2 * 6, "backward": 2 * 6}       # 2 layers x 6 steps, each way
    ours, sdpa = curves["cubridge"], curves["sdpa_bool_mask"]
    assert ours[4] < ours[0] and ours[5] < ours[1] and all(math.isfinite(x) for x in ours)       # it trains
    assert max(abs(a - b) for a, b in zip(ours, sdpa)) < 0.02 * ours[0]     # float64 vs bf16 attention
    assert all(float(g.abs().max()) > 0 for g in grads["cubridge"].values())
    for p, g in grads["cubridge"].items():
        r = grads["sdpa_bool_mask"][p]
        assert float((g - r).abs().max()) <= 0.1 * float(r.abs().max()), p


def test_capture_gives_the_models_attention_inputs(mods):
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    llama = mods[1]
    model = llama.make_model("cpu", hq=4, hkv=2, d=32, layers=1, vocab=64, ffn=64)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    module, q, k, v, extra = llama.capture_attention(model, ids)
    assert model.config._attn_implementation == "sdpa"
    assert "expkit_capture_probe" not in ALL_ATTENTION_FUNCTIONS._global_mapping
    assert "expkit_capture_probe" not in AttentionMaskInterface._global_mapping
    # transformers' projections: [B, N, H, D] memory seen as [B, H, N, D]
    assert q.shape == (2, 4, 24, 32) and q.stride() == (24 * 4 * 32, 32, 4 * 32, 1)
    assert k.shape == (2, 2, 24, 32) and k.stride() == (24 * 2 * 32, 32, 2 * 32, 1) and v.stride() == k.stride()
    out = llama.attention_call("sdpa", module, q, k, v, None, extra, is_causal=True)()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True, scale=module.scaling)
    assert out.shape == (2, 24, 4, 32) and torch.allclose(out.float(), ref.transpose(1, 2).float(), atol=1e-2)


def test_dry_run_of_the_whole_flow_on_cpu(mods, prefix_op, monkeypatch, tmp_path):
    """llama_client's forward, layer-attention and train parts end to end on CPU: a tiny model,
    the stubbed prefixlm op for both runs, no Flex (its backends are GPU compiles), a timer that
    calls each system once. Checks the plumbing and the JSON, not speed."""
    from cubridge.runtime.timing import Timing
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from cubridge.integrations.transformers import register
    client, llama = mods[0], mods[1]
    shape = {"hq": HQ, "hkv": HKV, "d": D, "layers": 2, "vocab": 96, "ffn": 256}

    def bench(fns, warmup=2, reps=5):
        for fn in fns:
            fn()
        return [Timing(1.0 + i, 1.0 + i, 1.0 + i, reps) for i in range(len(fns))]
    monkeypatch.setattr(client, "DEVICE", "cpu")
    monkeypatch.setattr(client, "CAUSAL_N", (128,))
    monkeypatch.setattr(client, "PREFIX_N", 128)
    monkeypatch.setattr(client, "VOCAB", 96)
    monkeypatch.setattr(client, "FLEX", {"auto": ()})
    monkeypatch.setattr(client, "FLEX_TRAIN", {"auto": ()})
    monkeypatch.setattr(client, "bench_round_robin", bench)
    monkeypatch.setattr(client, "make_model",
                        lambda device, train=False, seed=0: llama.make_model(device, train=train, seed=seed, **shape))
    prefix_op.calls.update(forward=0, backward=0)
    name = register(prefix_op, "cubridge_llama_client_dry")
    try:
        args = client.parse(["--out", str(tmp_path / "r.json"), "--train", "--train-n", "128", "--steps", "3",
                             "--train-variants", "prefixlm", "--reps", "2"])
        result = {"rows": [], "checks": [], "system_errors": {}, "env": llama.env_opt_ins()}
        rc = client.run_parts(args, {"causal": name, "prefixlm": name}, result)
        layer_args = client.parse(["--out", str(tmp_path / "l.json"), "--layer-only", "--fwd-variants", "prefixlm",
                                   "--layer-reps", "2"])
        layer_rc = client.run_parts(layer_args, {"prefixlm": name}, {"rows": [], "checks": [], "system_errors": {},
                                                                     "env": {}})
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and "errors" not in saved, saved.get("errors")
    layer = json.loads((tmp_path / "l.json").read_text())      # --layer-only: no model forward, no check
    assert layer_rc == 0 and not layer["checks"] and {r["direction"] for r in layer["rows"]} == {"layer_attention"}
    got = {(r["direction"], r["variant"], r["system"]) for r in saved["rows"]}
    assert got == {("forward", "causal", "sdpa"), ("forward", "causal", "cubridge"), ("forward", "causal", "cubridge_nomask"),
                   ("forward", "prefixlm", "sdpa_bool_mask"), ("forward", "prefixlm", "cubridge"),
                   ("forward", "prefixlm", "cubridge_nomask"), ("forward", "prefixlm", "none"),
                   ("layer_attention", "prefixlm", "sdpa_bool_mask"), ("layer_attention", "prefixlm", "cubridge"),
                   ("layer_attention", "prefixlm", "cubridge_bhnd"),
                   ("layer_attention", "prefixlm", "cubridge_q_bhnd"),
                   ("layer_attention", "prefixlm", "cubridge_kv_bhnd"), ("train_step", "prefixlm", "none"),
                   ("train_step", "prefixlm", "cubridge"), ("train_step", "prefixlm", "sdpa_bool_mask")}
    train = {r["system"]: r for r in saved["rows"] if r["direction"] == "train_step"}
    for system, r in train.items():      # one profiled step each, both attention ranges seen per layer
        assert r["parts"]["marks"] == {"attention_forward": 2, "attention_backward": 2}, (system, r)
    assert saved["train_bound"]["prefixlm"]["free_attention_ms"] == train["none"]["ms"]
    fwd = {r["system"]: r["ms"] for r in saved["rows"] if r["direction"] == "forward" and r["variant"] == "prefixlm"}
    fb = saved["forward_bound"]["prefixlm"]      # the 2x bar's bound: SDPA + mask over free attention, same run
    assert fb["free_attention_ms"] == fwd["none"] and fb["sdpa_bool_mask_ms"] == fwd["sdpa_bool_mask"]
    assert fb["max_speedup_vs_sdpa_bool_mask"] == round(fwd["sdpa_bool_mask"] / fwd["none"], 4)
    assert fb["bar_2x_reachable"] is (fwd["sdpa_bool_mask"] / fwd["none"] >= 2.0)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert not {"expkit_free_attention", "expkit_flex_nolse"} & set(ALL_ATTENTION_FUNCTIONS._global_mapping)
    prefix = [c for c in saved["checks"] if c["variant"] == "prefixlm"][0]
    assert prefix["cubridge"]["passed"] is True                 # the float64 stub against the float64 golden
    layer = {r["system"]: r for r in saved["rows"] if r["direction"] == "layer_attention"}
    assert layer["cubridge"]["max_diff_vs_sdpa_mask"] < 0.05 and layer["cubridge_bhnd"]["max_diff_vs_sdpa_mask"] < 0.05
    assert saved["model_layout"]["q"]["stride"] == [128 * HQ * D, D, HQ * D, 1]
    curves = saved["loss_curves"]
    assert set(curves["curves"]) == {"cubridge", "sdpa_bool_mask"} and len(curves["curves"]["cubridge"]) == 3
    assert curves["verdict"]["passed"] is None and "Flex" in curves["verdict"]["reason"]
    assert len(curves["seeds"]) == 1 and curves["seeds"][0]["curves"] == curves["curves"]   # no Flex: seed 0 only
    assert prefix_op.calls["backward"] > 0 and any(s["baseline"] == "sdpa_bool_mask" for s in saved["speedups"])


def test_the_llama_tuning_config_fits_the_clients_model(mods):
    from cubridge.config import load_config
    cfg = load_config(EXPERIMENTS.parent / "configs" / "h100_prefixlm_llama.yaml")
    llama = mods[1]
    assert (cfg.spec, cfg.shapes.heads_q, cfg.shapes.heads_kv, cfg.shapes.head_dim) == ("prefixlm", llama.HQ,
                                                                                          llama.HKV, llama.D)
    assert [(t.batch, t.seqlen) for t in cfg.shapes.targets] == [(llama.B, 8192)] and cfg.backward


def test_autocast_training_through_the_op(mods, prefix_op):
    """float32 weights under bf16 autocast, as users train: the rotary embedding hands q / k over in
    float32, the integration casts them to the kernel's bf16 (a bf16 op would refuse float32), and
    gradients reach the float32 weights."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from cubridge.integrations.transformers import register
    llama = mods[1]
    name = register(prefix_op, "cubridge_llama_client_autocast")
    try:
        model = llama.make_model("cpu", train=True, hq=HQ, hkv=HKV, d=D, layers=1, vocab=96, ffn=64).float()
        model.set_attn_implementation(name)
        ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(2))
        before = prefix_op.calls["backward"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad
        assert prefix_op.calls["backward"] == before + 1 and grad.dtype == torch.float32 and grad.abs().max() > 0
        with pytest.raises(Exception, match="float32"):       # outside autocast the dtype check still speaks
            model(ids, use_cache=False)
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def test_curves_judge_every_seed_together(mods, monkeypatch):
    """llama_client.curves over three seeds (seed_curves stubbed: the curves and gradients of each
    seed given): one verdict over all seeds, the step-0 gradients judged per seed, seed 0's curves
    kept as "curves", and the Flex backend that trained in seed 0 reused after."""
    client = mods[0]
    g = {"w": torch.tensor([1.0, 2.0])}
    used = []

    def fake(args, registered, masks, seed, flex, errors):
        used.append(flex)
        wobble = 0.01 * (seed + 1)
        return ({"cubridge": [10.0, 9.0 + wobble], "flex_triton": [10.0, 9.0], "sdpa_bool_mask": [10.0, 9.0 - wobble]},
                {"cubridge": g, "flex_triton": g, "sdpa_bool_mask": g}, "flex_triton")
    monkeypatch.setattr(client, "seed_curves", fake)
    args = client.parse(["--out", "x.json", "--train", "--seeds", "3", "--steps", "2"])
    out = client.curves(args, {}, {})
    assert used == [None, "flex_triton", "flex_triton"] and out["ref"] == "flex_triton"
    assert out["verdict"]["passed"] and out["verdict"]["seeds"] == 3
    assert out["verdict"]["max_diff"] == pytest.approx(0.03) and out["verdict"]["noise"] == pytest.approx(0.03)
    assert out["grad_step0"]["passed"] and len(out["grad_step0"]["per_seed"]) == 3
    assert out["curves"] == out["seeds"][0]["curves"] and [s["seed"] for s in out["seeds"]] == [0, 1, 2]
