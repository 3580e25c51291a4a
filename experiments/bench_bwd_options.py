"""A/B of fa3_bwd_sm90's performance options (cubridge.runtime.fa3_bwd_sm90.OPTIONS) beside fa2_bwd_sm80, SDPA's cuDNN backward and, when
flash_attn.cute imports, FlashAttention-4: dense bf16, D = 128, 32 heads, 16k tokens per shape, causal and full, backward
only (ours called directly after one forward, the peers through torch.autograd.grad), all systems
of a shape timed round-robin in one process with L2 flushed (bench_round_robin). TFLOPS = 2.5 x
the forward's FLOPs on attended pairs (issue 17). Each row carries a go / no-go note against
SDPA cuDNN's gradients (the verification rule is tests/gpu/test_bwd_sm90.py).

  python3 experiments/bench_bwd_options.py --out results.json [--n 8192 16384 1024]   (GPU)
  python3 experiments/bench_bwd_options.py --table results.json
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

import expkit  # noqa: F401 - cubridge importable from a bare checkout
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cubridge.runtime.timing import attention_flops, bench_round_robin

TOKENS, H, D = 16384, 32, 128
BWD_FLOP_FACTOR = 2.5
SANITY_REL = 0.05          # max |ours - cuDNN| / max |cuDNN|, per gradient: a go / no-go only
OURS = "cubridge/fa3_bwd_sm90"


def ours(option: str, causal: bool, q, k, v, dout):
    from cubridge.runtime.autograd import forward_with_lse
    from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
    out, lse = forward_with_lse(q, k, v, causal)
    return functools.partial(fa3_backward, dout, q, k, v, out, lse, causal=causal, option=option)


def fa2(causal: bool, q, k, v, dout):
    from cubridge.runtime.autograd import forward_with_lse
    from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
    out, lse = forward_with_lse(q, k, v, causal)
    bwd = Fa2BwdSm80()
    return lambda: bwd(dout, q, k, v, out, lse, causal=causal)


def cudnn(causal: bool, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def fa4(causal: bool, q, k, v, dout):
    from flash_attn.cute import flash_attn_func   # [B, N, H, D] leaves, its native layout
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    do = dout.transpose(1, 2).contiguous()
    return lambda: [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, do, retain_graph=True)]


def systems(options: list[str]) -> dict:
    table = {f"{OURS}[{o}]": functools.partial(ours, o) for o in options}
    table.update({"cubridge/fa2_bwd_sm80": fa2, "sdpa_cudnn": cudnn, "fa4": fa4})
    return table


def sanity(grads, ref) -> str:
    bad = []
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        rel = float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6))
        if not rel <= SANITY_REL:   # NaN fails too
            bad.append(f"{name} rel err {rel:.3g}")
    return "WRONG: " + ", ".join(bad) if bad else ""


def bench_shape(n: int, causal: bool, reps: int, table: dict) -> list[dict]:
    b = max(1, TOKENS // n)
    gen = torch.Generator(device="cuda").manual_seed(n + causal)
    q, k, v, dout = (torch.randn(b, H, n, D, device="cuda", generator=gen).bfloat16() for _ in range(4))
    runnable, grads = [], {}
    for name, make in table.items():
        try:
            fn = make(causal, q, k, v, dout)
            grads[name] = [g.clone() for g in fn()]   # first call: builds / autotunes outside the timing
            runnable.append((name, fn))
        except Exception as err:   # noqa: BLE001 - a missing peer or a failing option is reported, not fatal
            print(f"# {name} N={n} {'causal' if causal else 'full'}: skipped: {str(err).splitlines()[0][:160]}")
    torch.cuda.synchronize()
    timings = bench_round_robin([fn for _, fn in runnable], warmup=3, reps=reps)
    flops = BWD_FLOP_FACTOR * attention_flops(b, H, D, n, n, causal)
    ref, rows = grads.get("sdpa_cudnn"), []
    for (name, _), t in zip(runnable, timings):
        note = sanity(grads[name], ref) if ref is not None and name != "sdpa_cudnn" else ""
        rows.append(dict(direction="backward", system=name, variant="causal" if causal else "full",
                         model="llama2-7b", N=n, B=b, Hq=H, Hkv=H, D=D, dtype="bf16",
                         ms=round(t.median_ms, 4), ms_p20=round(t.p20_ms, 4), ms_p80=round(t.p80_ms, 4),
                         tflops=round(flops / (t.median_ms * 1e-3) / 1e12, 1), note=note))
        print(f"{name:38s} {rows[-1]['variant']:6s} N={n:5d} {t.median_ms:8.3f} ms {rows[-1]['tflops']:6.1f} TFLOPS "
              f"{note}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    names = list(dict.fromkeys(r["system"] for r in rows))
    shapes = list(dict.fromkeys((r["variant"], r["N"]) for r in rows))
    cell = {(r["system"], r["variant"], r["N"]): r for r in rows}
    short = [s.replace(OURS, "ours") for s in names]
    print("\n| shape | " + " | ".join(short) + " | best ours / fa4 |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for var, n in shapes:
        vals = [(f"{cell[(s, var, n)]['tflops']:.1f}" + (" WRONG" if cell[(s, var, n)]["note"] else ""))
                if (s, var, n) in cell else "-" for s in names]
        mine = [cell[(s, var, n)]["tflops"] for s in names
                if s.startswith(OURS) and (s, var, n) in cell and not cell[(s, var, n)]["note"]]
        peer = cell.get(("fa4", var, n))
        ratio = f"{max(mine) / peer['tflops']:.2f}" if mine and peer else "-"
        print(f"| {var} {n // 1024}k | " + " | ".join(vals) + f" | {ratio} |")


def versions() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name()}
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError as err:   # a missing tool leaves its field out, not the results
        info["versions_error"] = str(err)
    try:
        import flash_attn
        info["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except ImportError:
        info["flash_attn"] = None
    return info


def main(argv=None) -> int:
    from cubridge.runtime.fa3_bwd_sm90 import OPTIONS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 1024])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--table", type=Path, help="print the table of a results JSON and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    table, rows, info = systems(args.options), [], versions()
    for n in args.n:
        for causal in (True, False):
            try:
                rows += bench_shape(n, causal, args.reps, table)
            except Exception:   # noqa: BLE001 - keep the other shapes' rows
                traceback.print_exc()
            if args.out:   # after every shape: a run cut short keeps what it measured
                args.out.write_text(json.dumps(dict(device=info["device"], versions=info,
                                                    date=datetime.now(timezone.utc).isoformat(), rows=rows),
                                               indent=1))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
