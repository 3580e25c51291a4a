"""Backward benchmark: cubridge's fa2_bwd_sm80 vs FlexAttention (Triton), SDPA (flash and cuDNN
backends), FlexAttention BACKEND="FLASH" and FlashAttention-4 (`flash_attn.cute`) where they import.

Each system's backward alone is timed: one forward with requires_grad, then
torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) per call, round-robin over the systems
(cubridge.runtime.timing.bench_round_robin, L2 flushed before each call). TFLOPS of a backward =
2.5 x the forward's FLOPs (4 B Hq D x attended pairs), as FlashAttention counts them.
Dense causal / full, bf16, D = 128, Llama2-7B heads (32 / 32), 16k tokens per shape.

    python experiments/bench_bwd.py --out $OUT/bwd.json [--n 1024 8192] [--reps 20]
    python experiments/bench_bwd.py --sanitize-case    # small ragged GQA launches for compute-sanitizer
    python experiments/bench_bwd.py --table $OUT/bwd.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import traceback
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import expkit  # noqa: E402,F401 - cubridge importable from a bare checkout
from expkit import grad_sanity  # noqa: E402
from cubridge.runtime.autograd import attention  # noqa: E402
from cubridge.runtime.timing import attention_flops, bench_round_robin, compiled_flex_attention  # noqa: E402

TOKENS = 16384
HQ = HKV = 32
D = 128
BWD_FLOP_FACTOR = 2.5       # backward = 2.5 x forward FLOPs (5 GEMMs of the forward's 2)
SYSTEMS = ["cubridge", "cubridge_det", "sdpa_flash", "sdpa_cudnn", "flex", "flex_flash", "fa4"]
# Row names as in the forward benchmarks (cubridge/<kernel>) plus the peers' names.
ROW_NAME = {"cubridge": "cubridge/fa2_bwd_sm80", "cubridge_det": "cubridge/fa2_bwd_sm80 deterministic"}


def versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "cudnn": torch.backends.cudnn.version()}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import flash_attn
        out["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except ImportError:
        pass
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    out["driver_clock"] = smi
    return out


def forwards(causal: bool):
    """system -> f(q, k, v) -> out on [B, H, N, D] leaves (FA4: [B, N, H, D], marked `bshd`)."""
    flex, create_block_mask = compiled_flex_attention()

    def block_mask(n):
        if not causal:
            return None
        return create_block_mask(lambda b, h, q, kv: kv <= q, None, None, n, n, device="cuda")

    def sdpa(backend):
        def f(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return f

    def flex_with(options):
        masks = {}

        def f(q, k, v):
            n = q.shape[2]
            if n not in masks:
                masks[n] = block_mask(n)
            return flex(q, k, v, block_mask=masks[n], kernel_options=options)
        return f

    def fa4(q, k, v):   # BSHD leaves (FlashAttention's native layout): see backward_fn
        from flash_attn.cute import flash_attn_func
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    fa4.bshd = True

    return {"cubridge": lambda q, k, v: attention(q, k, v, causal=causal),
            "cubridge_det": lambda q, k, v: attention(q, k, v, causal=causal, deterministic=True),
            "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "flex": flex_with(None),
            "flex_flash": flex_with({"BACKEND": "FLASH"}),
            "fa4": fa4}


def backward_fn(fwd, q, k, v, dout):
    """A callable running only the backward of fwd at (q, k, v), returning the gradients in
    [B, H, N, D] order. A forward marked `bshd` gets [B, N, H, D] leaves (its native layout, so no
    transpose is timed); its gradients come back as transposed views."""
    bshd = getattr(fwd, "bshd", False)
    if bshd:
        q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fwd(*leaves)
    if bshd:
        return lambda: [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, dout, retain_graph=True)]
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)



def config_fn(config: str, causal: bool, q, k, v, dout):
    """fa2_bwd_sm80 with a given tile config, called directly (no autograd) after one forward."""
    from cubridge.runtime.autograd import forward_with_lse
    from cubridge.runtime.fa2_bwd_sm80 import Config, Fa2BwdSm80
    bwd = Fa2BwdSm80(Config.parse(config))
    out, lse = forward_with_lse(q, k, v, causal)
    return lambda: bwd(dout, q, k, v, out, lse, causal=causal)


def bench_shape(n: int, causal: bool, reps: int, systems: list[str], configs: list[str] = ()) -> list[dict]:
    b = TOKENS // n
    gen = torch.Generator(device="cuda").manual_seed(n + causal)
    q, dout = (torch.randn(b, HQ, n, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, HKV, n, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    fwds = forwards(causal)
    runnable, notes = [], {}
    for name in systems:
        try:
            fn = backward_fn(fwds[name], q, k, v, dout)
            notes[name] = fn()   # first call: compiles / autotunes outside the timing
            runnable.append((name, fn))
        except Exception as err:   # noqa: BLE001 - a peer missing or refusing the shape is reported, not fatal
            print(f"# {name} N={n} {'causal' if causal else 'full'}: skipped: {str(err).splitlines()[0][:160]}")
    for config in configs:
        name = f"cubridge/fa2_bwd_sm80 {config}"
        try:
            fn = config_fn(config, causal, q, k, v, dout)
            notes[name] = fn()
            runnable.append((name, fn))
        except Exception as err:   # noqa: BLE001 - an invalid or failing config is reported, not fatal
            print(f"# {name} N={n}: skipped: {str(err).splitlines()[0][:160]}")
    timings = bench_round_robin([fn for _, fn in runnable], warmup=3, reps=reps)
    flops = BWD_FLOP_FACTOR * attention_flops(b, HQ, D, n, n, causal)
    ref = notes.get("sdpa_flash")
    rows = []
    for (name, _), t in zip(runnable, timings):
        check = grad_sanity(notes[name], ref) if ref is not None and name != "sdpa_flash" else ""
        rows.append(dict(direction="backward", system=ROW_NAME.get(name, name), variant="causal" if causal else "full",
                         model="llama2-7b", N=n, B=b, Hq=HQ, Hkv=HKV, D=D, dtype="bf16",
                         ms=round(t.median_ms, 4), tflops=round(flops / (t.median_ms * 1e-3) / 1e12, 1),
                         note=check))
        print(f"{rows[-1]['system']:40s} {rows[-1]['variant']:6s} N={n:5d} {t.median_ms:8.3f} ms {rows[-1]['tflops']:6.1f} "
              f"TFLOPS {check}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    systems = list(dict.fromkeys(r["system"] for r in rows))
    shapes = list(dict.fromkeys((r["variant"], r["N"]) for r in rows))
    cell = {(r["system"], r["variant"], r["N"]): r["tflops"] for r in rows}
    print("\n| shape | " + " | ".join(systems) + " |")
    print("| --- |" + " --- |" * len(systems))
    for var, n in shapes:
        vals = [f"{cell[(s, var, n)]:.1f}" if (s, var, n) in cell else "-" for s in systems]
        print(f"| {var} {n // 1024}k | " + " | ".join(vals) + " |")


def sanitize_case() -> None:
    """Small launches for compute-sanitizer: ragged causal GQA (both dQ modes, D = 128 bf16) and a
    full MQA one (D = 64 fp16); forward by fa2_sm80, so no other kernel family is in the trace."""
    from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
    from cubridge.runtime.fa2_sm80 import Fa2Sm80
    fwd, bwd = Fa2Sm80(), Fa2BwdSm80()
    for (b, hq, hkv, nq, nk, d, dtype, causal) in ((1, 4, 2, 77, 300, 128, torch.bfloat16, True),
                                                   (1, 2, 1, 200, 77, 64, torch.float16, False)):
        q, dout = (torch.randn(b, hq, nq, d, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype) for _ in range(2))
        out, lse = fwd(q, k, v, causal=causal)
        for det in (False, True):
            grads = bwd(dout, q, k, v, out, lse, causal=causal, deterministic=det)
            torch.cuda.synchronize()
            finite = all(bool(g.isfinite().all()) for g in grads)
            print(f"sanitize case D={d} {dtype} causal={causal} det={det}: finite={finite}")


def write_json(path: Path, rows: list[dict], reps: int) -> None:
    result = dict(gpu=torch.cuda.get_device_name(), device=torch.cuda.get_device_name(),
                  date=datetime.now().isoformat(), versions=versions(),
                  protocol=f"backward only (autograd.grad after one forward), round-robin, L2 flushed, "
                           f"median of {reps}; TFLOPS = 2.5 x forward FLOPs on attended pairs",
                  rows=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 1024])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", nargs="*", default=[], help="extra fa2_bwd_sm80 tile configs to time, "
                    "e.g. 64x64w4-dq64x64w4 (called directly, not through autograd)")
    ap.add_argument("--sanitize-case", action="store_true", help="run the small sanitizer launches and exit")
    ap.add_argument("--table", type=Path, help="print the table of a results JSON and exit")
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    if args.sanitize_case:
        sanitize_case()
        return 0
    rows = []
    for n in args.n:
        for causal in (True, False):
            try:
                rows += bench_shape(n, causal, args.reps, args.systems, args.configs)
            except Exception:   # noqa: BLE001 - keep the other shapes' rows
                traceback.print_exc()
            if args.out:   # after every shape: a run cut short by its time limit keeps what it measured
                write_json(args.out, rows, args.reps)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
