"""The tuner's GPU check (cubridge.search.measure.run_checks over gpu_cases.check_cases) on lowered
variants of both reference kernels, at the cases it now runs per tile config: the KV ring past two
turns (MQA), Nq < Nk end-aligned, GQA, the spec's structure length, the targets' query lengths; O
and LSE under the verification rule (issue 20, Deliver 1). Then negative controls built from the
real kernel's call, each of which the check must reject:

  lse_plus_5      the kernel's LSE + 5 (O right)
  top_aligned     the keys cut to the first Nq (right at Nq == Nk only)
  window_ignored  the causal variant checked against a 4096 sliding window (right below N = 4096)

    python experiments/gpu_check_cases.py --out results.json      # GPU
    python experiments/gpu_check_cases.py --dry                   # CPU: transfer, lower, cases only
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cubridge.cuir.parser import parse_file
from cubridge.lower import lower
from cubridge.runtime.kernels import reference_kernel
from cubridge.search.gpu_cases import check_cases, structure_length
from cubridge.search.measure import run_checks
from cubridge.search.messages import TargetShape
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

ROOT = Path(__file__).resolve().parents[1]
D, HQ, HKV = 128, 16, 16           # MHA targets: the cases add MQA and GQA (groups of two)
SHAPES = [TargetShape("N=8192,B=2", 2, 8192), TargetShape("Nq=128,Nk=4096", 1, 4096, query_len=128)]
MISTRAL = str(ROOT / "tests/corpus/mistral_sliding_window.py")
# (kernel, spec, which of the kernel's measured best-known points)
# (gemma2_local: softcap score_mod, so the LSE of a score_mod, and a 4096 window: structure 8229)
RUNS = [("fa3_sm90", "causal", 0), ("fa3_sm90", "causal", 1), ("fa3_sm90", "document", 0),
        ("fa3_sm90", str(ROOT / "tests/corpus/gemma2_local.py"), 0),
        ("fa2_sm80", "causal", 0), ("fa2_sm80", "document", 0)]


def arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def point_of(kernel, index: int) -> dict:
    points = [p for p in kernel.space.best_known(D) if not kernel.space.problems(p, D, kernel.arch)]
    return points[min(index, len(points) - 1)]


def prepare_run(kname: str, sname: str, index: int) -> dict:
    """Transfer and lower (in the main thread: tracing is not thread-safe)."""
    kernel, spec = reference_kernel(kname), load_spec(sname)
    cand = transfer(parse_file(kernel.cuir_path()), spec)
    lowered = lower(cand.program, kname)
    point = point_of(kernel, index)
    return {"kernel": kname, "spec": spec.name, "point": kernel.space.label(point), "block_table": bool(cand.table),
            "k": kernel, "specobj": spec, "cand": cand, "lowered": lowered, "cuir": kernel.space.to_cuir(point),
            "pt": point}


def build(run: dict) -> dict:
    """nvcc of one lowered variant (threads: nvcc runs as a process)."""
    from cubridge.runtime.build import compile_cubin, default_compiler
    t0 = time.time()
    options = run["k"].compile_options(run["pt"], D, "bf16")
    run["cubin"] = compile_cubin(run["lowered"].source, arch=arch(), options=options, compiler=default_compiler()).cubin
    run["compile_s"] = round(time.time() - t0, 1)
    return run


def caller(run, wrap=None):
    """call_at(case) for run_checks: the launcher's call with the case's extra inputs bound."""
    prepare = run["k"].launcher(run["lowered"], run["cubin"], run["pt"])

    def call_at(c):
        extra = run["cand"].bind(Nq=c.Nq or c.Nk, Nk=c.Nk, Hq=c.Hq, Hkv=c.Hkv, B=c.B, params=run["cuir"], device="cuda")
        call = prepare(extra, "cuda")
        return call if wrap is None else wrap(call)
    return call_at


def check(run, spec=None, wrap=None, device="cuda") -> dict:
    spec = spec or run["specobj"]
    t0 = time.time()
    structure = structure_length(spec, {}, run["cuir"], HQ, HKV, device=device)
    cases = check_cases(HQ, HKV, run["cuir"], SHAPES, structure)
    row = {"structure_length": structure, "cases": [c.label for c in cases]}
    if device == "cpu":
        return row
    checks: list = []
    row["failed"] = run_checks(caller(run, wrap), spec, {}, cases, D, torch.bfloat16, checks)
    row.update(checks=checks, seconds=round(time.time() - t0, 1))
    return row


def lse_plus_5(call):
    def run(q, k, v, out, lse=None):
        out, lse = call(q, k, v, out, lse)
        lse += 5.0
        return out, lse
    return run


def top_aligned(call):
    def run(q, k, v, out, lse=None):
        n = q.shape[2]
        return call(q, k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), out, lse)
    return run


def _lengths(failed: str) -> tuple[int, int]:
    return tuple(int(failed.split(f" {x}=")[1].split()[0]) for x in ("Nq", "Nk"))


# (name, spec checked against (None: the run's own), call wrapper, what the failure must show)
CONTROLS = [("lse_plus_5", None, lse_plus_5, lambda f: "LSE: " in f),
            ("top_aligned", None, top_aligned, lambda f: _lengths(f)[0] < _lengths(f)[1]),
            ("window_ignored", MISTRAL, None, lambda f: _lengths(f)[1] > 4096)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--dry", action="store_true", help="CPU: transfer, lower and the case lists only")
    args = ap.parse_args()
    device = "cpu" if args.dry else "cuda"
    runs = [prepare_run(*r) for r in RUNS]
    if not args.dry:
        with ThreadPoolExecutor(len(runs)) as pool:    # nvcc runs in parallel; the checks do not
            runs = list(pool.map(build, runs))
    result = {"device": "cpu (dry)" if args.dry else torch.cuda.get_device_name(), "rows": [], "controls": []}
    for run in runs:
        row = {k: run[k] for k in ("kernel", "spec", "point", "block_table")} | {"compile_s": run.get("compile_s")}
        try:
            row.update(check(run, device=device))
        except Exception as e:          # noqa: BLE001 - recorded, the next run goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            traceback.print_exc(limit=3)
        result["rows"].append(row)
        if args.out:                     # rewritten after each row: a run cut by its timeout still reports
            Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"{row['kernel']:<9} {row['spec']:<24} {row['point']:<12} table={row['block_table']!s:<5} "
              f"structure={row.get('structure_length')} cases={len(row.get('cases', []))} "
              f"-> {row.get('error') or row.get('failed') or ('pass' if not args.dry else 'dry')}", flush=True)
    if not args.dry:
        base = runs[0]                   # fa3_sm90 causal
        for name, spec, wrap, expect in CONTROLS:
            try:
                row = check(base, load_spec(spec) if spec else None, wrap)
                row["rejected"] = bool(row["failed"]) and expect(row["failed"])
            except Exception as e:      # noqa: BLE001
                row = {"error": f"{type(e).__name__}: {str(e)[:500]}", "rejected": False}
            result["controls"].append({"control": name, **row})
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
            print(f"control {name:<16} rejected={row['rejected']} ({row.get('failed') or row.get('error')})",
                  flush=True)
    result["ok"] = (all(r.get("failed") is None and "error" not in r for r in result["rows"])
                    and all(c["rejected"] for c in result["controls"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"gpu_check_cases: {'OK' if result['ok'] else 'NOT OK'}")


if __name__ == "__main__":
    main()
