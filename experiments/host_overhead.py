"""Host-side cost of one launch: microseconds of Python + driver work per call of fa3_forward
(dense, and a lowered variant), against cuDNN's SDPA through torch, at Llama2-7B heads, 1k tokens
(where a launch is a few hundred microseconds of GPU time and host work shows). Calls are
enqueued back to back without synchronising, so the number is the host's cost per call, not the
GPU's; the GPU time per call (CUDA events around the whole batch) is printed beside it.

    python experiments/host_overhead.py [--out $OUT/host_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from expkit import Ours, versions  # noqa: E402
from cubridge.runtime.driver import driver  # noqa: E402
from cubridge.runtime.fa3_sm90 import WG_ROWS, default_config, fa3_forward  # noqa: E402

CALLS = 200


def host_us(fn) -> tuple[float, float]:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - t0) / CALLS * 1e6
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / CALLS * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=1024)
    args = ap.parse_args()
    n, h, d = args.n, 32, 128
    b = 16384 // n
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    rows = []
    for causal in (True, False):
        cfg = default_config(d, causal, True, n)

        def cudnn(causal=causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        systems = {"cubridge/fa3_sm90": lambda cfg=cfg, causal=causal: fa3_forward(q, k, v, causal=causal, config=cfg, out=out),
                   "sdpa_cudnn": cudnn}

        def before(cfg=cfg, causal=causal):
            """What each call did before the host caches (commit de085c3), added on top: four
            tensor-map encodes, a zeroed counter (allocation + fill kernel), device queries."""
            drv = driver()
            for t, rows in ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (out, WG_ROWS)):
                drv.tensor_map(t, rows)
            torch.zeros(1, device=q.device, dtype=torch.int32)
            torch.cuda.get_device_capability(q.device)
            torch.cuda.get_device_properties(q.device)
            fa3_forward(q, k, v, causal=causal, config=cfg, out=out)
        systems["cubridge/fa3_sm90 + per-call work of before"] = before
        if causal:
            systems["cubridge/fa3_sm90 lowered causal"] = Ours().fn("causal", q, k, v)
        for name, fn in systems.items():
            host, gpu = host_us(fn)
            rows.append({"system": name, "causal": causal, "N": n, "B": b, "H": h, "D": d,
                         "host_us_per_call": round(host, 1), "gpu_us_per_call": round(gpu, 1)})
            print(f"{'causal' if causal else 'full':<7} {name:<34} host {host:7.1f} us/call   gpu {gpu:7.1f} us/call",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "date": str(date.today()),
                                              "versions": versions(), "calls": CALLS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
