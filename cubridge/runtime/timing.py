"""One timing protocol for our kernels and every baseline (docs/DESIGN.md, "Timing").

    warm-up calls (compilation, autotuning and lazy init stay out of the numbers), then `reps`
    timed calls, each bracketed by its own pair of CUDA events on the current stream, with the L2
    cache flushed (a buffer twice the L2 size rewritten) before each one; the result is the median.

The flush runs outside the event pair, so it is not timed; it makes every repeat read its inputs
from HBM, as a real model's layer would. A GPU spin longer than the call's host enqueue time sits
between the flush and the start event, so the events bracket GPU work only: a system with a slow
Python / launch path is not charged its host time as GPU time (bench_round_robin, hide_host).

Example (GPU):
    >>> t = bench(lambda: torch.mm(a, b))          # doctest: +SKIP
    >>> print(t)                                   # doctest: +SKIP
    0.412 ms (median of 50; p20 0.410, p80 0.415)
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

FLUSH_FACTOR = 2                 # flush buffer = 2 x L2 size
FALLBACK_L2_BYTES = 64 << 20     # when torch does not report the L2 size


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms (median of {self.reps}; p20 {self.p20_ms:.3f}, p80 {self.p80_ms:.3f})"


_flush_buffers: dict[int, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _flush_buffers:
        l2 = getattr(torch.cuda.get_device_properties(idx), "L2_cache_size", 0) or FALLBACK_L2_BYTES
        _flush_buffers[idx] = torch.empty(FLUSH_FACTOR * l2, dtype=torch.uint8, device=idx)
    return _flush_buffers[idx]


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench(fn: Callable[[], object], *, warmup: int = 5, reps: int = 30, budget_ms: float = 2000.0,
          min_reps: int = 5, flush_l2: bool = True, device: torch.device | str | None = None) -> Timing:
    """Median time of `fn()` in milliseconds. `reps` is lowered so the timed part stays within
    roughly `budget_ms` (but never under `min_reps`), so slow baselines do not eat the run."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize(device)
    # One probe, to fit the repeat count into the budget.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    probe = max(start.elapsed_time(end), 1e-3)
    n = max(min_reps, min(reps, int(budget_ms / probe)))
    flush = _flush_buffer(device) if flush_l2 else None
    cycles = _spin_cycles(device, 1.5 * _warm_up(fn, 2, device) + 0.05)   # as in bench_round_robin
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        if flush is not None:
            flush.fill_(n & 0xFF)   # rewrite the whole buffer: evicts fn's inputs from L2
        torch.cuda._sleep(cycles)   # the events bracket GPU work, not fn's host time
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in events]
    return Timing(statistics.median(times), _quantile(times, 0.2), _quantile(times, 0.8), n)


def round_robin_order(n: int, reps: int, rotate: bool = True) -> list[list[int]]:
    """The callables' order in each of `reps` rounds: round r starts at callable r mod n (rotate),
    so over n rounds every callable runs once in every position; without rotate, 0..n-1 each time.

    >>> round_robin_order(3, 4)
    [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    >>> round_robin_order(2, 2, rotate=False)
    [[0, 1], [0, 1]]
    """
    return [[(r + i) % n if rotate else i for i in range(n)] for r in range(reps)]


def bench_round_robin(fns: list[Callable[[], object]], *, warmup: int = 5, reps: int = 30,
                      device: torch.device | str | None = None, hide_host: bool = True,
                      rotate: bool = True) -> list[Timing]:
    """Median time of each callable, timed round-robin (a, b, c, b, c, a, c, a, b, ...) with L2
    flushed before every call and each call waited for, so clock and temperature drift hit every
    callable alike: timed one after the other, the same kernel moved 5-15% between tuner trials on
    H100 and whichever system ran first after a pause measured up to 10% faster (fa3 NOTES v3).
    rotate (default, session 16): each round starts one callable later (round_robin_order), so no
    callable keeps one position: with a fixed order the same backward kernel read 2-9% faster in the
    first of seven positions than in the seventh (the GPU's power / clock state after the previous
    round's kernels; fa3_bwd_sm90 NOTES, session 16), as large as the effects the A/Bs look for.
    The experiments' side-by-side benchmarks and the tuner's finalists time through this.

    hide_host (default): a GPU spin (torch.cuda._sleep) longer than the callable's host enqueue time
    is queued before the start event, so the events bracket GPU work only. Without it, a callable
    whose Python / launch path is slower than the L2 flush leaves the GPU idle inside the event
    pair: FlexAttention-FLASH's 0.7 ms of host work per call at 8k read as 0.7 ms of attention
    (session 10 Llama profile: its kernel 1.005 ms with the GPU kept busy, 1.724 ms timed idle),
    flattering every system with a lighter call path, ours included. Host cost is measured on its
    own (experiments/bench_op.py host_us_per_call)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    host_ms = [_warm_up(fn, warmup, device) for fn in fns]
    flush = _flush_buffer(device)
    cycles = [_spin_cycles(device, 1.5 * h + 0.05) if hide_host else 0 for h in host_ms]
    times: list[list[float]] = [[] for _ in fns]
    for r, order in enumerate(round_robin_order(len(fns), reps, rotate)):
        for i in order:
            fn = fns[i]
            flush.fill_(r & 0xFF)
            if cycles[i]:
                torch.cuda._sleep(cycles[i])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return [Timing(statistics.median(t), _quantile(t, 0.2), _quantile(t, 0.8), reps) for t in times]


def _warm_up(fn: Callable[[], object], warmup: int, device: torch.device) -> float:
    """Run `fn` `warmup` times (at least once); returns the slowest host enqueue time (ms) of the
    warm calls after the first (the first compiles, autotunes, builds tables)."""
    slowest = 0.0
    for i in range(max(2, warmup)):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if i:
            slowest = max(slowest, (time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize(device)
    return slowest


_cycles_per_ms: dict[int, float] = {}


def _spin_cycles(device: torch.device, ms: float) -> int:
    """torch.cuda._sleep cycles that keep `device` busy for about `ms` (calibrated once per device:
    the spin counts SM clock cycles, and the clock is not the nominal one under boost)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _cycles_per_ms:
        probe = 2_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(probe)             # first launch: out of the measurement
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        _cycles_per_ms[idx] = probe / max(start.elapsed_time(end), 1e-3)
    return int(ms * _cycles_per_ms[idx])


def attention_flops(batch: int, heads_q: int, head_dim: int, len_q: int, len_k: int, causal: bool) -> float:
    """4 * B * Hq * D * (attended (q, kv) pairs): exact counting; causal with the queries aligned to
    the end of the keys (row i sees keys j <= i + Nk - Nq)."""
    if causal:
        lo = max(0, len_k - len_q)                        # the first row's position (rows before 0 see nothing)
        pairs = len_k * (len_k + 1) // 2 - lo * (lo + 1) // 2     # a row at position p sees p + 1 keys
    else:
        pairs = len_q * len_k
    return 4.0 * batch * heads_q * head_dim * pairs


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s of `flops` (attention_flops, or 4 * D * attended pairs) done in `ms` milliseconds;
    None where there is no time (not timed, failed). The one definition: reports, benchmarks and
    experiments all call it.

    >>> tflops(4.0 * 128 * 2**30, 1.0), tflops(1e12, None)
    (549.755813888, None)
    """
    if not ms or ms <= 0 or not math.isfinite(ms):
        return None
    return flops / (ms * 1e-3) / 1e12


@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    """(torch.compile(flex_attention), create_block_mask), the FlexAttention baseline every
    benchmark uses. Dynamo's recompile limits are raised first: past them (8 shapes by default)
    FlexAttention silently falls back to an unfused path 30-100x slower (ANCHORS.md)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 1 << 12))
    return torch.compile(flex_attention, dynamic=False), create_block_mask
