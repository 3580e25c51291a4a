"""The corpus of real mods (tests/corpus/) on an H100: each spec at its published parameters,
transferred by the rules proposer and lowered onto fa3_sm90 at its default variant config,
first verified on the GPU under the verification rule (B=1, Hq=4, Hkv=2, N=8192, D=128, so the
published windows of up to 4096 keys show: float64 golden, poisoned output, inputs unchanged,
bitwise rerun), then timed at 8k beside FlexAttention (Triton,
torch.compile) and, where it runs, FlexAttention's FLASH backend, round-robin.

    python experiments/bench_corpus.py --prep                       # GPU: compile everything, in parallel
    python experiments/bench_corpus.py --out $OUT/corpus.json [--n 8192] [--specs ag_causal ...]
    python experiments/bench_corpus.py --cpu-check --out /tmp/corpus_cpu.json   # no GPU: what can fail early
    python experiments/bench_corpus.py --out $OUT/ab.json --specs padded_causal --ab-knobs class_head0   # an A/B

An A/B (`--ab-knobs KNOB ...`: experiments/patches/knobs/ applied to each lowered source; `--ab-env NAME=VALUE
...`: environment switches set while the second kernel is lowered and configured, e.g. CUBRIDGE_RANGE_WIDE=1)
adds "cubridge_ab", verified under the rule like the default, to the same round-robin: rows gain cubridge_ab_ms,
ab_vs_default (default ms / A/B ms: > 1 the A/B is faster) and speedup_ab_vs_<peer>.

Why three modes. Session 9 timed 14 of the 33 specs: its job named those 14 (`--specs`) to fit
300 s, at ~10 s a spec, most of it FlexAttention's torch.compile (Triton, and the FLASH backend's
CuTe DSL) inside the timed job. `--prep` does those compiles in parallel worker processes (a job
that need not run alone) and leaves them in the on-disk caches (cubridge's kernels, Inductor's FX
graph cache, Triton's), so the timed job is left with cache hits; `--deadline-s` stops it starting
a spec it cannot finish. `--cpu-check` runs the part of every spec that needs no GPU (transfer,
lowering, the interpreter's verification, nvcc, the pair count, the FlexAttention block-mask
inputs) so a device call cannot fail on a spec.

TFLOPS = 4 * D * (attended pairs) / time, pairs counted exactly from the spec's mask. The JSON is
rewritten after each spec, so a run cut short still reports what it measured.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from expkit import Ours, call_with_env, lowered_patched, versions  # noqa: E402
from expkit.flexcall import flash_available, flex_fn  # noqa: E402

from cubridge import rule  # noqa: E402
from cubridge.lower.fa3_sm90 import wide_tile  # noqa: E402
from cubridge.runtime.fa3_sm90 import build_cubin, default_config  # noqa: E402
from cubridge.runtime.timing import bench_round_robin, tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402

CORPUS = ROOT / "tests" / "corpus"
NAMES = sorted(p.stem for p in CORPUS.glob("[a-z]*.py"))
D = 128
HEADS = (32, 8)          # Hq, Hkv (a Llama-3-8B-like GQA layer)
TOKENS = 16384
CHECK = (1, 4, 2, 8192)  # B, Hq, Hkv, N of the GPU verification: the timed length, 4096-key windows show


def spec_path(name: str) -> str:
    return str(CORPUS / f"{name}.py")


def timed_shape(n: int) -> tuple[int, int, int]:
    """(B, Hq, Hkv) of the timed shape at length n: 16k tokens."""
    return max(1, TOKENS // n), *HEADS


def verify_on_gpu(ours: Ours, name: str) -> dict:
    """The verification rule at the timed length (GQA 2), where the published windows show."""
    spec = load_spec(spec_path(name))
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, N = CHECK
    q, k, v = (torch.randn(B, h, N, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    before = [t.clone() for t in (q, k, v)]
    out = torch.full_like(q, float("nan"))
    run = ours.fn(spec_path(name), q, k, v, out=out)
    run()
    torch.cuda.synchronize()
    unwritten = bool(torch.isnan(out).any())
    golden = spec.run_reference(q.double(), k.double(), v.double())
    verdict = rule.compare(out, golden, spec.run_reference(q, k, v))
    first = out.clone()
    run()
    torch.cuda.synchronize()
    ok = verdict.passed and not unwritten and all(torch.equal(a, b) for a, b in zip(before, (q, k, v))) \
        and torch.equal(first, out)
    return {"passed": bool(ok), "verdict": str(verdict), "unwritten": unwritten}


def peer_fns(row: dict, hooks, q, k, v, no_flash: str | None) -> list[tuple[str, object]]:
    """[(label, call)] of the FlexAttention systems that run this spec; why not in row."""
    if not hooks.flex_expressible:
        row["flex_skipped"] = f"normalisation {hooks.normalization.kind}: no softmax form for FlexAttention"
        return []
    fns = []
    for label, backend in (("flex_triton", None), ("flex_flash", "FLASH")):
        if backend and no_flash:
            row[f"{label}_skipped"] = no_flash
            continue
        t0 = time.time()
        try:
            fns.append((label, flex_fn(hooks, q, k, v, backend)))
        except Exception as e:      # FLASH refuses some mods (e.g. an int64 store); record why
            row[f"{label}_skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
        row[f"{label}_compile_s"] = round(time.time() - t0, 1)
    return fns


class AB:
    """The second kernel of an A/B: Ours with the knobs applied to each lowered source, lowered and configured
    with the environment switches `env` set."""

    def __init__(self, knobs=(), env=None):
        self.knobs, self.env = tuple(f"knobs/{k}" for k in knobs), dict(env or {})
        self.ours = Ours(transform=(lambda s: lowered_patched(s, *self.knobs)) if self.knobs else None)

    def fn(self, name, q, k, v, out=None):
        return call_with_env(self.env, lambda: self.ours.fn(name, q, k, v, out=out))

    def config(self, name, n):
        return call_with_env(self.env, lambda: default_config(D, False, True, n, variant=True,
                                                              wide=wide_tile(self.ours.lowered(name)[1].ir)))


def bench_spec(ours: Ours, name: str, n: int, reps: int, no_flash: str | None, ab: AB | None = None) -> dict:
    spec = load_spec(spec_path(name))
    b, hq, hkv = timed_shape(n)
    hooks = spec.hooks_for(n, n, hq, hkv, "cuda", B=b)
    t0 = time.time()
    pairs = count_attended(hooks, b, hq, n, n, device="cuda")
    row = {"spec": name, "N": n, "B": b, "Hq": hq, "Hkv": hkv, "D": D, "dtype": "bf16", "pairs": pairs,
           "count_s": round(time.time() - t0, 2), "flex_expressible": hooks.flex_expressible}
    q = torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cfg = default_config(D, False, True, n, variant=True, wide=wide_tile(ours.lowered(spec_path(name))[1].ir))
    row["config"] = {"block_m": cfg.block_m, "block_n": cfg.block_n}
    systems = [("cubridge", ours.fn(spec_path(name), q, k, v))]
    if ab is not None:
        cab = ab.config(spec_path(name), n)
        row["ab_config"] = {"block_m": cab.block_m, "block_n": cab.block_n}
        systems.append(("cubridge_ab", ab.fn(spec_path(name), q, k, v)))
    systems += peer_fns(row, hooks, q, k, v, no_flash)
    t0 = time.time()
    times = bench_round_robin([fn for _, fn in systems], reps=reps)
    row["time_s"] = round(time.time() - t0, 1)
    for (label, _), t in zip(systems, times):
        row[f"{label}_ms"] = round(t.median_ms, 4)
        row[f"{label}_tflops"] = round(tflops(4.0 * D * pairs, t.median_ms), 1)
    peers = [label for label, _ in systems if not label.startswith("cubridge")]
    for label in peers:
        row[f"speedup_vs_{label}"] = round(row[f"{label}_ms"] / row["cubridge_ms"], 3)
    if ab is not None:
        row["ab_vs_default"] = round(row["cubridge_ms"] / row["cubridge_ab_ms"], 4)
        for label in peers:
            row[f"speedup_ab_vs_{label}"] = round(row[f"{label}_ms"] / row["cubridge_ab_ms"], 3)
    return row


def prebuild(ours: Ours, names, workers: int = 12) -> list[dict]:
    """Transfer, lower and compile every spec's kernel up front, in parallel (nvcc runs outside the
    GIL; at the config the product runs at 8k: 128x176 where wide_tile, else 128x128). Returns the
    specs that failed to transfer, lower or build, with why (reported, not timed)."""
    from concurrent.futures import ThreadPoolExecutor
    sources, configs, failed = {}, {}, []
    for name in names:
        try:
            _, kern, sources[name] = ours.lowered(spec_path(name))
            configs[name] = default_config(D, False, True, 8192, variant=True, wide=wide_tile(kern.ir))
        except Exception as e:       # a transfer or lowering refusal: the main loop reports it again
            failed.append({"spec": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})

    def build(name):
        try:
            build_cubin(configs[name], source=sources[name])
        except Exception as e:       # noqa: BLE001 - an nvcc failure is reported per spec
            failed.append({"spec": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(build, sources))
    return failed


# ------------------------------------------------------------------ prep (GPU, parallel, untimed)
def prep_worker(names, n: int) -> None:
    """One worker process: our kernels built, each spec's FlexAttention calls compiled and run once
    at the timed shape (Inductor's and Triton's disk caches keep them for the timed job)."""
    ours = Ours()
    no_flash = flash_available()
    for name in names:
        t0 = time.time()
        try:
            spec = load_spec(spec_path(name))
            b, hq, hkv = timed_shape(n)
            hooks = spec.hooks_for(n, n, hq, hkv, "cuda", B=b)
            q = torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, hkv, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ours.fn(spec_path(name), q, k, v)()
            row = {}
            peer_fns(row, hooks, q, k, v, no_flash)
            skipped = {k2: v2[:60] for k2, v2 in row.items() if k2.endswith("skipped")}
            print(f"prep {name:<28} {time.time() - t0:5.1f} s {skipped or ''}", flush=True)
        except Exception as e:       # noqa: BLE001 - the timed job meets and reports it again
            print(f"prep {name:<28} error {type(e).__name__}: {str(e)[:200]}", flush=True)
            if context_lost():
                print(f"prep: CUDA context lost; not prepared: {names[names.index(name) + 1:]}", flush=True)
                return
        torch.cuda.empty_cache()


def prep(names, n: int, workers: int) -> int:
    """Build our kernels (threads), then compile FlexAttention in `workers` processes."""
    t0 = time.time()
    failed = prebuild(Ours(), names)
    print(f"built our kernels in {time.time() - t0:.0f} s; failed: {failed}", flush=True)
    groups = [names[i::workers] for i in range(workers)]
    procs = [subprocess.Popen([sys.executable, __file__, "--prep-worker", "--n", str(n), "--specs", *g])
             for g in groups if g]
    rc = max(p.wait() for p in procs)
    print(f"prep done in {time.time() - t0:.0f} s (rc {rc})", flush=True)
    return rc


# ------------------------------------------------------------------ timed run
def context_lost() -> bool:
    """True when the process's CUDA context is gone (a device-side assert): no later spec can run."""
    try:
        torch.cuda.synchronize()
        return False
    except Exception:   # noqa: BLE001 - torch.AcceleratorError / RuntimeError, by version
        return True


def run(args) -> int:
    """0, or 3 when a spec lost the CUDA context: rerun with --resume to go on after it."""
    torch.manual_seed(0)
    ours = Ours()
    ab = AB(args.ab_knobs, dict(e.split("=", 1) for e in args.ab_env)) if args.ab_knobs or args.ab_env else None
    no_flash = flash_available()
    result = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "heads": HEADS, "D": D,
              "ab": {"knobs": list(args.ab_knobs), "env": list(args.ab_env)} if ab else None,
              "protocol": "round-robin CUDA events, L2 flushed, median (cubridge.runtime.timing)",
              "flash": no_flash or "available", "rows": [], "failed": [], "not_reached": []}
    if args.resume and Path(args.out).is_file():
        # A rerun after a lost context: the specs done (or failed) keep their rows, in one JSON.
        old = json.loads(Path(args.out).read_text())
        result.update(rows=old["rows"], failed=old["failed"], processes=old.get("processes", 1) + 1)
        done = {r["spec"] for r in old["rows"] + old["failed"]}
        args.specs = [name for name in args.specs if name not in done]
    t0 = time.time()
    refused = prebuild(ours, args.specs)
    if ab is not None:
        refused += call_with_env(ab.env, prebuild, ab.ours, args.specs)
    print(f"prebuilt {len(args.specs) - len(refused)} specs' kernels in {time.time() - t0:.0f} s; refused: "
          f"{[r['spec'] for r in refused]}; FLASH: {no_flash or 'available'}", flush=True)
    print(f"{'spec':<28} {'verify':>6} {'ours ms':>9} {'triton ms':>10} {'x triton':>9} {'flash ms':>9} "
          f"{'x flash':>8} {'s':>5}")
    for name in args.specs:
        if args.deadline_s and time.time() - t0 > args.deadline_s:
            result["not_reached"].append(name)
            continue
        ts = time.time()
        try:
            check = verify_on_gpu(ours, name)
            check_ab = call_with_env(ab.env, verify_on_gpu, ab.ours, name) if ab is not None else {"passed": True}
            both = check["passed"] and check_ab["passed"]
            row = bench_spec(ours, name, args.n, args.reps, no_flash, ab) if both else {"spec": name}
            row["verify"] = check
            if ab is not None:
                row["verify_ab"] = check_ab
            row["spec_s"] = round(time.time() - ts, 1)
            result["rows"].append(row)
            print(f"{name:<28} {'pass' if both else 'FAIL':>6} {row.get('cubridge_ms', '-'):>9} "
                  f"{row.get('flex_triton_ms', '-'):>10} {row.get('speedup_vs_flex_triton', '-'):>9} "
                  f"{row.get('flex_flash_ms', '-'):>9} {row.get('speedup_vs_flex_flash', '-'):>8} "
                  f"{row['spec_s']:>5}", flush=True)
            if ab is not None and "cubridge_ab_ms" in row:
                print(f"{'  A/B ' + str(row['ab_config']):<35} {row['cubridge_ab_ms']:>9} x default "
                      f"{row['ab_vs_default']}  x triton {row.get('speedup_ab_vs_flex_triton', '-')}  x flash "
                      f"{row.get('speedup_ab_vs_flex_flash', '-')}", flush=True)
        except Exception as e:
            result["failed"].append({"spec": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            print(f"{name:<28} error: {type(e).__name__}: {str(e)[:150]}", flush=True)
            traceback.print_exc(limit=4)
            if context_lost():
                result["failed"][-1]["error"] += " (the CUDA context was lost: later specs need a new process)"
                Path(args.out).write_text(json.dumps(result, indent=1))
                print("CUDA context lost: stopping; rerun with --resume for the rest", flush=True)
                return 3
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))
    summary(result)
    return 0


def summary(result: dict) -> None:
    rows = result["rows"]
    asked = len(rows) + len(result["failed"]) + len(result["not_reached"])
    print(f"verified on the GPU {sum(r['verify']['passed'] for r in rows)}/{asked}; errors "
          f"{[f['spec'] for f in result['failed']]}; not reached {result['not_reached']}")
    for peer, bar in (("flex_triton", 1.3), ("flex_flash", 1.0)):
        ok = [r for r in rows if f"speedup_vs_{peer}" in r]
        if ok:
            below = [f"{r['spec']} {r[f'speedup_vs_{peer}']}" for r in ok if r[f"speedup_vs_{peer}"] < bar]
            print(f"vs {peer}: {len(ok)} timed, >= {bar}x: {len(ok) - len(below)}; below: {below}")
        ab = [r for r in rows if f"speedup_ab_vs_{peer}" in r]
        if ab:
            below = [f"{r['spec']} {r[f'speedup_ab_vs_{peer}']}" for r in ab if r[f"speedup_ab_vs_{peer}"] < bar]
            print(f"A/B vs {peer}: {len(ab)} timed, >= {bar}x: {len(ab) - len(below)}; below: {below}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--specs", nargs="+", default=NAMES)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--deadline-s", type=float, default=0, help="start no spec after this many seconds")
    ap.add_argument("--resume", action="store_true", help="keep the rows of --out, run the specs not in it")
    ap.add_argument("--prep", action="store_true", help="compile everything, time nothing")
    ap.add_argument("--workers", type=int, default=6, help="--prep's FlexAttention compile processes")
    ap.add_argument("--prep-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-check", action="store_true", help="no GPU: transfer, verify, lower, nvcc, pairs")
    ap.add_argument("--ab-knobs", nargs="+", default=[], metavar="KNOB",
                    help="a second kernel with experiments/patches/knobs/KNOB.patch applied, in the same round-robin")
    ap.add_argument("--ab-env", nargs="+", default=[], metavar="NAME=VALUE",
                    help="environment switches for the second kernel's lowering and config (with or without --ab-knobs)")
    args = ap.parse_args()
    if args.cpu_check:
        from expkit.corpus import cpu_check
        sys.exit(cpu_check(args.specs, args.n, args.out))
    if args.prep_worker:
        return prep_worker(args.specs, args.n)
    if args.prep:
        sys.exit(prep(args.specs, args.n, args.workers))
    if not args.out:
        ap.error("--out is required for a timed run")
    sys.exit(run(args))


if __name__ == "__main__":
    main()
