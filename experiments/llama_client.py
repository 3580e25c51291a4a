"""A user's model with the tuned kernel: a random-init transformers Llama (4 layers, 16 q / 4 kv
heads, D = 128, hidden 2048, batch 2) whose attention is a cubridge run, against the same model
with SDPA (and FlexAttention for prefixlm). H100; issue 15's bars:

    causal   at 2k and 8k: forward at least as fast as SDPA; logits within the verification rule
             (golden = the model in float64 with SDPA's math path, ref = the bf16 model with SDPA)
    prefixlm at 8k:        >= 2x the model with SDPA + a boolean prefix-LM mask, and at least as fast
                           as FlexAttention (FLASH backend where it runs, else Triton; block mask
                           built once per shape)

Run directories come from cubridge.op.build (default tile configs, no Optuna). Forward times:
runtime.timing.bench_round_robin over the systems (eval, no_grad, use_cache=False), median.
Usage: python3 experiments/llama_client.py --out llama.json
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from cubridge import rule
from cubridge.integrations.transformers import register
from cubridge.op import build
from cubridge.runtime.timing import bench_round_robin

B, HQ, HKV, D, LAYERS, VOCAB = 2, 16, 4, 128, 4, 32000


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HQ * D, intermediate_size=5632, num_hidden_layers=LAYERS,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=16384)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


_MODELS: dict = {}


def model_for(impl: str):
    """One model per attention implementation, all with the same weights (same seed), so timing
    never switches an implementation between calls."""
    if impl not in _MODELS:
        _MODELS[impl] = make_model()
        _MODELS[impl].set_attn_implementation(impl)
    return _MODELS[impl]


def logits(impl, ids, **kw):
    with torch.no_grad():
        return model_for(impl)(ids, use_cache=False, **kw).logits


def forward_fn(impl, ids, **kw):
    model = model_for(impl)

    def run():
        with torch.no_grad():
            return model(ids, use_cache=False, **kw).logits
    return run


def prefix_mask(n: int) -> torch.Tensor:
    i = torch.arange(n, device="cuda")
    return ((i[None, :] <= i[:, None]) | (i[None, :] < n // 2))[None, None].expand(B, 1, n, n)


def golden_check(ids, ours_logits, ref_logits, **kw) -> dict:
    """The verification rule on the logits: golden = the float64 model (SDPA math path)."""
    try:
        m64 = copy.deepcopy(model_for("sdpa")).double()
        with torch.no_grad():
            golden = m64(ids, use_cache=False, **kw).logits
        del m64
        verdict = rule.compare(ours_logits, golden, ref_logits)
        return {"passed": verdict.passed, "max_err": verdict.max_err, "bound": verdict.bound, "reason": verdict.reason}
    except torch.cuda.OutOfMemoryError as e:
        return {"passed": None, "reason": f"golden out of memory: {str(e)[:120]}"}
    finally:
        torch.cuda.empty_cache()


def flex_block_mask(n: int):
    """The prefix-LM block mask for transformers' flex_attention, built once for this shape."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return (kv <= q) | (kv < n // 2)
    block = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    return block


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llama_client_"))
    t0 = time.time()
    names = {s: register(build(s, root / s, heads_q=HQ, heads_kv=HKV, head_dim=D)) for s in ("causal", "prefixlm")}
    print(f"built and registered {sorted(names.values())} in {time.time() - t0:.0f} s", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": {
        "layers": LAYERS, "heads_q": HQ, "heads_kv": HKV, "head_dim": D, "batch": B, "vocab": VOCAB}, "rows": []}
    for n in (2048, 8192):
        ids = torch.randint(0, VOCAB, (B, n), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
        ours, ref = logits(names["causal"], ids), logits("sdpa", ids)
        check = golden_check(ids, ours, ref)
        t_sdpa, t_ours = bench_round_robin([forward_fn("sdpa", ids), forward_fn(names["causal"], ids)],
                                           reps=args.reps)
        result["rows"].append({"variant": "causal", "N": n, "sdpa_ms": t_sdpa.median_ms, "cubridge_ms": t_ours.median_ms,
                               "speedup_vs_sdpa": t_sdpa.median_ms / t_ours.median_ms, "logits_rule": check})
        print(result["rows"][-1], flush=True)
        del ours, ref
        torch.cuda.empty_cache()
    n = 8192
    ids = torch.randint(0, VOCAB, (B, n), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    mask = prefix_mask(n)
    ours, ref = logits(names["prefixlm"], ids), logits("sdpa", ids, attention_mask=mask)
    check = golden_check(ids, ours, ref, attention_mask=mask)
    del ours, ref
    torch.cuda.empty_cache()
    systems = {"sdpa_bool_mask": forward_fn("sdpa", ids, attention_mask=mask),
               "cubridge": forward_fn(names["prefixlm"], ids)}
    block, flex_backend = flex_block_mask(n), None
    for backend, kw in (("FLASH", {"kernel_options": {"BACKEND": "FLASH"}}), ("TRITON", {})):
        try:
            fn = forward_fn("flex_attention", ids, attention_mask=block, **kw)
            fn()
            systems[f"flex_{backend.lower()}"], flex_backend = fn, backend
            break
        except Exception as e:   # noqa: BLE001 - a backend this machine lacks is recorded
            result.setdefault("flex_errors", {})[backend] = f"{type(e).__name__}: {str(e)[:300]}"
    times = dict(zip(systems, bench_round_robin(list(systems.values()), reps=args.reps)))
    row = {"variant": "prefixlm", "N": n, **{f"{k}_ms": t.median_ms for k, t in times.items()},
           "flex_backend": flex_backend, "logits_rule": check}
    row["speedup_vs_sdpa_mask"] = times["sdpa_bool_mask"].median_ms / times["cubridge"].median_ms
    if flex_backend:
        row["speedup_vs_flex"] = times[f"flex_{flex_backend.lower()}"].median_ms / times["cubridge"].median_ms
    result["rows"].append(row)
    print(row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"{'variant':<9} {'N':>5} {'ours ms':>9} {'baseline':<16} {'base ms':>9} {'speedup':>8} rule")
    for r in result["rows"]:
        for base in [k[:-3] for k in r if k.endswith("_ms") and not k.startswith("cubridge")]:
            print(f"{r['variant']:<9} {r['N']:>5} {r['cubridge_ms']:9.3f} {base:<16} {r[base + '_ms']:9.3f} "
                  f"{r[base + '_ms'] / r['cubridge_ms']:7.2f}x {r['logits_rule'].get('passed')}")


if __name__ == "__main__":
    main()
