"""Per-variant backward benchmark (issue 17's variant bars): cubridge (the variant's rules transfer
lowered onto fa3_sm90 for the forward, onto fa2_bwd_sm80 for the backward) against FlexAttention
(Triton) and FlexAttention with kernel_options={"BACKEND": "FLASH"}, same mask_mod / score_mod
and BlockMask; and for relu / sigmoid / composite (no FlexAttention) against torch.autograd of the
spec's eager reference at 8k. bf16, D = 128, 16 heads (MHA), B = 16384 // N.

Per (variant, N) every system is timed round-robin (cubridge.runtime.timing.bench_round_robin: L2
flushed, drift hits all alike), three rounds: backward alone (autograd.grad on a retained graph for
the peers; our backward kernel on the saved out / LSE), forward (training mode: the peers build the
graph), forward + backward. TFLOPS of a backward = 2.5 x the forward's 4 D (attended pairs), pairs
counted exactly from the spec's mask. A peer's gradients are checked against ours (max |peer -
ours| / max |ours| over dQ, dK, dV; `agrees` at <= 0.05); ours are checked against float64 autograd
by tests/gpu/test_bwd_variants.py. A peer that refuses (FLASH backend unavailable, a normalisation
Flex cannot express) is recorded with its reason, never a crash. Rows are written after every
(variant, N), so a run cut short keeps what it measured.

    python experiments/bench_bwd_variants.py --out $OUT/x.json [--n 1024 8192] [--reps 10] [--bwd-kernel hopper]

--bwd-kernel hopper: our backward is the variant lowered onto the Hopper fa3_bwd_sm90
(cubridge.lower.fa3_bwd_sm90, VariantBackward(use_hopper=True), sm_90 only) instead of fa2_bwd_sm80.
--hopper-options A [B ...] (with --bwd-kernel hopper): "cubridge" is option A (default VARIANT_OPTION);
each further option is one more system "cubridge[B]" in the same round-robin (an A/B of the options).
    python experiments/bench_bwd_variants.py --table $OUT/x.json
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import expkit
from expkit.peers import flex_autograd
from expkit import grad_rel_errors
import torch

from cubridge.runtime.timing import bench_round_robin, tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402

VARIANTS = ["prefixlm", "causal_blockwise", "global_sliding_window", "share_question", "relative_pos",
            "sigmoid", "relu", "composite"]
EAGER = ("relu", "sigmoid", "composite")   # issue 17: >= 10x eager autograd at 8k
EAGER_N = 8192
TOKENS, H, D = 16384, 16, 128
BWD_FLOP_FACTOR = 2.5
AGREE_REL = 0.05
OURS = "cubridge"
BARS = {"flex": 1.3, "flex_flash": 1.1, "eager_autograd": 10.0}
BWD_KERNEL = {"kernel": "fa2", "options": [None]}   # --bwd-kernel, --hopper-options (None: VARIANT_OPTION)


class Refused(Exception):
    """A peer that cannot run this variant or shape; the message is recorded as the reason."""


def _inputs(n: int, b: int):
    return expkit.bwd_inputs(b, H, H, n, D, seed=n * 131 + b)


@functools.lru_cache(maxsize=None)
def variant_backward(name: str, option: str | None = None):
    """One VariantBackward per (variant, Hopper option) (the rules transfer runs once per variant's
    object; its kernel keeps its builds)."""
    from cubridge.runtime.variant_bwd import VariantBackward
    hopper = BWD_KERNEL["kernel"] == "hopper"
    return VariantBackward(name, use_hopper=hopper, **({"hopper_option": option} if hopper and option else {}))


def ours(name, q, k, v, dout, fwd_ours, option: str | None = None):
    """{fwd, bwd, fwd_bwd, grads}: forward = the variant lowered onto fa3_sm90 (out, LSE), backward
    = VariantBackward on that out / LSE (its Dvec from our out: end to end)."""
    bwd = variant_backward(name, option)
    fwd = fwd_ours.fn(name, q, k, v)
    out, lse = fwd()
    return {"fwd": fwd, "bwd": lambda: bwd(dout, q, k, v, out, lse),
            "fwd_bwd": lambda: bwd(dout, q, k, v, *fwd()), "grads": bwd(dout, q, k, v, out, lse)}


def _autograd_system(forward, leaves, dout):
    """The backward alone is autograd.grad on a retained graph; where a second backward through
    it is refused, bwd is None and its time is (forward + backward) - forward."""
    out = forward()
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    bwd = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)  # noqa: E731
    try:
        bwd()
    except RuntimeError as e:
        print(f"  retained backward refused ({str(e)[:120]}): bwd = fwd_bwd - fwd", flush=True)
        bwd = None
    return {"fwd": forward, "bwd": bwd, "fwd_bwd": lambda: torch.autograd.grad(forward(), leaves, dout),
            "grads": grads}


def flex(name, hooks, q, k, v, dout, backend):
    if not hooks.flex_expressible:
        raise Refused(f"{hooks.normalization.kind} normalisation: FlexAttention is softmax only")
    leaves, forward = flex_autograd(hooks, q, k, v, backend)
    try:
        return _autograd_system(forward, leaves, dout)
    except Exception as e:  # noqa: BLE001 - the backend's refusal (or failure) is the recorded reason
        raise Refused(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")


def eager(name, q, k, v, dout):
    spec = load_spec(name)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return _autograd_system(lambda: spec.run_reference(*leaves), leaves, dout)



def time_systems(systems: dict, reps: int) -> dict:
    """{system: {fwd_ms, bwd_ms, fwd_bwd_ms}}, each phase one round-robin over all systems."""
    times = {s: {} for s in systems}
    for phase in ("bwd", "fwd", "fwd_bwd"):
        names = [s for s in systems if systems[s][phase] is not None]
        for s, t in zip(names, bench_round_robin([systems[s][phase] for s in names], warmup=2, reps=reps)):
            times[s][f"{phase}_ms"] = round(t.median_ms, 4)
    for s in systems:
        if systems[s]["bwd"] is None:
            times[s]["bwd_ms"] = round(times[s]["fwd_bwd_ms"] - times[s]["fwd_ms"], 4)
            times[s]["bwd_by_difference"] = True
    return times


def bench_shape(name: str, n: int, b: int, peers: list[str], reps: int, fwd_ours, gpu: str) -> list[dict]:
    spec = load_spec(name)
    hooks = spec.hooks_for(n, n, H, H, "cuda")
    flops = 4.0 * D * count_attended(hooks, b, H, n, n, device="cuda")
    q, k, v, dout = _inputs(n, b)
    base = dict(direction="backward", variant=name, N=n, B=b, Hq=H, Hkv=H, D=D, dtype="bf16", gpu=gpu,
                bwd_kernel=BWD_KERNEL["kernel"])
    options = BWD_KERNEL["options"]
    systems, rows = {OURS: ours(name, q, k, v, dout, fwd_ours, options[0])}, []
    for option in options[1:]:   # --hopper-options: the other options, same round-robin
        systems[f"{OURS}[{option}]"] = ours(name, q, k, v, dout, fwd_ours, option)
    makers = {"flex": lambda: flex(name, hooks, q, k, v, dout, "triton"),
              "flex_flash": lambda: flex(name, hooks, q, k, v, dout, "flash"),
              "eager_autograd": lambda: eager(name, q, k, v, dout)}
    for peer in peers:
        try:
            systems[peer] = makers[peer]()
        except (Refused, torch.cuda.OutOfMemoryError) as e:
            rows.append(dict(base, system=peer, refused=str(e)[:400]))
            print(f"  {name} N={n} {peer}: refused: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
    mine = systems[OURS]["grads"]
    times = time_systems(systems, reps)
    for s, t in times.items():
        row = dict(base, system=s, **t)
        row.update(bwd_tflops=round(tflops(BWD_FLOP_FACTOR * flops, t["bwd_ms"]) or 0, 1),
                   fwd_tflops=round(tflops(flops, t["fwd_ms"]) or 0, 1))
        if s != OURS:
            rel = max(grad_rel_errors(systems[s]["grads"], mine).values())
            row.update(max_rel_vs_ours=round(rel, 5), agrees=rel <= AGREE_REL,
                       bwd_speedup_of_ours=round(t["bwd_ms"] / times[OURS]["bwd_ms"], 3),
                       fwd_bwd_speedup_of_ours=round(t["fwd_bwd_ms"] / times[OURS]["fwd_bwd_ms"], 3))
            if s in BARS:
                row["bar"] = BARS[s]
        rows.append(row)
        print(f"  {name:22s} N={n:5d} B={b} {s:15s} fwd {t['fwd_ms']:8.3f}  bwd {t['bwd_ms']:8.3f}  "
              f"fwd+bwd {t['fwd_bwd_ms']:8.3f} ms  bwd {row['bwd_tflops']:6.1f} TFLOPS"
              + (f"  vs ours x{row['bwd_speedup_of_ours']:.2f} rel {row['max_rel_vs_ours']:.1e}" if s != OURS else ""),
              flush=True)
    return rows


def prebuild(variants, ns) -> None:
    """Every forward / backward specialisation, in parallel (nvcc and NVRTC run outside the GIL)."""
    from cubridge.runtime.fa3_sm90 import build_cubin, default_config
    from cubridge.runtime.launch import device_arch
    arch = device_arch(torch.device("cuda"))
    fwd_ours = expkit.Ours()
    jobs = [(fwd_ours.lowered(v)[2], default_config(D, False, True, n, variant=True)) for v in variants for n in ns]
    bwds = [(variant_backward(v, o), o) for v in variants for o in BWD_KERNEL["options"]]
    with ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(build_cubin, cfg, source=src) for src, cfg in set(jobs)]
        if BWD_KERNEL["kernel"] == "hopper":
            from cubridge.runtime import fa3_bwd_sm90 as hb
            futs += [pool.submit(hb.build_cubin, D, False, True, option=o or hb.VARIANT_OPTION, source=b.hopper.source)
                     for b, o in bwds]
        else:
            futs += [pool.submit(b.kernel.build, D, torch.bfloat16, False, False, arch, source=b.source)
                     for b, _ in bwds]
        for f in futs:
            f.result()


def print_table(rows: list[dict]) -> None:
    print("| variant | N | system | fwd ms | bwd ms | fwd+bwd ms | bwd TFLOPS | ours bwd speedup (bar) | rel vs ours |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "refused" in r:
            print(f"| {r['variant']} | {r['N']} | {r['system']} | refused: {r['refused'][:80]} | | | | | |")
            continue
        sp = f"{r['bwd_speedup_of_ours']:.2f}x ({r['bar']}x)" if "bar" in r else ""
        rel = f"{r['max_rel_vs_ours']:.1e}{'' if r.get('agrees', True) else ' DISAGREES'}" if "max_rel_vs_ours" in r else ""
        print(f"| {r['variant']} | {r['N']} | {r['system']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
              f"{r['fwd_bwd_ms']:.3f} | {r['bwd_tflops']:.0f} | {sp} | {rel} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--peers", nargs="*", default=["flex", "flex_flash"],
                    help="peers to time beside ours (none: `--peers` alone, e.g. an A/B of --hopper-options)")
    ap.add_argument("--table", type=Path, help="print the table of a results JSON and exit")
    ap.add_argument("--bwd-kernel", choices=["fa2", "hopper"], default="fa2",
                    help="our backward kernel: fa2_bwd_sm80 or the Hopper fa3_bwd_sm90 (sm_90)")
    ap.add_argument("--hopper-options", nargs="+", default=None,
                    help="fa3_bwd_sm90 VARIANT_OPTIONS to time (with --bwd-kernel hopper): the first is 'cubridge', "
                         "each other one the system 'cubridge[OPTION]' (default: VARIANT_OPTION alone)")
    args = ap.parse_args(argv)
    BWD_KERNEL["kernel"] = args.bwd_kernel
    if args.hopper_options:
        from cubridge.runtime.fa3_bwd_sm90 import VARIANT_OPTIONS
        bad = [o for o in args.hopper_options if o not in VARIANT_OPTIONS]
        if args.bwd_kernel != "hopper" or bad:
            ap.error(f"--hopper-options needs --bwd-kernel hopper and options of {list(VARIANT_OPTIONS)} (got {bad})")
        BWD_KERNEL["options"] = list(args.hopper_options)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "bwd_kernel": args.bwd_kernel, "hopper_options": BWD_KERNEL["options"], "versions": expkit.versions(), "protocol": "round-robin, L2 flushed, 2 warm-ups, "
              f"{args.reps} reps, median (cubridge.runtime.timing.bench_round_robin)", "rows": [], "failed": []}
    try:
        prebuild(args.variants, args.n)
    except Exception:  # noqa: BLE001 - a build failure shows again, per variant, below
        print(f"# prebuild failed\n{traceback.format_exc()[-1500:]}", flush=True)
    fwd_ours = expkit.Ours()
    # the eager comparisons first: no FlexAttention compile, so they finish even in a short call
    jobs = [(v, EAGER_N, 1, ["eager_autograd"]) for v in args.variants if v in EAGER and EAGER_N in args.n]
    jobs += [(v, n, TOKENS // n, list(args.peers)) for n in args.n for v in args.variants]
    for name, n, b, peers in jobs:
        try:
            result["rows"] += bench_shape(name, n, b, peers, args.reps, fwd_ours, gpu)
        except Exception:  # noqa: BLE001 - one variant failing is reported, the others still run
            result["failed"].append(dict(variant=name, N=n, B=b, error=traceback.format_exc()[-1500:]))
            print(f"# {name} N={n} B={b}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
        torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
