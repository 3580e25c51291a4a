"""The corpus of real mods (tests/corpus/) on an H100: each spec at its published parameters,
transferred by the rules proposer and lowered onto fa3_sm90 at its default variant config,
first verified on the GPU under the verification rule (B=1, Hq=4, N=2048, D=128: float64 golden,
poisoned output, inputs unchanged, bitwise rerun), then timed at 8k beside FlexAttention (Triton,
torch.compile) and, where it runs, FlexAttention's FLASH backend, round-robin.

    python experiments/bench_corpus.py --out $OUT/corpus.json [--n 8192] [--specs ag_causal ...]

TFLOPS = 4 * D * (attended pairs) / time, pairs counted exactly from the spec's mask. The JSON is
rewritten after each spec, so a run cut short still reports what it measured.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from expkit import Ours, versions  # noqa: E402

from cubridge import rule  # noqa: E402
from cubridge.runtime.fa3_sm90 import default_config  # noqa: E402
from cubridge.runtime.timing import bench_round_robin, compiled_flex_attention, tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402

CORPUS = ROOT / "tests" / "corpus"
D = 128
HEADS = (32, 8)          # Hq, Hkv (a Llama-3-8B-like GQA layer)
TOKENS = 16384


def spec_path(name: str) -> str:
    return str(CORPUS / f"{name}.py")


def verify_on_gpu(ours: Ours, name: str) -> dict:
    """The verification rule at one ragged-free shape where 1024-token windows show."""
    spec = load_spec(spec_path(name))
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, N = 1, 4, 2, 2048
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


def flex_fn(hooks, q, k, v, n, backend=None):
    fx, cbm = compiled_flex_attention()
    bm = cbm(hooks.mask_mod, None, None, n, n, device="cuda") if hooks.mask_mod else None
    opts = {"BACKEND": backend} if backend else None
    gqa = q.shape[1] != k.shape[1]
    fx(q, k, v, score_mod=hooks.score_mod, block_mask=bm, enable_gqa=gqa, kernel_options=opts)   # compile now
    return lambda: fx(q, k, v, score_mod=hooks.score_mod, block_mask=bm, enable_gqa=gqa, kernel_options=opts)


def bench_spec(ours: Ours, name: str, n: int, reps: int) -> dict:
    spec = load_spec(spec_path(name))
    hq, hkv = HEADS
    b = max(1, TOKENS // n)
    hooks = spec.hooks_for(n, n, hq, hkv, "cuda")
    t0 = time.time()
    pairs = count_attended(hooks, b, hq, n, n, device="cuda")
    row = {"spec": name, "N": n, "B": b, "Hq": hq, "Hkv": hkv, "D": D, "dtype": "bf16", "pairs": pairs,
           "count_s": round(time.time() - t0, 2), "flex_expressible": hooks.flex_expressible}
    q = torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fns, labels = [ours.fn(spec_path(name), q, k, v)], ["cubridge"]
    cfg = default_config(D, False, True, n, variant=True)
    row["config"] = {"block_m": cfg.block_m, "block_n": cfg.block_n}
    if hooks.flex_expressible:
        for label, backend in (("flex_triton", None), ("flex_flash", "FLASH")):
            try:
                fns.append(flex_fn(hooks, q, k, v, n, backend))
                labels.append(label)
            except Exception as e:          # FLASH needs flash-attn's CuTe DSL build; record why not
                row[f"{label}_skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
    times = bench_round_robin(fns, reps=reps)
    for label, t in zip(labels, times):
        row[f"{label}_ms"] = round(t.median_ms, 4)
        row[f"{label}_tflops"] = round(tflops(4.0 * D * pairs, t.median_ms), 1)
    for label in labels[1:]:
        row[f"speedup_vs_{label}"] = round(row[f"{label}_ms"] / row["cubridge_ms"], 3)
    return row


def prebuild(ours: Ours, names, n: int) -> list[dict]:
    """Transfer, lower and compile every spec's kernel at both configs it runs (the GPU check's
    N = 2048 and the timed N) up front, in parallel: nvcc runs outside the GIL, and one spec at a
    time (30-60 s each for 33 specs) would take the whole device call. Returns the specs that
    failed to transfer, lower or build, with why (they are reported, not timed)."""
    from concurrent.futures import ThreadPoolExecutor
    from cubridge.runtime.fa3_sm90 import build_cubin
    jobs, failed = [], []
    for name in names:
        try:
            source = ours.lowered(spec_path(name))[2]
        except Exception as e:       # a transfer or lowering refusal: the main loop reports it again
            failed.append({"spec": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        jobs += [(default_config(D, False, True, m, variant=True), source) for m in {2048, n}]
    with ThreadPoolExecutor(max_workers=12) as pool:
        list(pool.map(lambda job: build_cubin(job[0], source=job[1]), jobs))
    return failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--specs", nargs="+", default=sorted(p.stem for p in CORPUS.glob("[a-z]*.py")))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    ours = Ours()
    result = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "heads": HEADS, "D": D,
              "protocol": "round-robin CUDA events, L2 flushed, median (cubridge.runtime.timing)",
              "rows": [], "failed": []}
    t0 = time.time()
    refused = prebuild(ours, args.specs, args.n)
    print(f"prebuilt {len(args.specs) - len(refused)} specs' kernels in {time.time() - t0:.0f} s; refused before "
          f"building: {[r['spec'] for r in refused]}", flush=True)
    print(f"{'spec':<28} {'verify':>6} {'ours ms':>9} {'triton ms':>10} {'x triton':>9} {'flash ms':>9} {'x flash':>8}")
    for name in args.specs:
        try:
            check = verify_on_gpu(ours, name)
            row = bench_spec(ours, name, args.n, args.reps) if check["passed"] else {"spec": name}
            row["verify"] = check
            result["rows"].append(row)
            print(f"{name:<28} {'pass' if check['passed'] else 'FAIL':>6} {row.get('cubridge_ms', '-'):>9} "
                  f"{row.get('flex_triton_ms', '-'):>10} {row.get('speedup_vs_flex_triton', '-'):>9} "
                  f"{row.get('flex_flash_ms', '-'):>9} {row.get('speedup_vs_flex_flash', '-'):>8}", flush=True)
        except Exception as e:
            result["failed"].append({"spec": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            print(f"{name:<28} error: {type(e).__name__}: {str(e)[:150]}", flush=True)
            traceback.print_exc(limit=4)
        finally:
            torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=1))
    ok = [r for r in result["rows"] if "speedup_vs_flex_triton" in r]
    if ok:
        worst = min(ok, key=lambda r: r["speedup_vs_flex_triton"])
        print(f"verified {sum(r['verify']['passed'] for r in result['rows'])}/{len(args.specs)}; "
              f"vs FlexAttention Triton: min {worst['speedup_vs_flex_triton']}x ({worst['spec']}), "
              f">= 1.3x: {sum(r['speedup_vs_flex_triton'] >= 1.3 for r in ok)}/{len(ok)}")


if __name__ == "__main__":
    main()
