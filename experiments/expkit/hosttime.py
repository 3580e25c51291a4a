"""Host microseconds per call of callables that enqueue GPU work, measured so that one bad window
cannot decide a number: every callable is timed in several rounds (windows of CALLS calls, each
call timed alone with Python's GC off, the GPU held busy so no call waits for it), the rounds
interleave the callables in different orders (as given, reversed, then shuffled), and each
callable's number is the median of its round medians, reported with the rounds and their spread.

Why: session 12's bench_op (one window of 200 calls per row, rows in a fixed order) read 15.7-16.6
us for some rows and 22-26.7 us for others at random, the same code at the same shapes: a state of
the host (clock, core, cache) that lasts a window but not the next decided each row. Each window
also records the CPU it ran on, that CPU's clock where the host exposes it, and a calibration loop
(fixed pure-Python work, no torch) timed just before it, so a slow window can be told apart as a
slow host (calibration slow too) or a slow call path (calibration normal).

    from expkit.hosttime import rounds
    table = rounds({"op": lambda: attn(q, k, v), "bare": lambda: launch(q, k, v, out, lse)})
    table["op"]["median_us"], table["op"]["spread_us"], table["op"]["rounds_us"]
"""
from __future__ import annotations

import ctypes
import gc
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

CALLS = 200
ROUNDS = 5
SLEEP_CYCLES = 120_000_000   # ~60 ms of GPU time at 1.98 GHz: outlasts the spin and a window's enqueues
SPIN_S = 0.02                # busy host before a window (what a model's host loop looks like: never idle)
CALIB_ITERS = 2000

try:
    _LIBC = ctypes.CDLL(None)
    _SCHED_GETCPU = _LIBC.sched_getcpu
except (OSError, AttributeError):   # not glibc: the CPU is not recorded
    _SCHED_GETCPU = None


def cpu_now() -> int | None:
    """The CPU this thread runs on now (glibc's sched_getcpu), or None."""
    return int(_SCHED_GETCPU()) if _SCHED_GETCPU is not None else None


def cpu_mhz(cpu: int | None) -> float | None:
    """That CPU's current clock from sysfs (cpufreq), where the host exposes it."""
    if cpu is None:
        return None
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq") as f:
            return int(f.read()) / 1000.0
    except (OSError, ValueError):
        return None


def calib_us(iters: int = CALIB_ITERS) -> float:
    """Microseconds of a fixed pure-Python loop (dict lookups and tuple builds, like the op's key):
    the host's speed at this moment, independent of torch and the GPU."""
    d = {(i, i + 1): i for i in range(64)}
    t0 = time.perf_counter()
    acc = 0
    for i in range(iters):
        acc += d.get(((i & 63), (i & 63) + 1), 0)
    return (time.perf_counter() - t0) * 1e6


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def window(fn, calls: int = CALLS, spin_s: float = SPIN_S) -> list[float]:
    """Per-call host microseconds of `calls` calls of fn, the GPU busy throughout (a long
    torch.cuda._sleep first: the calls only enqueue), GC off, after `spin_s` of busy host."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    times = []
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        spin(spin_s)
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        gc.enable()
    torch.cuda.synchronize()
    return times


def orders(names: list, n_rounds: int, seed: int = 0) -> list[list]:
    """The callables' order in each round: as given, reversed, then seeded shuffles."""
    rng = random.Random(seed)
    out = []
    for r in range(n_rounds):
        order = list(names) if r % 2 == 0 else list(reversed(names))
        if r >= 2:
            rng.shuffle(order)
        out.append(order)
    return out


def rounds(fns: dict, n_rounds: int = ROUNDS, calls: int = CALLS, seed: int = 0, pin: bool = False) -> dict:
    """{name: summary} for each callable of `fns`: median_us (the median of its round medians),
    rounds_us, spread_us (max - min of the round medians), mean_us, p10_us, p90_us (of every
    call: a slow mode inside each window shows as a wide p10-p90, one across windows as a wide
    spread), and per round the CPU, its clock and the calibration loop's time. A window that
    raises is recorded in the summary's "error" (median_us None if no window ran). pin=True holds
    the thread on the CPU it starts on for the whole measurement (restored after; "pinned" says
    whether the host allowed it)."""
    names = list(fns)
    per = {name: {"rounds_us": [], "calls": [], "cpu": [], "mhz": [], "calib_us": [], "error": None}
           for name in names}
    affinity, pinned = (os.sched_getaffinity(0) if pin else None), None
    try:
        if pin:
            pinned = _pin(affinity)
        for order in orders(names, n_rounds, seed):
            for name in order:
                _round(per[name], fns[name], calls)
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, affinity)
    return {name: {**summarize(rec), "pinned": pinned} for name, rec in per.items()}


def _pin(affinity: set) -> int | None:
    """Hold this thread on the CPU it runs on; that CPU, or None where the host refuses."""
    cpu = cpu_now()
    cpu = cpu if cpu is not None else min(affinity)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        return None
    return cpu


def _round(rec: dict, fn, calls: int) -> None:
    """One window of fn into rec, with the CPU, its clock and the calibration loop just before."""
    if rec["error"]:
        return
    cpu = cpu_now()
    rec["cpu"].append(cpu)
    rec["mhz"].append(cpu_mhz(cpu))
    rec["calib_us"].append(round(calib_us(), 1))
    try:
        times = window(fn, calls)
    except Exception as e:   # noqa: BLE001 - recorded; the other callables' rounds still run
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return
    rec["rounds_us"].append(round(statistics.median(times), 2))
    rec["calls"].extend(times)


def summarize(rec: dict) -> dict:
    r, calls = rec["rounds_us"], sorted(rec["calls"])
    extra = {"cpu": rec["cpu"], "mhz": rec["mhz"], "calib_us": rec["calib_us"], "error": rec.get("error")}
    if not r:
        return {"median_us": None, "spread_us": None, "rounds_us": [], **extra}
    return {"median_us": round(statistics.median(r), 2), "spread_us": round(max(r) - min(r), 2),
            "min_round_us": min(r), "max_round_us": max(r), "rounds_us": r,
            "mean_us": round(statistics.fmean(calls), 2), "p10_us": round(calls[len(calls) // 10], 2),
            "p90_us": round(calls[len(calls) * 9 // 10], 2), **extra}


def host_info() -> dict:
    """The host the numbers come from: CPU model and count, the affinity, governor, clocksource."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0))}
    try:
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in
                                 Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    for name, path in (("governor", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
                       ("clocksource", "/sys/devices/system/clocksource/clocksource0/current_clocksource")):
        try:      # a clocksource other than tsc makes every perf_counter read (two per timed call) slow
            info[name] = Path(path).read_text().strip()
        except OSError:
            info[name] = None
    return info
