"""bench_corpus's CPU-checkable path (`--cpu-check`): for every corpus spec at its published
parameters, everything the GPU run does that needs no GPU, so a device call cannot fail on a spec:
the rules transfer and lowering onto fa3_sm90, the interpreter's verification of that same program
(small shape: the published windows do not show there, the CI test covers structure), nvcc on the
lowered source at the timed config, the spec's float64 reference at the GPU check's shape, the
attended-pair count and FlexAttention's block-mask inputs at the timed shape."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cubridge.cuir.parser import parse_file
from cubridge.runtime.fa3_sm90 import build_cubin, default_config
from cubridge.runtime.kernels import reference_kernel
from cubridge.spec import load_spec
from cubridge.transfer.pairs import count_attended
from cubridge.transfer.trace import trace_mask
from cubridge.verify import Case, verify_transfer

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "corpus"
D = 128
HEADS = (32, 8)
TOKENS = 16384
CHECK = (1, 4, 2, 2048)   # bench_corpus checks at N = 8192 on the GPU; the float64 reference on 2 CPU cores: 2048


def _check_one(ref, name: str, n: int) -> dict:
    """Every GPU-free step for one spec; the lowered source under "source" (built afterwards)."""
    from cubridge.lower import lower
    from cubridge.transfer.rules import transfer
    path = str(CORPUS / f"{name}.py")
    spec = load_spec(path)
    row, t0 = {"spec": name}, time.time()
    cand = transfer(ref, spec)
    row["source"] = lower(cand.program, "fa3_sm90").source
    row["transfer_lower_s"] = round(time.time() - t0, 2)
    t0 = time.time()
    report = verify_transfer(ref, spec, cases=[Case(2, 4, 2, 256, 256, 64, 0)])
    row["interpreter"] = "pass" if report.passed else report.table()
    row["interpreter_s"] = round(time.time() - t0, 2)
    B, Hq, Hkv, N = CHECK
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    t0 = time.time()
    golden = spec.run_reference(q, k, v)
    row["golden_finite"] = bool(torch.isfinite(golden).all())
    row["reference_s"] = round(time.time() - t0, 2)
    b, hq, hkv = max(1, TOKENS // n), *HEADS
    hooks = spec.hooks_for(n, n, hq, hkv, "cpu", B=b)
    t0 = time.time()
    row["pairs"] = count_attended(hooks, b, hq, n, n)
    row["count_s"] = round(time.time() - t0, 2)
    row["flex_expressible"] = hooks.flex_expressible
    row["mask_reads"] = sorted(trace_mask(hooks.mask_mod).uses & {"b", "h"}) if hooks.mask_mod else None
    return row


def cpu_check(names, n: int, out: str | None) -> int:
    """0 when every spec passes every step, else 1; prints one line a spec and writes `out`."""
    ref = parse_file(reference_kernel("fa3_sm90").cuir_path())
    rows = []
    for name in names:
        try:
            rows.append(_check_one(ref, name, n))
        except Exception as e:       # noqa: BLE001 - reported per spec
            rows.append({"spec": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    cfg = default_config(D, False, True, n, variant=True)

    def build(row):
        if "source" in row:
            t0 = time.time()
            try:
                build_cubin(cfg, source=row.pop("source"))
                row["nvcc"] = "ok"
            except Exception as e:   # noqa: BLE001
                row["nvcc"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["nvcc_s"] = round(time.time() - t0, 1)
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(build, rows))
    bad = [r["spec"] for r in rows if "error" in r or r.get("interpreter") != "pass" or r.get("nvcc") != "ok"
           or not r.get("golden_finite")]
    for r in rows:
        print(f"{r['spec']:<28} " + " ".join(f"{k}={v}" for k, v in r.items() if k != "spec"), flush=True)
    print(f"cpu check: {len(rows) - len(bad)}/{len(rows)} specs pass every step; failing: {bad}")
    if out:
        Path(out).write_text(json.dumps({"n": n, "rows": rows, "failing": bad}, indent=1))
    return 1 if bad else 0
