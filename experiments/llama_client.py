"""A user's model with the tuned kernel: a random-init transformers Llama (4 layers, 16 q / 4 kv
heads, D = 128, hidden 2048, batch 2, bf16) whose attention is a cubridge run, against the same
model with SDPA and FlexAttention. H100. The bars:

  forward (issue 15)    causal 2k / 8k: at least as fast as SDPA, logits within the verification
                        rule (golden = the model in float64 with SDPA's math path, ref = the bf16
                        model with SDPA); prefixlm 8k: >= 2x SDPA + a boolean prefix-LM mask and
                        >= 1x FlexAttention (FLASH backend where it runs, else Triton; block mask
                        built once per shape). Flex's logits are checked against the golden too.
  --train (issue 17)    one training step (zero_grad, forward + loss, backward, AdamW step; bf16
                        weights, eager; expkit/llama.py on autocast) with prefixlm: >= 1.3x
                        the same step with FlexAttention (FLASH where its backward runs, else
                        Triton); causal against SDPA. And 50-step loss curves for cubridge, Flex
                        and SDPA + mask, per seed (--seeds: each its own init and data stream of
                        random tokens, 4 batches cycled): passed iff the largest max_t |cubridge -
                        Flex| over the seeds <= 2 * the largest max_t |SDPA - Flex| over the seeds
                        + 1e-5 (two independent kernels of the same math set the bf16 noise;
                        expkit.llama.seeds_verdict), with the step-0 gradients of layer 0's
                        attention projections judged per seed the same way.
  layer attention       the forward gap isolated: layer 0's attention call alone, as the model makes
                        it (its own q, k, v: [B, N, H, D] memory from the projections), per system,
                        again on contiguous [B, H, N, D] copies (the layout's share), and for ours at
                        the tile configs of --alt-configs (the default is 128x128s2p); the prefixlm
                        forward times the model at those configs too ("cubridge@LABEL" rows).

Run directories come from cubridge.op.build (default tile configs, no Optuna), prefixlm's from
--prefixlm-run DIR where given (a tuned run: configs/h100_prefixlm_llama.yaml). Times:
cubridge.runtime.timing.bench_round_robin over the systems (L2 flushed, median). The backward
kernels that ran are read from one profiled step (torch.profiler's CUDA kernel names), with the
backward opt-in environment (CUBRIDGE_HOPPER_VARIANT_BWD, CUBRIDGE_HOPPER_BWD) recorded.

    python3 experiments/llama_client.py --out llama.json                      # forward (issue 15)
    python3 experiments/llama_client.py --out llama.json --train --reps 5     # forward + train step
    python3 experiments/llama_client.py --out l.json --fwd-variants prefixlm --alt-configs 128x176s2p
    CUBRIDGE_HOPPER_VARIANT_BWD=1 python3 experiments/llama_client.py --out t.json --train --no-forward
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
from expkit.llama import (first_flex, B, D, HKV, HQ, LAYERS, MAX_POSITIONS, VOCAB, attention_call, backward_kernels,
                          call_kwargs, capture_attention, env_opt_ins, grad_verdict, implementation, loss_curve, make_model,
                          optimizer, parse_config, profiled_kernels, seeds_verdict, speedups, train_step,
                          versions)

from cubridge import rule
from cubridge.runtime.timing import bench_round_robin, compiled_flex_attention

DEVICE = "cuda"          # the CPU tests dry-run the flow with "cpu", a tiny model and a stubbed op
CAUSAL_N, PREFIX_N = (2048, 8192), 8192      # forward lengths
FLEX = {"auto": ("flex_flash", "flex_triton"), "flash": ("flex_flash",), "triton": ("flex_triton",),
        "both": ("flex_flash", "flex_triton")}
# training: transformers' flex_attention asks for the LSE, which Flex-FLASH's backward refuses (session 10);
# flex_flash_nolse is the same Flex call without it (expkit.llama_train.FLEX_NOLSE)
FLEX_TRAIN = {"auto": ("flex_flash", "flex_flash_nolse", "flex_triton"), "flash": ("flex_flash", "flex_flash_nolse"),
              "triton": ("flex_triton",), "both": ("flex_flash", "flex_flash_nolse", "flex_triton")}
GRAD_PARAMS = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per system (round-robin)")
    ap.add_argument("--train", action="store_true", help="also time the training step and run the loss curves")
    ap.add_argument("--no-forward", action="store_true", help="skip the forward comparison")
    ap.add_argument("--fwd-variants", nargs="+", default=["causal", "prefixlm"], choices=["causal", "prefixlm"],
                    help="forward comparisons to run (prefixlm includes layer 0's attention alone)")
    ap.add_argument("--copy-ab", action="store_true",
                    help="also time cubridge with its backward copying [B, N, H, D] views (CUBRIDGE_BWD_BNHD=0)")
    ap.add_argument("--train-n", type=int, default=8192, help="sequence length of the training step")
    ap.add_argument("--train-variants", nargs="+", default=["prefixlm", "causal"], choices=["prefixlm", "causal"])
    ap.add_argument("--steps", type=int, default=50, help="loss-curve steps (prefixlm)")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate of the loss curves")
    ap.add_argument("--seeds", type=int, default=3,
                    help="loss-curve seeds (init and data), the noise bound's sample; 0: no loss curves")
    ap.add_argument("--alt-configs", nargs="*", default=[], metavar="BMxBNsSp",
                    help="prefixlm tile configs timed beside the default (forward and layer attention)")
    ap.add_argument("--prefixlm-run", type=Path, metavar="DIR",
                    help="a tuned prefixlm run directory (heads 16 / 4, D 128, bf16) instead of the default-config build")
    ap.add_argument("--flex-backend", default="auto", choices=list(FLEX),
                    help="auto: FLASH where it runs (its backward too, for training), else Triton; "
                         "both: every backend that runs is timed (loss curves: the first)")
    ap.add_argument("--layer-reps", type=int, default=30, help="timed calls per system of layer 0's attention alone")
    ap.add_argument("--layer-only", action="store_true",
                    help="prefixlm forward: layer 0's attention alone (layouts, --alt-configs), not the model")
    args = ap.parse_args(argv)
    if min(args.reps, args.layer_reps) < 1:
        ap.error(f"--reps {args.reps} / --layer-reps {args.layer_reps}: time at least one call per system")
    if args.seeds < 0:
        ap.error(f"--seeds {args.seeds}: 0 (no loss curves) or more")
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: a loss curve needs at least 2 steps")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        ap.error(f"--lr {args.lr}: a positive finite learning rate")
    if not 128 <= args.train_n <= MAX_POSITIONS or args.train_n % 128:
        ap.error(f"--train-n {args.train_n}: a multiple of 128 in [128, {MAX_POSITIONS}] (the model's max positions)")
    for label in args.alt_configs:
        try:
            parse_config(label)
        except ValueError as e:
            ap.error(f"--alt-configs: {e}")
    if args.prefixlm_run is not None and not (args.prefixlm_run / "dispatch.json").is_file():
        ap.error(f"--prefixlm-run {args.prefixlm_run}: no dispatch.json there (a run directory of cubridge tune)")
    if args.no_forward and not args.train:
        ap.error("--no-forward without --train: nothing to run")
    if args.layer_only and (args.no_forward or "prefixlm" not in args.fwd_variants):
        ap.error("--layer-only times the prefixlm forward's layer attention: drop --no-forward, keep "
                 "--fwd-variants prefixlm")
    return args


# ------------------------------------------------------------------ forward
class Forward:
    """One eval model per attention implementation (same weights), so timing never switches one."""

    def __init__(self, registered):
        self.registered, self.models, self.masks = registered, {}, {}

    def model(self, impl):
        if impl not in self.models:
            self.models[impl] = make_model(DEVICE)
            self.models[impl].set_attn_implementation(impl)
        return self.models[impl]

    def fn(self, system, variant, ids):
        model = self.model(implementation(system, self.registered, variant))
        kw = call_kwargs(system, variant, ids.shape[1], self.masks, DEVICE)

        def run():
            with torch.no_grad():
                return model(ids, use_cache=False, **kw).logits
        return run

    def checks(self, variant, ids, systems, ref_system) -> dict:
        """The verification rule on each system's logits: golden = the float64 model with SDPA
        (math path), ref = `ref_system`'s bf16 logits."""
        kw = call_kwargs(ref_system, variant, ids.shape[1], self.masks, DEVICE)
        try:
            m64 = copy.deepcopy(self.model("sdpa")).double()
            with torch.no_grad():
                golden = m64(ids, use_cache=False, **kw).logits
            del m64
            ref = self.fn(ref_system, variant, ids)()
            out = {}
            for system in systems:
                v = rule.compare(self.fn(system, variant, ids)(), golden, ref)
                out[system] = {"passed": v.passed, "max_err": v.max_err, "bound": v.bound, "reason": v.reason}
            return out
        except torch.cuda.OutOfMemoryError as e:
            return {s: {"passed": None, "reason": f"golden out of memory: {str(e)[:120]}"} for s in systems}
        finally:
            torch.cuda.empty_cache()


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, n), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def flex_systems(args, table: dict, try_fn, errors: dict) -> list:
    """The Flex systems to time: the first of table[--flex-backend] that runs, or (both) every one."""
    found = []
    for system in table[args.flex_backend]:
        if first_flex((system,), try_fn, errors):
            found.append(system)
            if args.flex_backend != "both":
                break
    return found


def run_forward(args, registered, result) -> None:
    fwd = Forward(registered)
    for n in CAUSAL_N if "causal" in args.fwd_variants and not args.layer_only else ():
        ids = random_ids(n, n)
        result["checks"].append({"direction": "forward", "variant": "causal", "N": n,
                                 **fwd.checks("causal", ids, ["cubridge"], "sdpa")})
        timed(result, "forward", "causal", n, {s: fwd.fn(s, "causal", ids) for s in ("sdpa", "cubridge", "cubridge_nomask")},
              args.reps)
    if "prefixlm" not in args.fwd_variants:
        return
    n = PREFIX_N
    ids = random_ids(n, 7)
    flexes = flex_systems(args, FLEX, lambda s: fwd.fn(s, "prefixlm", ids)(),
                          result["system_errors"].setdefault("forward", {}))
    if args.layer_only:
        layer_attention(args, fwd, ids, flexes, result)
        return
    systems = ["sdpa_bool_mask", "cubridge"] + flexes
    systems += [f"cubridge@{label}" for label in args.alt_configs]     # the model at other tiles too
    systems += ["cubridge_nomask"]     # no attention_mask: transformers' packed-sequence sync per forward
    result["checks"].append({"direction": "forward", "variant": "prefixlm", "N": n,
                             **fwd.checks("prefixlm", ids, [s for s in systems if s != "sdpa_bool_mask"],
                                          "sdpa_bool_mask")})
    from expkit.llama_train import register_train_systems, unregister
    names = register_train_systems()     # "none": free attention, the floor of any kernel (not checked)
    try:
        timed(result, "forward", "prefixlm", n,
              {s: fwd.fn(s, "prefixlm", ids) for s in systems + ["none"]}, args.reps)
    finally:
        unregister(*set(names.values()))
    result.setdefault("forward_bound", {})["prefixlm"] = forward_bound(result["rows"], n)
    layer_attention(args, fwd, ids, flexes, result)


def forward_bound(rows: list, n: int) -> dict:
    """What free attention allows the prefixlm forward against SDPA + boolean mask (issue 15's 2x bar):
    the model's other work (GEMMs, elementwise) alone, timed in the same round-robin as the rest."""
    ms = {r["system"]: r["ms"] for r in rows if r["direction"] == "forward" and r["variant"] == "prefixlm"
          and r["N"] == n}
    if "none" not in ms or "sdpa_bool_mask" not in ms:
        return {}
    free, sdpa = ms["none"], ms["sdpa_bool_mask"]
    out = {"free_attention_ms": free, "sdpa_bool_mask_ms": sdpa,
           "max_speedup_vs_sdpa_bool_mask": round(sdpa / free, 4), "bar_2x_reachable": sdpa / free >= 2.0,
           "attention_cost_ms": {s: round(t - free, 3) for s, t in ms.items() if s != "none"}}
    if "cubridge" in ms:
        out["cubridge_speedup_vs_sdpa_bool_mask"] = round(sdpa / ms["cubridge"], 4)
    return out


def layer_attention(args, fwd, ids, flexes: list, result) -> None:
    """The forward gap, isolated: layer 0's attention call alone, as the model makes it (its own
    q, k, v: [B, N, H, D] memory), per system, and again on contiguous [B, H, N, D] copies (the
    layout's share; ours also with only q or only k / v copied: O follows q's memory order, so
    cubridge_q_bhnd moves the Q load and the O store, cubridge_kv_bhnd the K / V loads); outputs
    compared with SDPA + mask's. GPU time only (bench_round_robin hides the host path)."""
    n, name = ids.shape[1], fwd.registered["prefixlm"]
    module, q, k, v, extra = capture_attention(fwd.model("sdpa"), ids)
    result["model_layout"] = {t: {"shape": list(x.shape), "stride": list(x.stride())} for t, x in zip("qkv", (q, k, v))}
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    mask = call_kwargs("sdpa_bool_mask", "prefixlm", n, fwd.masks, DEVICE)["attention_mask"]
    fns = {"sdpa_bool_mask": attention_call("sdpa", module, q, k, v, mask, extra),
           "cubridge": attention_call(name, module, q, k, v, None, extra),
           "cubridge_bhnd": attention_call(name, module, qc, kc, vc, None, extra),
           "cubridge_q_bhnd": attention_call(name, module, qc, k, v, None, extra),
           "cubridge_kv_bhnd": attention_call(name, module, q, kc, vc, None, extra)}
    for label in args.alt_configs:    # the same kernel at other tiles (default: 128x128s2p)
        fns[f"cubridge_{label}"] = attention_call(fwd.registered[f"prefixlm@{label}"], module, q, k, v, None, extra)
    for flex in flexes:
        kw = call_kwargs(flex, "prefixlm", n, fwd.masks, DEVICE)
        block = kw.pop("attention_mask")
        fns[flex] = attention_call("flex_attention", module, q, k, v, block, extra, **kw)
        fns[f"{flex}_bhnd"] = attention_call("flex_attention", module, qc, kc, vc, block, extra, **kw)
    ref, extra_rows = fns["sdpa_bool_mask"]().float(), {}
    for system, fn in list(fns.items())[1:]:
        try:
            extra_rows[system] = {"max_diff_vs_sdpa_mask": float((fn().float() - ref).abs().max())}
        except Exception as e:   # noqa: BLE001 - one system that cannot run is recorded, the rest timed
            result["system_errors"].setdefault("layer_attention", {})[system] = f"{type(e).__name__}: {str(e)[:300]}"
            del fns[system]
    timed(result, "layer_attention", "prefixlm", n, fns, args.layer_reps, extra_rows)


def timed(result, direction, variant, n, fns: dict, reps: int, extra: dict | None = None) -> None:
    times = bench_round_robin(list(fns.values()), warmup=2, reps=reps)
    for system, t in zip(fns, times):
        row = {"system": system, "variant": variant, "N": n, "direction": direction, "ms": round(t.median_ms, 4),
               "p20_ms": round(t.p20_ms, 4), "p80_ms": round(t.p80_ms, 4), **(extra or {}).get(system, {})}
        result["rows"].append(row)
        print(f"{direction:<15} {variant:<9} N={n:<6} {system:<15} {row['ms']:9.3f} ms", flush=True)


# ------------------------------------------------------------------ training
def run_train(args, registered, result) -> None:
    """Per variant: the training step of cubridge, free attention ("none": the floor any attention
    kernel reaches, expkit.llama_train), SDPA (+ mask) and the Flex backends, timed round-robin;
    one profiled step each split into attention forward / backward, GEMMs, optimizer, the rest;
    result["train_bound"]: what free attention allows against each Flex. Then the loss curves."""
    from expkit.llama_train import register_train_systems, unregister
    names = register_train_systems()
    try:
        train_parts(args, registered, result)
    finally:       # no implementation left registered behind a caller (the CPU tests)
        unregister(*set(names.values()))


def train_parts(args, registered, result) -> None:
    from expkit.llama_train import bound
    n, masks, models, trained = args.train_n, {}, {}, []
    ids = random_ids(n, 11)

    def step_of(system, variant, key=None):
        model = models[key or system] = make_model(DEVICE, train=True)
        model.set_attn_implementation(implementation(system, registered, variant))
        return train_step(model, optimizer(model, args.lr), ids, **call_kwargs(system, variant, n, masks, DEVICE))

    for variant in args.train_variants:
        fns = {"cubridge": step_of("cubridge", variant), "none": step_of("none", variant)}
        if args.copy_ab:   # the same op with its backward copying the model's [B, N, H, D] views
            fns[COPY_SYSTEM] = with_copies(step_of("cubridge", variant, key=COPY_SYSTEM))
        if variant == "prefixlm":
            fns["sdpa_bool_mask"] = step_of("sdpa_bool_mask", variant)
            made = {}
            for flex in flex_systems(args, FLEX_TRAIN, lambda s: made.setdefault(s, step_of(s, variant))(),
                                     result["system_errors"].setdefault(f"train_{variant}", {})):
                fns[flex] = made[flex]
                trained.append(flex)
            made.clear()
        else:
            fns["sdpa"] = step_of("sdpa", variant)
        extra = {system: step_profile(models[system], fn) for system, fn in fns.items()}
        for system in fns:
            if system != "cubridge":
                extra[system].pop("cubridge_backward", None)
        timed(result, "train_step", variant, n, fns, args.reps, extra)
        result.setdefault("train_bound", {})[variant] = bound(result["rows"], variant)
        fns.clear()
        models.clear()
        torch.cuda.empty_cache()
        write(args.out, result)        # kept if a later step runs past the job's time limit
    if "prefixlm" in args.train_variants and args.seeds:
        result["loss_curves"] = curves(args, registered, masks, trained[0] if trained else None)


COPY_SYSTEM = "cubridge[copy]"


def with_copies(fn):
    """fn with CUBRIDGE_BWD_BNHD=0: the op's backward copies the model's [B, N, H, D] views to contiguous
    [B, H, N, D] and back, as before session 15 made the in-place path the default."""
    from expkit import call_with_env
    from cubridge.runtime.fa3_bwd_layout import ENV
    return lambda: call_with_env({ENV: "0"}, fn)


def step_profile(model, fn) -> dict:
    """One profiled step: the backward kernels that ran (backward_kernels) and the parts
    (expkit.llama_train.step_parts); a profiler failure is recorded, not raised."""
    from expkit.llama_train import profile_step
    try:
        parts = profile_step(model, fn, Path(tempfile.mkdtemp(prefix="llama_step_")), DEVICE)
        out = backward_kernels(parts.pop("kernel_names"))
        out["parts"] = parts
        return out
    except Exception as e:   # noqa: BLE001 - the profiler is a record, not the measurement
        return {"profile_error": f"{type(e).__name__}: {str(e)[:200]}"}


def curves(args, registered, masks, flex: str | None = None) -> dict:
    """The prefixlm loss curves per seed (same init and data for every system of a seed; seed 0 is
    session 9's run) and their verdicts (expkit.llama.seeds_verdict); "curves" keeps seed 0's. The
    Flex reference: `flex` (the first that ran the training step), else the first of FLEX_TRAIN
    that trains."""
    out = {"N": args.train_n, "steps": args.steps, "lr": args.lr, "batches": 4, "seeds": [], "errors": {}}
    for seed in range(args.seeds):
        c, grads, flex = seed_curves(args, registered, masks, seed, flex, out["errors"])
        out["seeds"].append({"seed": seed, "curves": c})
        out["curves"] = out["seeds"][0]["curves"]
        runs = [{"ours": r["curves"]["cubridge"], "ref": r["curves"][flex],
                 "others": {"sdpa_bool_mask": r["curves"]["sdpa_bool_mask"]}} for r in out["seeds"]
                if flex and {"cubridge", flex, "sdpa_bool_mask"} <= set(r["curves"])]
        if len(runs) == len(out["seeds"]):
            out["ref"] = flex
            out["verdict"] = seeds_verdict(runs)
            g = grad_verdict(grads["cubridge"], grads[flex], grads["sdpa_bool_mask"])
            out.setdefault("grad_step0", {"passed": True, "per_seed": []})
            out["grad_step0"]["per_seed"].append(g)
            out["grad_step0"]["passed"] &= g["passed"]
        else:
            out["verdict"] = {"passed": None, "reason": "cubridge, a Flex backend and SDPA + mask must all train "
                                                        f"(seed {seed})"}
            break
    return out


def seed_curves(args, registered, masks, seed: int, flex, errors: dict) -> tuple[dict, dict, str | None]:
    """({system: losses}, {system: step-0 grads}, the Flex backend that trained) of one seed."""
    n = args.train_n
    batches = [random_ids(n, 23 + 1000 * seed + i) for i in range(4)]
    curves, grads = {}, {}
    for system in ["cubridge", "sdpa_bool_mask", *([flex] if flex else FLEX_TRAIN[args.flex_backend])]:
        if system.startswith("flex") and system != flex and flex:
            continue
        t0 = time.time()
        try:
            model = make_model(DEVICE, train=True, seed=seed)
            model.set_attn_implementation(implementation(system, registered, "prefixlm"))
            curves[system], grads[system] = loss_curve(model, batches, args.steps, args.lr, GRAD_PARAMS,
                                                       **call_kwargs(system, "prefixlm", n, masks, DEVICE))
            flex = flex or (system if system.startswith("flex") else None)
            print(f"loss curve seed {seed} {system:<15} {curves[system][0]:.4f} -> {curves[system][-1]:.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        except Exception as e:   # noqa: BLE001 - a Flex backend that cannot train is recorded
            errors[f"{system}@seed{seed}"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            model = None
            torch.cuda.empty_cache()
    return curves, grads, flex


# ------------------------------------------------------------------ main
def print_table(result) -> None:
    print(f"\n{'direction':<15} {'variant':<9} {'N':>5} {'baseline':<15} {'speedup':>8} {'bar':>5}")
    for s in result["speedups"]:
        bar = f"{s['bar']:.1f}" if s["bar"] else "-"
        flag = "" if s["meets_bar"] is not False else "  < bar"
        print(f"{s['direction']:<15} {s['variant']:<9} {s['N']:>5} {s['baseline']:<15} {s['speedup']:7.2f}x "
              f"{bar:>5}{flag}")
    for c in result["checks"]:
        print(f"check {c['direction']} {c['variant']} N={c['N']}: " +
              ", ".join(f"{k} {v.get('passed')}" for k, v in c.items() if isinstance(v, dict)))
    lc = result.get("loss_curves")
    if lc:
        v = lc["verdict"]
        print(f"loss curves ({lc['steps']} steps, {len(lc['seeds'])} seed(s), ref {lc.get('ref')}): passed {v.get('passed')} "
              f"max diff {v.get('max_diff', float('nan')):.4g} bound {v.get('bound', float('nan')):.4g} "
              f"{v.get('reason', '')}; step-0 grads passed {lc.get('grad_step0', {}).get('passed')}")
    for r in result["rows"]:
        if r["system"] == "cubridge" and r["direction"] == "train_step":
            ours = [k for k in r.get("kernels", []) if k.startswith(("fa3_", "fa2_"))]
            print(f"backward of cubridge {r['variant']}: {r.get('cubridge_backward')} "
                  f"({', '.join(ours) or r.get('profile_error', '')}); env {result['env']}")
    print_train_parts(result)


def print_train_parts(result) -> None:
    """The training step per part (ms of CUDA kernel time in one profiled step) and the bound."""
    rows = [r for r in result["rows"] if r["direction"] == "train_step"]
    if not rows:
        return
    print(f"\n{'train step':<24} {'step':>8} {'attn fwd':>8} {'attn bwd':>8} {'gemm':>8} {'optim':>8} {'other':>8} "
          f"{'busy':>8} marks  (ms; parts from one profiled step; marks: attention fwd / bwd ranges seen)")
    for r in rows:
        p = r.get("parts")
        cells = ([p["us"][k] / 1e3 for k in ("attention_fwd", "attention_bwd", "gemm", "optimizer", "other")]
                 + [p["busy_us"] / 1e3] if p else [])
        marks = f" {p['marks']['attention_forward']}/{p['marks']['attention_backward']}" if p else ""
        print(f"{r['variant'] + ' ' + r['system']:<24} {r['ms']:8.2f} " + " ".join(f"{c:8.2f}" for c in cells)
              + (marks if p else f" {r.get('profile_error', 'no profile')}"))
    for variant, b in result.get("forward_bound", {}).items():
        if b:
            print(f"forward bound {variant}: free attention {b['free_attention_ms']:.2f} ms, SDPA + mask "
                  f"{b['sdpa_bool_mask_ms']:.2f} ms -> at most {b['max_speedup_vs_sdpa_bool_mask']:.3f}x (bar 2x "
                  f"reachable: {b['bar_2x_reachable']}); cubridge {b.get('cubridge_speedup_vs_sdpa_bool_mask')}x")
    for variant, b in result.get("train_bound", {}).items():
        for flex, v in b.get("vs_flex", {}).items():
            print(f"bound {variant} vs {flex}: free attention {b['free_attention_ms']:.2f} ms -> at most "
                  f"{v['max_speedup_free_attention']:.3f}x (bar 1.3 reachable: {v['bar_reachable']}); "
                  f"cubridge {v['cubridge_speedup']}x")


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("error: llama_client.py: no CUDA device (the client times kernels on an H100)", file=sys.stderr)
        return 2
    compiled_flex_attention()     # raises dynamo's recompile limits (past them Flex silently runs unfused)
    root = Path(tempfile.mkdtemp(prefix="llama_client_"))
    t0 = time.time()
    registered, runs = build_runs(args, root)
    print(f"built and registered {sorted(registered.values())} in {time.time() - t0:.0f} s", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(),
              "versions": versions(), "env": env_opt_ins(),
              "model": {"layers": LAYERS, "heads_q": HQ, "heads_kv": HKV, "head_dim": D, "batch": B, "vocab": VOCAB,
                        "dtype": "bf16"},
              "protocol": f"bench_round_robin, 2 warm-ups, median of {args.reps}, L2 flushed",
              "runs": runs, "rows": [], "checks": [], "system_errors": {}}
    return run_parts(args, registered, result)


def build_runs(args, root: Path) -> tuple[dict, dict]:
    """({causal, prefixlm, prefixlm@LABEL per --alt-configs: registered attention name}, their
    run_info); run directories built in parallel (nvcc runs outside the GIL), prefixlm's taken
    from --prefixlm-run where given."""
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.integrations.transformers import register
    from cubridge.op import build
    needed = set(args.train_variants if args.train else ()) | set(() if args.no_forward or args.layer_only
                                                                   else args.fwd_variants)
    needed |= {"prefixlm"} if not args.no_forward and "prefixlm" in args.fwd_variants else set()
    jobs = {s: (s, {}) for s in ("causal", "prefixlm")
            if s in needed and (s != "prefixlm" or args.prefixlm_run is None)}
    for label in args.alt_configs:
        point = parse_config(label)
        jobs[f"prefixlm@{label}"] = ("prefixlm", {"configs": {1024: point, 8192: point}})
    with ThreadPoolExecutor(max_workers=4) as pool:
        dirs = dict(zip(jobs, pool.map(lambda kv: build(kv[1][0], root / kv[0].replace("@", "_"), heads_q=HQ,
                                                        heads_kv=HKV, head_dim=D, **kv[1][1]), jobs.items())))
    if args.prefixlm_run is not None and "prefixlm" in needed:
        dirs["prefixlm"] = tuned_run(args.prefixlm_run)
    runs = {key: register(d, name=f"cubridge_{key.replace('@', '_')}") for key, d in dirs.items()}
    return runs, {key: run_info(d) for key, d in dirs.items()}


def run_info(run) -> dict:
    """Where a run came from and its buckets' forward / backward configs (for the JSON)."""
    dispatch = run.dispatch if hasattr(run, "dispatch") else json.loads((Path(run) / "dispatch.json").read_text())
    return {"dir": str(getattr(run, "directory", run)),
            "buckets": [{"min_seqlen": b["min_seqlen"], "max_seqlen": b["max_seqlen"], "forward": b["label"],
                         "backward": (b.get("backward") or {}).get("config")} for b in dispatch["buckets"]]}


def tuned_run(directory: Path):
    """The tuned prefixlm run, loaded and checked against the client's model (its head counts)."""
    import cubridge
    from cubridge.errors import CubridgeError
    op = cubridge.load(directory)
    d = op.dispatch
    if d["spec_name"] != "prefixlm" or op.heads != (HQ, HKV) or op.head_dim != D or d["dtype"] != "bf16":
        raise CubridgeError(f"a {d['spec_name']} run for Hq={op.heads[0]}, Hkv={op.heads[1]}, D={op.head_dim}, "
                            f"{d['dtype']}; the client's model needs prefixlm, {HQ} / {HKV} heads, D={D}, bf16",
                            where=f"{directory}/dispatch.json",
                            hint=f"tune with shapes: {{heads_q: {HQ}, heads_kv: {HKV}, head_dim: {D}}} "
                                 "(configs/h100_prefixlm_llama.yaml)")
    return op


def run_parts(args, registered: dict, result: dict) -> int:
    """The forward and / or train parts (train first with --layer-only), the JSON rewritten after
    each (a failing part is recorded and the rest still runs); 1 if a part failed."""
    parts = ([] if args.no_forward else [("forward", run_forward)]) + ([("train", run_train)] if args.train else [])
    if args.layer_only:      # the short part last: a job cut at its time limit keeps the training step
        parts.reverse()
    failed = False
    for part, run in parts:
        try:
            run(args, registered, result)
        except Exception as e:   # noqa: BLE001 - recorded; what ran before still gets written
            failed = True
            result.setdefault("errors", {})[part] = traceback.format_exc(limit=6)[-3000:]
            print(f"error: {part}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            torch.cuda.empty_cache()
            write(args.out, result)
    print_table(result)
    return 1 if failed else 0


def write(path: Path, result: dict) -> None:
    result["speedups"] = speedups(result["rows"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
