"""A/B of fa3_bwd_sm90's performance options (cubridge.runtime.fa3_bwd_sm90.OPTIONS) beside fa2_bwd_sm80, SDPA's cuDNN backward and, when
flash_attn.cute imports, FlashAttention-4: dense bf16, D = 128, 32 heads, 16k tokens per shape, causal and full, backward
only (ours called directly after one forward, the peers through torch.autograd.grad), all systems
of a shape timed round-robin in one process with L2 flushed (bench_round_robin). TFLOPS = 2.5 x
the forward's FLOPs on attended pairs (issue 17). Each row carries a go / no-go note against
SDPA cuDNN's gradients (the verification rule is tests/gpu/test_bwd_sm90.py). Each option first
runs a small backward in a child process (preflight): one that faults is left out and named,
rather than taking every system's timing down with this process's CUDA context.

  python3 experiments/bench_bwd_options.py --out results.json [--n 8192 16384 1024]   (GPU)
  python3 experiments/bench_bwd_options.py --table results.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

import expkit  # noqa: F401 - cubridge importable from a bare checkout
from expkit import grad_sanity
from expkit.peers import fa4_backward, ours_backward
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cubridge.runtime.timing import attention_flops, bench_round_robin

TOKENS, H, D = 16384, 32, 128
BWD_FLOP_FACTOR = 2.5
OURS = "cubridge/fa3_bwd_sm90"


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


def systems(options: list[str], control: bool = False, peers=("fa2", "cudnn", "fa4")) -> dict:
    """control: the first option a second time (its own callable, the same kernel) as "...#2", so the table shows
    how far two copies of one kernel read apart in the same round-robin (session 14: up to 4.6% at causal 16k)."""
    table = {f"{OURS}[{o}]": functools.partial(ours_backward, o) for o in options}
    if control and options:
        table[f"{OURS}[{options[0]}]#2"] = functools.partial(ours_backward, options[0])
    every = {"fa2": ("cubridge/fa2_bwd_sm80", fa2), "cudnn": ("sdpa_cudnn", cudnn), "fa4": ("fa4", fa4_backward)}
    table.update(dict(every[p] for p in peers))
    return table


PREFLIGHT = """
import sys, torch
from cubridge.runtime.autograd import forward_with_lse
from cubridge.runtime.fa3_bwd_sm90 import fa3_backward
for causal in (True, False):
    q, k, v, do = (torch.randn(1, 2, 300, 128, device="cuda").bfloat16() for _ in range(4))
    out, lse = forward_with_lse(q, k, v, causal)
    grads = fa3_backward(do, q, k, v, out, lse, causal=causal, option=sys.argv[1])
    torch.cuda.synchronize()
    assert all(bool(g.isfinite().all()) for g in grads), "non-finite gradients"
"""


def preflight(options: list[str], timeout_s: float = 120.0) -> list[str]:
    """The options whose small causal and full backward runs in a child process without a fault:
    a kernel fault kills the CUDA context of this process, and every system's timing with it.
    The children run side by side (a few seconds each, mostly imports and the first builds)."""
    root = str(Path(__file__).resolve().parents[1])   # the checkout's cubridge, in the child too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    procs = {o: subprocess.Popen([sys.executable, "-c", PREFLIGHT, o], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env) for o in options}
    good = []
    for o, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            text = f"timed out after {timeout_s:.0f} s"
        if proc.returncode == 0:
            good.append(o)
        else:
            print(f"# option {o} left out: its preflight failed: {text.strip().splitlines()[-1:]}", flush=True)
    return good



def timed_rotations(fns: list, reps: int) -> list:
    """--rotate (session 16): one bench_round_robin per rotation of the order (every system once in every position,
    reps // len(fns) reps each, at least 3), each system's median of its per-rotation medians (p20 / p80 over the
    rotations). Session 16's mid call read the same kernel 2-9% faster in the first round-robin position than in the
    seventh (full 16k: 672 vs 619 TFLOPS), systems ranked by position: a fixed order biases an A/B by as much."""
    import statistics
    from cubridge.runtime.timing import Timing
    per = max(3, reps // len(fns))
    meds = [[] for _ in fns]
    for r in range(len(fns)):
        order = list(range(r, len(fns))) + list(range(r))
        for i, t in zip(order, bench_round_robin([fns[i] for i in order], warmup=2, reps=per)):
            meds[i].append(t.median_ms)
    return [Timing(statistics.median(m), sorted(m)[int(0.2 * (len(m) - 1))], sorted(m)[int(round(0.8 * (len(m) - 1)))],
                   per * len(fns)) for m in meds]


def bench_shape(n: int, causal: bool, reps: int, table: dict, rotate: bool = False) -> list[dict]:
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
    fns = [fn for _, fn in runnable]
    timings = timed_rotations(fns, reps) if rotate else bench_round_robin(fns, warmup=3, reps=reps)
    flops = BWD_FLOP_FACTOR * attention_flops(b, H, D, n, n, causal)
    ref, rows = grads.get("sdpa_cudnn"), []
    for (name, _), t in zip(runnable, timings):
        note = grad_sanity(grads[name], ref) if ref is not None and name != "sdpa_cudnn" else ""
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
    ap.add_argument("--control", action="store_true", help="time the first option twice (a noise control)")
    ap.add_argument("--rotate", action="store_true",
                    help="time every rotation of the round-robin order (timed_rotations: no position bias)")
    ap.add_argument("--peers", nargs="*", choices=["fa2", "cudnn", "fa4"], default=["fa2", "cudnn", "fa4"])
    ap.add_argument("--cases", nargs="+", choices=["causal", "full"], default=["causal", "full"],
                    help="which masks to time (session 16: full only for the full-attention TILE_M80 option)")
    ap.add_argument("--no-preflight", dest="preflight", action="store_false",
                    help="time every option without first running each in a child process")
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    options = preflight(args.options) if args.preflight else args.options
    table, rows, info = systems(options, args.control, args.peers), [], versions()
    info["rotate"] = args.rotate
    info["options_left_out"] = sorted(set(args.options) - set(options))
    for n in args.n:
        for causal in [c == "causal" for c in ("causal", "full") if c in args.cases]:
            try:
                rows += bench_shape(n, causal, args.reps, table, args.rotate)
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
