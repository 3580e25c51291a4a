"""Where the tuned op's host time per call goes (issue 15; cubridge/op/NOTES.md 10), on a GPU.

For each variant and N (bench_op's shapes: Hq 16, Hkv 4, D 128, B * N = 16384) every piece of the
eager call path is timed on its own, in expkit.hosttime's interleaved rounds (windows of 200 calls,
the GPU busy, GC off; the median of the round medians and the spread):

    timer_floor     an empty lambda (what perf_counter around a call costs)
    calib           a fixed pure-Python loop (the host's speed; no torch)
    key             the op's call-signature key (shapes, strides, dtypes, devices, layout, scale)
    empty_strided   the output's allocation as the op does it; empty / empty_like: the alternatives
    launch_call     Fa3Launch.__call__ (the argument-array lookup by addresses and strides, the launch)
    launch_fixed    Fa3Launch.fixed_layout's call (by addresses only: the op's path)
    cu_launch       cuLaunchKernel alone through ctypes, the packed arguments cached (the floor)
    closure         the op's cached per-signature call (allocation + launch_fixed)
    closure_before  the same call as it was before session 12 (torch.empty + launch_call): the A/B
    op_eager        attn(q, k, v): the whole eager call (key, lookup, grad check, closure)
    op_eager_before, op_eager_bnhd_before  the whole eager call as before session 12 (a second op of
                    the run whose closures are the old ones): the A/B of this session's trim
    closure_before_bnhd  the layout='bnhd' call's closure before session 12 (transposes in and out)
    op_eager_bnhd   attn(q, k, v, layout='bnhd') on [B, N, H, D] tensors; op_eager_views: transformers'
                    call (layout None, [B, H, N, D] views of [B, N, H, D] memory)
    op_custom_op    torch.ops.cubridge.attention(...): the dispatcher's path (what torch.compile calls);
                    custom_op_body / custom_op_body_before: its implementation now / before session 12
    sdpa            torch's SDPA (its own backend choice, enable_gqa) on the same tensors: a peer's host path

then op_eager, launch_call, cu_launch and calib again with the process pinned to one CPU (pinned_*),
to tell a host effect (core, clock) from the call path. Writes one JSON and prints a table last.

    python3 experiments/op_host_breakdown.py --out $OUT/breakdown.json [--runs DIR] [--variants full,causal]
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import cubridge
from cubridge.op import build, library
from cubridge.op.checks import bnhd_order
from cubridge.runtime.driver import current_stream
from expkit.hosttime import ROUNDS, calib_us, host_info, rounds

HQ, HKV, D = 16, 4, 128
TOKENS = 16384


def sdpa(q, k, v):
    """torch's SDPA on q, k, v, never its math backend (at 8k it would form 4 GB of scores per call
    and time that, not a launch): this script's process only, before any SDPA call."""
    torch.backends.cuda.enable_math_sdp(False)

    def call():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    call()
    return call


def closure_before(prep, bnhd: bool, q) -> object:
    """The per-signature closure of tuned.py before session 12 (commit 6c49d9f's _fast_call, no
    copies), for q the caller's tensor: transposes for layout='bnhd', O by torch.empty (+ transpose
    for [B, N, H, D] memory), Fa3Launch.__call__ (which now passes the stream as an int: ~0.07 us
    less than then)."""
    qh = q.transpose(1, 2) if bnhd else q
    (b, h, n, d), out_bnhd = qh.shape, bnhd_order(qh)
    launch, lse, dtype, device = prep.launch, prep.lse_scratch, q.dtype, q.device

    def call(q, k, v):
        if bnhd:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = (torch.empty((b, n, h, d), dtype=dtype, device=device).transpose(1, 2) if out_bnhd
               else torch.empty((b, h, n, d), dtype=dtype, device=device))
        launch(q, k, v, out, lse)
        return out.transpose(1, 2) if bnhd else out
    return call


def op_before(attn, q, k, v, qt, kt, vt):
    """A second TunedOp of the same run whose remembered closures are the pre-session-12 ones:
    its __call__ is today's (unchanged), so attn_before(...) is the whole eager call as it was."""
    before = cubridge.load(attn.directory)
    for layout, args in ((None, (q, k, v)), ("bnhd", (qt, kt, vt))):
        before(*args, layout=layout)
        a, b_, c = args
        key = (layout, None, a.shape, b_.shape, c.shape, a.stride(), b_.stride(), c.stride(), a.dtype, b_.dtype,
               c.dtype, a.device, b_.device, c.device)
        assert key in before._fast, "the op's signature key changed: update op_before"
        prep = next(p for (qs, ks, dev, _), p in before._prepared.items() if qs == q.shape)
        before._fast[key] = closure_before(prep, layout == "bnhd", a)
    return before


def pieces(attn, n: int) -> dict:
    b = TOKENS // n
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(b, HQ, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, HKV, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(D)
    attn(q, k, v)
    attn(q, k, v)
    prep = attn._prepared[(q.shape, k.shape, q.device, scale)]
    launch, lse, out = prep.launch, prep.lse_scratch, torch.empty_like(q)
    launch(q, k, v, out, lse)
    argv = launch._argvs[(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                          current_stream(q.device.index), q.stride(), k.stride(), v.stride(), out.stride())][0]
    cu, stream = launch._lib.cuLaunchKernel, current_stream(q.device.index)
    fixed = launch.fixed_layout(lambda *t: t)

    def key():
        return (None, None, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                q.device, k.device, v.device)
    closure = attn._fast[key()]
    shape, stride = tuple(q.shape), q.stride()
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))     # [B, N, H, D] memory
    views = tuple(t.transpose(1, 2) for t in (qt, kt, vt))              # what transformers hands over
    for _ in range(2):
        attn(qt, kt, vt, layout="bnhd")
        attn(*views)

    before = op_before(attn, q, k, v, qt, kt, vt)

    def closure_before_bnhd():
        """The closure for layout='bnhd' before session 12: three transposes in, O allocated as
        [B, N, H, D] and transposed for the launch, transposed back for the caller."""
        qh, kh, vh = qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2)
        o = torch.empty((b, n, HQ, D), dtype=q.dtype, device=q.device).transpose(1, 2)
        launch(qh, kh, vh, o, lse)
        return o.transpose(1, 2)
    fns = {"timer_floor": lambda: None, "calib": calib_us, "key": key,
           "empty_strided": lambda: torch.empty_strided(shape, stride, dtype=q.dtype, device=q.device),
           "empty": lambda: torch.empty(shape, dtype=q.dtype, device=q.device),
           "empty_like": lambda: torch.empty_like(q),
           "launch_call": lambda: launch(q, k, v, out, lse),
           "launch_fixed": lambda: fixed(q, k, v, out, lse),
           "cu_launch": lambda: cu(launch.func, launch.grid, 1, 1, launch._threads, 1, 1, launch._smem, stream, argv,
                                   None),
           "closure": lambda: closure(q, k, v),
           "closure_before": lambda: launch(q, k, v, torch.empty(shape, dtype=q.dtype, device=q.device), lse),
           "op_eager": lambda: attn(q, k, v),
           "op_eager_before": lambda: before(q, k, v),
           "op_eager_bnhd_before": lambda: before(qt, kt, vt, layout="bnhd"),
           "closure_before_bnhd": closure_before_bnhd,
           "op_eager_bnhd": lambda: attn(qt, kt, vt, layout="bnhd"),
           "op_eager_views": lambda: attn(*views),
           "op_custom_op": lambda: torch.ops.cubridge.attention(q, k, v, attn.handle, scale, []),
           "custom_op_body": lambda: attn.op_forward(q, k, v, scale),
           "custom_op_body_before": lambda: library._in_order_of(
               attn.forward(*library._readable(attn, q, k, v), scale, [], False)[0], q)}
    try:
        fns["sdpa"] = sdpa(q, k, v)
    except Exception as e:   # noqa: BLE001 - the peer anchor is optional
        print(f"sdpa: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="full,causal")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--runs", default=None, help="folder of run directories (bench_op's --runs); built if absent")
    args = ap.parse_args()
    root = Path(args.runs or tempfile.mkdtemp(prefix="op_host_"))
    result = {"gpu": torch.cuda.get_device_name(), "host": host_info(), "rounds": args.rounds, "cases": []}
    for name in args.variants.split(","):
        run = root / name if (root / name / "dispatch.json").is_file() else build(
            name, root / name, heads_q=HQ, heads_kv=HKV, head_dim=D)
        attn = cubridge.load(run)
        for n in (int(x) for x in args.lengths.split(",")):
            fns = pieces(attn, n)
            table = rounds(fns, n_rounds=args.rounds)
            pinned = rounds({f"pinned_{p}": fns[p] for p in ("op_eager", "launch_call", "cu_launch", "calib")},
                            n_rounds=args.rounds, pin=True)
            result["cases"].append({"variant": name, "N": n, "B": TOKENS // n, "pieces": {**table, **pinned}})
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["host"]))
    names = list(result["cases"][0]["pieces"]) if result["cases"] else []
    print(f"{'piece (median us / spread)':<22}" + "".join(f" {c['variant'][:8] + ' ' + str(c['N']):>16}"
                                                     for c in result["cases"]))
    for p in names:
        cells = [c["pieces"].get(p) for c in result["cases"]]
        print(f"{p:<22}" + "".join(f" {s['median_us']:8.2f} /{s['spread_us']:6.2f}" if s and s["median_us"] is not None
                                   else f" {'-' if not s else 'error':>16}" for s in cells))


if __name__ == "__main__":
    main()
