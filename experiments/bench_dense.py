"""Dense attention, side by side in one run: cubridge/fa2_sm80 vs SDPA (flash, cuDNN, bool mask),
FlexAttention and eager PyTorch. bf16, head dim 128, B * N = 16k tokens.

TFLOPS = 4 * B * Hq * D * (attended pairs) / time; causal pairs = N (N + 1) / 2. Every system is
timed by cubridge.runtime.timing.bench (CUDA events, warm-up, L2 flushed before each repeat,
median). Results: one JSON per run (gpu, date, versions, rows); a short table is printed last.

    python3 experiments/bench_dense.py                                   # everything
    python3 experiments/bench_dense.py --models llama2-7b --n 4096,8192 --systems cubridge/fa2_sm80,sdpa_flash
    python3 experiments/bench_dense.py --configs 128x64s2w4,256x64s2w8   # several tilings of ours
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import expkit  # noqa: E402,F401 - cubridge importable from a bare checkout
from expkit import source_at  # noqa: E402
from cubridge.runtime.fa2_sm80 import Config, Fa2Sm80, default_config  # noqa: E402
from cubridge.runtime.timing import attention_flops, bench, compiled_flex_attention, tflops  # noqa: E402

MODELS = {"llama2-7b": (32, 32), "qwen2.5-72b": (64, 8), "llama3.1-405b": (128, 8)}
LENGTHS = [1024, 2048, 4096, 8192, 16384]
SYSTEMS = ["cubridge/fa2_sm80", "sdpa_flash", "sdpa_cudnn", "sdpa_mask", "flex", "eager"]
VARIANTS = {"causal": True, "full": False}
HEAD_DIM = 128
TOKENS = 16384
MEMORY_FRACTION = 0.6          # skip a system whose estimated peak exceeds this share of free memory
EAGER_BYTES_PER_SCORE = 12     # bf16 scores + fp32 scores + fp32 probabilities + bf16 probabilities
CHECK_TOLERANCE = 3e-2         # ours vs SDPA flash, bf16 outputs of magnitude ~1


def versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version()}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    for key, cmd, pat in (("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], r"(\S+)"),
                          ("nvcc", ["nvcc", "--version"], r"release [\d.]+, (V[\d.]+)")):
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            m = re.search(pat, text)
            out[key] = m.group(1) if m else None
        except (OSError, subprocess.TimeoutExpired):
            out[key] = None
    return out


class Systems:
    """Builds the callable of each system for one (q, k, v, causal)."""

    def __init__(self, configs: list[Config], sources: dict[str, str] | None = None):
        """One Fa2Sm80 per config (and per extra kernel source, to compare versions side by side)."""
        self.ours = {str(c): Fa2Sm80(c) for c in configs}
        for label, path in (sources or {}).items():
            self.ours.update({f"{label}:{c}": Fa2Sm80(c, source_path=source_at(path)) for c in configs})
        self._flex = None

    def make(self, system: str, q, k, v, causal: bool):
        """-> list of (label, fn, note); label carries the config for ours."""
        group = q.shape[1] // k.shape[1]
        if system == "cubridge/fa2_sm80":
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            return [(name, (lambda f=f: f(q, k, v, causal=causal, out=out, lse=lse)), "")
                    for name, f in self.ours.items()]
        if system in ("sdpa_flash", "sdpa_cudnn"):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            backend = SDPBackend.FLASH_ATTENTION if system == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
            return [self._sdpa(lambda kk, vv, gqa: _with(sdpa_kernel(backend), lambda: F.scaled_dot_product_attention(
                q, kk, vv, is_causal=causal, enable_gqa=gqa)), k, v, group)]
        if system == "sdpa_mask":
            n_q, n_k = q.shape[2], k.shape[2]
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
            if causal:
                mask = mask.tril()
            from torch.nn.attention import SDPBackend, sdpa_kernel
            # SDPA picks among its fused backends that take an arbitrary mask (cuDNN, memory-efficient);
            # the math path is excluded so a GQA call cannot silently land on quadratic memory.
            fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
            return [self._sdpa(lambda kk, vv, gqa: _with(sdpa_kernel(fused),
                                                         lambda: F.scaled_dot_product_attention(
                q, kk, vv, attn_mask=mask, enable_gqa=gqa)), k, v, group)]
        if system == "flex":
            if self._flex is None:
                self._flex = compiled_flex_attention()
            flex, create_block_mask = self._flex
            n_q, n_k = q.shape[2], k.shape[2]
            block_mask = (create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n_q, n_k, device=q.device)
                          if causal else None)
            return [("flex", lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=group > 1), "")]
        if system == "eager":
            return [("eager", lambda: eager_attention(q, k, v, causal), "fp32 softmax, as users write it")]
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")

    @staticmethod
    def _sdpa(call, k, v, group):
        """Native GQA where the backend takes it, else K/V expanded to Hq heads (outside the timing)."""
        if group == 1:
            return ("", lambda: call(k, v, False), "")
        try:
            call(k, v, True)
            torch.cuda.synchronize()
            return ("", lambda: call(k, v, True), "enable_gqa")
        except RuntimeError:   # this backend has no native GQA
            torch.cuda.empty_cache()
            ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return ("", lambda: call(ke, ve, False), "kv expanded to Hq")


def _with(ctx, fn):
    with ctx:
        return fn()


def eager_attention(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def peak_bytes(system: str, b: int, hq: int, n: int) -> int:
    """What a system materialises beyond q/k/v/o (0 = nothing quadratic)."""
    if system == "eager":
        return EAGER_BYTES_PER_SCORE * b * hq * n * n
    if system == "sdpa_mask":
        return n * n   # the bool mask; the memory-efficient kernel streams it
    return 0


def run(args, save=None) -> dict:
    head_dim = args.head_dim
    configs = [Config.parse(c) for c in args.configs.split(",")] if args.configs else [default_config(head_dim)]
    sources = dict(x.split("=", 1) for x in args.sources.split(",")) if args.sources else {}
    systems = Systems(configs, sources)
    rows = []
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                  versions=versions(),
                  protocol=(f"cubridge.runtime.timing.bench: CUDA events, warm-up {args.warmup}, median of up to "
                            f"{args.reps} repeats within {args.budget_ms} ms, L2 flushed before each repeat"),
                  rows=rows)
    for model in args.models:
        hq, hkv = MODELS[model]
        for n in args.n:
            b = max(1, args.tokens // n)
            gen = torch.Generator(device="cuda").manual_seed(n)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for shape in ((b, hq, n, head_dim), (b, hkv, n, head_dim), (b, hkv, n, head_dim)))
            for variant in args.variants:
                causal = VARIANTS[variant]
                flops = attention_flops(b, hq, head_dim, n, n, causal)
                base = dict(variant=variant, model=model, N=n, B=b, Hq=hq, Hkv=hkv, D=head_dim, dtype="bf16")
                check = check_ours(systems, q, k, v, causal) if "cubridge/fa2_sm80" in args.systems else None
                for system in args.systems:
                    rows += time_system(systems, system, q, k, v, causal, flops, base, args, check)
                torch.cuda.empty_cache()
                if save is not None:
                    save(result)   # after every shape: a run cut short still leaves its rows
            del q, k, v
    return result


def check_ours(systems, q, k, v, causal) -> float:
    """max |ours - SDPA| per config (catches a fast wrong answer; not the verification rule)."""
    ref = F.scaled_dot_product_attention(q, *(t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v)),
                                         is_causal=causal)
    errs = [(f(q, k, v, causal=causal)[0].float() - ref.float()).abs().max().item() for f in systems.ours.values()]
    return max(errs)


def time_system(systems, system, q, k, v, causal, flops, base, args, check) -> list[dict]:
    b, hq, n = base["B"], base["Hq"], base["N"]
    need = peak_bytes(system, b, hq, n)
    free, _ = torch.cuda.mem_get_info()
    label = f"{system:18s} {base['model']:14s} {base['variant']:6s} N={n:5d}"
    if need > MEMORY_FRACTION * free:
        note = f"skipped: needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
        print(f"{label}  {note}", flush=True)
        return [dict(system=system, **base, ms=None, tflops=None, note=note)]
    try:
        t0 = time.time()
        made = systems.make(system, q, k, v, causal)
        out = []
        for name, fn, note in made:
            t = bench(fn, warmup=args.warmup, reps=args.reps, budget_ms=args.budget_ms)
            row = dict(system=system, **base, ms=round(t.median_ms, 4), tflops=round(tflops(flops, t.median_ms), 1),
                       note=note)
            if system == "cubridge/fa2_sm80":
                row.update(config=name, max_abs_diff_vs_sdpa=check)
                if check is not None and check > CHECK_TOLERANCE:
                    row["note"] = f"WRONG: max |ours - sdpa| = {check:.3g}"
            out.append(row)
            print(f"{label} {name:12s} {t.median_ms:9.3f} ms {row['tflops']:6.1f} TFLOPS  "
                  f"({time.time() - t0:.0f} s) {row['note']}", flush=True)
        return out
    except Exception as err:   # a backend refusing a shape, OOM, a compile failure: a row, not a crash
        msg = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        print(f"{label}  failed: {msg}", flush=True)
        torch.cuda.empty_cache()
        return [dict(system=system, **base, ms=None, tflops=None, note=f"failed: {msg}")]


def print_table(rows: list[dict]) -> None:
    """TFLOPS per shape: best config of ours (and which), then each baseline."""
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    keys = sorted({(r["variant"], r["model"], r["N"]) for r in rows},
                  key=lambda x: (x[0], list(MODELS).index(x[1]), x[2]))
    dims = sorted({r["D"] for r in rows if "D" in r})
    print(f"\nTFLOPS (bf16, D={'/'.join(map(str, dims))}, B*N=16k; ours = best config measured)")
    print(f"{'variant':7s} {'model':14s} {'N':>6s} " + " ".join(f"{s.split('/')[-1]:>10s}" for s in systems)
          + "  ours_cfg")
    for key in keys:
        cells, cfg = [], ""
        for s in systems:
            rs = [r for r in rows if (r["variant"], r["model"], r["N"]) == key and r["system"] == s and r["tflops"]]
            best = max(rs, key=lambda r: r["tflops"], default=None)
            cells.append(f"{best['tflops']:10.1f}" if best else f"{'-':>10s}")
            if best and s == "cubridge/fa2_sm80":
                cfg = best["config"]
        print(f"{key[0]:7s} {key[1]:14s} {key[2]:6d} " + " ".join(cells) + f"  {cfg}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), type=lambda s: s.split(","))
    p.add_argument("--n", default=",".join(map(str, LENGTHS)), type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--variants", default=",".join(VARIANTS), type=lambda s: s.split(","))
    p.add_argument("--systems", default=",".join(SYSTEMS), type=lambda s: s.split(","))
    p.add_argument("--configs", default="", help="tilings of ours, e.g. 128x64s2w4,256x64s2w8 (default: the default)")
    p.add_argument("--sources", default="", help="extra kernel versions of ours: label=path or label=COMMIT:path,... (same configs)")
    p.add_argument("--head-dim", default=HEAD_DIM, type=int, choices=(64, 128))
    p.add_argument("--tokens", default=TOKENS, type=int, help="B * N")
    p.add_argument("--warmup", default=3, type=int)
    p.add_argument("--reps", default=30, type=int)
    p.add_argument("--budget-ms", default=1000.0, type=float, help="timed milliseconds per measurement, roughly")
    p.add_argument("--table", default="", help="only print the table of an earlier result JSON")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="directory for the JSON")
    args = p.parse_args(argv)
    for name, allowed, got in (("models", MODELS, args.models), ("systems", SYSTEMS, args.systems),
                               ("variants", VARIANTS, args.variants)):
        bad = [x for x in got if x not in allowed]
        if bad:
            p.error(f"unknown {name} {bad}; choose from {list(allowed)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table:
        print_table(json.loads(Path(args.table).read_text())["rows"])
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_").lower()
    path = out_dir / f"dense_{gpu}_{datetime.datetime.now():%Y%m%d_%H%M%S}.json"
    result = run(args, save=lambda r: path.write_text(json.dumps(r, indent=1)))
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")
    print_table(result["rows"])


if __name__ == "__main__":
    main()
