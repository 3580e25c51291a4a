"""Why the Llama client's prefixlm forward at 8k is no faster than FlexAttention-FLASH although
its attention kernel is (issue 15; session 9: model 0.97-0.99x Flex-FLASH, layer-0 attention alone
1.31x). The same random-init Llama (experiments/expkit/llama.py) per system, side by side:

  cubridge            the prefixlm run (default config) through cubridge.integrations.transformers,
                      called with attention_mask=spec_mask(B, N) (built once, as Flex's BlockMask)
  cubridge_nomask     the same without attention_mask: transformers then runs its packed-sequence
                      check every forward (a .all() host sync; session 10 mid call: ~1 ms)
  cubridge@LABEL      ours at another tile config (--alt-configs)
  flex_flash / _triton  transformers' flex_attention with a BlockMask built once (FLASH where it runs)
  sdpa_bool_mask      SDPA with a boolean [B, 1, N, N] prefix mask
  none                attention that costs nothing (returns q's memory as the output): the rest of
                      the model alone (with a spec_mask, so no sync either)

Per system: the forward timed round-robin with the GPU idle at the start event (as llama_client:
host time before the first kernel counts) and with the GPU held busy (expkit.gpu_ms: only GPU time
counts); torch.profiler over --profile-calls forwards: CUDA time by kernel (attention kernels are
those launched inside the attention function, marked by record_function), the GPU's busy time
against the window, its idle gaps and the CPU op before each, host syncs; layer 0's attention
alone, idle and busy (an isolated call's host path shows up as GPU time when idle); the SM clock
while each system runs back to back (pynvml, where present). JSON + a table last.

    python3 experiments/llama_profile.py --out $OUT/llama_profile.json [--alt-configs 128x176s2p]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import expkit
from expkit.gputrace import analyse, load_events, summarise
from expkit.llama import (first_flex, B, D, HKV, HQ, VOCAB, attention_call, call_kwargs, capture_attention, env_opt_ins,
                          make_model, parse_config, versions)

from cubridge.runtime.timing import bench_round_robin, compiled_flex_attention

MARK = "attention"
DEVICE = "cuda"          # the CPU test dry-runs the flow with "cpu", a tiny model and the stubbed op
FLEX = {"auto": ("flex_flash", "flex_triton"), "flash": ("flex_flash",), "triton": ("flex_triton",)}   # as llama_client


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile-calls", type=int, default=3)
    ap.add_argument("--alt-configs", nargs="*", default=[], metavar="BMxBNsSp")
    ap.add_argument("--flex-backend", default="auto", choices=list(FLEX))
    args = ap.parse_args(argv)
    for label in args.alt_configs:
        try:
            parse_config(label)
        except ValueError as e:
            ap.error(f"--alt-configs: {e}")
    return args


def build_runs(alt_configs: list, root: Path) -> tuple[dict, dict]:
    """({"prefixlm": name, "prefixlm@LABEL": name}, {key: run directory}): the prefixlm runs at the
    default config and at each alt config (cubridge.op.build, in parallel: nvcc runs outside the
    GIL), registered as transformers attention implementations."""
    from concurrent.futures import ThreadPoolExecutor

    from cubridge.integrations.transformers import register
    from cubridge.op import build
    jobs = {"prefixlm": {}}
    for label in alt_configs:
        point = parse_config(label)
        jobs[f"prefixlm@{label}"] = {"configs": {1024: point, 8192: point}}
    with ThreadPoolExecutor(max_workers=4) as pool:
        dirs = dict(zip(jobs, pool.map(lambda kv: build("prefixlm", root / kv[0].replace("@", "_"), heads_q=HQ,
                                                        heads_kv=HKV, head_dim=D, **kv[1]), jobs.items())))
    names = {key: register(d, name=f"cubridge_{key.replace('@', '_')}") for key, d in dirs.items()}
    return names, {key: str(d) for key, d in dirs.items()}


def marked(impl: str) -> str:
    """Register a copy of attention implementation `impl` whose calls run inside
    record_function(MARK) (with impl's mask function), under a new name; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    fn, name = ALL_ATTENTION_FUNCTIONS[impl], f"prof_{impl}"

    def wrapped(*a, **kw):
        with torch.profiler.record_function(MARK):
            return fn(*a, **kw)
    AttentionInterface.register(name, wrapped)
    if impl in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[impl])
    return name


def register_controls() -> str:
    """'none': free attention, with ours' mask function; returns its implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from cubridge.integrations.transformers import no_mask
    AttentionInterface.register("expkit_none", lambda module, q, k, v, mask, **kw: (q.transpose(1, 2), None))
    AttentionMaskInterface.register("expkit_none", no_mask)
    return "expkit_none"


class Systems:
    """system name -> (attn implementation, call keywords), models built once per system."""

    def __init__(self, registered: dict, n: int):
        self.registered, self.n, self.impls, self.models, self.masks = registered, n, {}, {}, {}

    def model(self, impl: str):
        if impl not in self.models:
            self.models[impl] = make_model(DEVICE)       # seed 0: the same weights for every system
            self.models[impl].set_attn_implementation(impl)
        return self.models[impl]

    def add(self, system: str, impl: str, kw_system: str) -> None:
        self.impls[system] = (marked(impl), call_kwargs(kw_system, "prefixlm", self.n, self.masks, DEVICE))

    def fn(self, system: str, ids):
        impl, kw = self.impls[system]
        model = self.model(impl)

        def run():
            with torch.no_grad():
                return model(ids, use_cache=False, **kw).logits
        return run


def profile_calls(fn, calls: int, tmp: Path) -> dict:
    """summarise() of `calls` profiled calls of fn, each its own trace, the GPU idle before each."""
    from torch.profiler import ProfilerActivity, profile
    out = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    for i in range(calls):
        sync()
        with profile(activities=activities) as prof:
            with torch.profiler.record_function(f"call#{i}"):
                fn()
            sync()
        path = tmp / f"trace_{i}.json"
        prof.export_chrome_trace(str(path))
        out.append(analyse(load_events(path), MARK))
    return summarise(out)


def clocks(fn, calls: int = 6) -> dict:
    """SM clock (MHz) and power (W) sampled every 5 ms while fn runs `calls` times back to back."""
    if DEVICE != "cuda":
        return {"error": "no CUDA device"}
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception as e:   # noqa: BLE001 - a record, not the measurement
        return {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(h) / 1000))
            time.sleep(0.005)
    t = threading.Thread(target=sample)
    t.start()
    try:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    finally:
        stop.set()
        t.join()
    if not samples:
        return {"error": "no samples"}
    return {"sm_mhz_median": statistics.median(s[0] for s in samples), "sm_mhz_min": min(s[0] for s in samples),
            "power_w_median": statistics.median(s[1] for s in samples), "samples": len(samples)}


def layer_alone(systems: Systems, ids, flex: str | None, reps: int) -> dict:
    """Layer 0's attention alone on the model's own q / k / v: GPU idle at the start (as
    llama_client's layer_attention) and held busy (gpu_ms), per system."""
    n, masks = systems.n, systems.masks
    module, q, k, v, extra = capture_attention(systems.model("sdpa"), ids)
    fns = {"cubridge": attention_call(systems.registered["prefixlm"], module, q, k, v, None, extra),
           "sdpa_bool_mask": attention_call("sdpa", module, q, k, v,
                                            call_kwargs("sdpa_bool_mask", "prefixlm", n, masks, DEVICE)["attention_mask"],
                                            extra)}
    if flex:
        kw = call_kwargs(flex, "prefixlm", n, masks, DEVICE)
        fns[flex] = attention_call("flex_attention", module, q, k, v, kw.pop("attention_mask"), extra, **kw)
    idle = idle_round_robin(list(fns.values()), reps=reps)
    busy = gpu_ms(list(fns.values()), reps=reps)
    return {s: {"idle_ms": round(i.median_ms, 4), "busy_ms": round(b, 4)} for s, i, b in zip(fns, idle, busy)}


def main(argv=None) -> int:
    args = parse(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("error: llama_profile.py: no CUDA device", file=sys.stderr)
        return 2
    if DEVICE == "cuda":
        compiled_flex_attention()
        expkit.HOLD_CYCLES = 8_000_000      # ~4 ms: longer than any system's host path to the first kernel
    tmp = Path(tempfile.mkdtemp(prefix="llama_profile_"))
    ids = torch.randint(0, VOCAB, (B, args.n), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(7))
    systems, flex, result = setup(args, tmp, ids)
    names = list(systems.impls)
    fns = [systems.fn(s, ids) for s in names]
    ref = fns[names.index("sdpa_bool_mask")]().float()
    result["logits_max_diff_vs_sdpa_mask"] = {s: float((f().float() - ref).abs().max()) for s, f in zip(names, fns)
                                              if s != "none"}
    del ref
    idle = idle_round_robin(fns, reps=args.reps)
    busy = gpu_ms(fns, reps=args.reps)
    result["systems"] = {}
    for s, fn, i, b in zip(names, fns, idle, busy):
        d = tmp / s.replace("@", "_")
        d.mkdir()
        result["systems"][s] = {"forward_ms_idle": round(i.median_ms, 3), "forward_ms_busy": round(b, 3),
                                "profile": profile_calls(fn, args.profile_calls, d), "clock": clocks(fn)}
        write(args.out, result)
    result["layer0_attention"] = layer_alone(systems, ids, flex, args.reps)
    write(args.out, result)
    print_table(result)
    return 0


def setup(args, tmp: Path, ids) -> tuple[Systems, str | None, dict]:
    """The runs built and registered, every system added (Flex: the first backend that runs), the
    result's header."""
    t0 = time.time()
    registered, runs = build_runs(args.alt_configs, tmp)
    print(f"built {sorted(registered.values())} in {time.time() - t0:.0f} s", flush=True)
    systems = Systems(registered, args.n)
    none = register_controls()
    systems.add("cubridge", registered["prefixlm"], "cubridge")
    systems.add("cubridge_nomask", registered["prefixlm"], "cubridge_nomask")
    for label in args.alt_configs:
        systems.add(f"cubridge@{label}", registered[f"prefixlm@{label}"], "cubridge")
    result = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
              "date": datetime.now(timezone.utc).isoformat(),
              "versions": versions(), "env": env_opt_ins(), "N": args.n, "runs": runs, "system_errors": {}}
    flex = first_flex(FLEX[args.flex_backend], lambda s: (systems.add(s, "flex_attention", s), systems.fn(s, ids)())[1],
                      result["system_errors"])
    for s in FLEX[args.flex_backend]:
        if s != flex:
            systems.impls.pop(s, None)
    systems.add("sdpa_bool_mask", "sdpa", "sdpa_bool_mask")
    systems.add("none", none, "cubridge")
    return systems, flex, result


def idle_round_robin(fns, reps: int):
    """bench_round_robin with the GPU idle at each start event (host time before the first kernel
    counts): hide_host=False where this checkout's timing has that option (session 10)."""
    import inspect
    kw = {"hide_host": False} if "hide_host" in inspect.signature(bench_round_robin).parameters else {}
    return bench_round_robin(fns, warmup=2, reps=reps, **kw)


def gpu_ms(fns, reps: int) -> list[float]:
    """expkit.gpu_ms (the GPU held busy before the start event); the CPU test replaces it."""
    return expkit.gpu_ms(fns, reps=reps)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def print_table(result: dict) -> None:
    print(f"\n{'system':<22} {'fwd idle':>9} {'fwd busy':>9} {'kern/call':>9} {'attn':>8} {'gemm':>8} {'other':>8} "
          f"{'GPU idle':>8} {'cpu':>8} {'MHz':>6}  syncs  (ms per forward)")
    for s, r in result["systems"].items():
        p, k, c = r["profile"], r["profile"]["kernel_us"], r["clock"]
        cpu = f"{p['cpu_us'] / 1e3:8.2f}" if p.get("cpu_us") else f"{'-':>8}"
        print(f"{s:<22} {r['forward_ms_idle']:9.3f} {r['forward_ms_busy']:9.3f} {p['kernels_per_call']:9.0f} "
              f"{k['marked'] / 1e3:8.3f} {k['gemm'] / 1e3:8.3f} {k['other'] / 1e3:8.3f} {p['idle_us'] / 1e3:8.3f} "
              f"{cpu} {c.get('sm_mhz_median', '-'):>6}  {dict((n, round(v, 1)) for n, v in p['syncs_per_call'].items())}")
    print("\ntop kernels (us per forward):")
    for s, r in result["systems"].items():
        tops = ", ".join(f"{t['name'][:48]} {t['us_per_call']:.0f}x{t['per_call']:.0f}"
                         for t in r["profile"]["top_kernels"][:5])
        print(f"  {s:<20} {tops}")
    print("\nlayer 0 attention alone (ms): " + ", ".join(f"{s} idle {v['idle_ms']:.3f} busy {v['busy_ms']:.3f}"
                                                     for s, v in result.get("layer0_attention", {}).items()))


if __name__ == "__main__":
    sys.exit(main())
