"""A/B of CUBRIDGE_LPT_SECTIONS (a lowered variant's host tile order in L2 sections of heads instead of head by
head; cubridge/runtime/lpt.py) on bench_d256.py's Gemma-2 local shape (D 256, softcap 50, window 4096, causal,
B 2, 16 q / 8 kv heads, 8k, bf16), which has no env A/B: ours at each --rows config with the switch off and on
(read when the launch is packed), FA4 (softcap + window) and FlexAttention FLASH, each checked at sampled rows
(expkit.peers.SampledCheck) before it is timed, all in one round-robin (cubridge.runtime.timing).

    python3 experiments/ab_lpt_sections.py --out $OUT/lpt_gemma2.json [--n 8192] [--reps 20] [--rows 128x64]
    python3 experiments/ab_lpt_sections.py --prep        # build our kernels only (a parallel job before the timed one)

Writes each system's ms / TFLOPS and, per row, ab_vs_default = default ms / sections ms (> 1: sections faster).
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
from expkit import call_with_env
from expkit.d256 import fa4, parse_row
from expkit.peers import SampledCheck, make_flex_flash

from cubridge.runtime.fa3_sm90 import Fa3Config, fa3_forward
from cubridge.runtime.lpt import SECTIONS_ENV
from cubridge.runtime.timing import bench_round_robin

D, WINDOW, SOFTCAP = 256, 4096, 50.0
GEMMA2 = Path(__file__).resolve().parents[1] / "tests" / "corpus" / "gemma2_local.py"


def ours(q, k, v, bm, bn, options, sections: str):
    """Gemma-2 local transferred and lowered onto fa3_sm90 (bench_d256's way), packed with SECTIONS_ENV=sections."""
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.paths import ref_kernel_dir
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), load_spec(str(GEMMA2)),
                    spec_params={"window": WINDOW, "softcap": SOFTCAP})
    kern = lower(cand.program, "fa3_sm90")
    b, hq, n, _ = q.shape
    inputs = cand.bind(Nq=n, Nk=n, Hq=hq, Hkv=k.shape[1], B=b, params={"BLOCK_M": bm, "BLOCK_N": bn}, device=q.device)
    launch = call_with_env({SECTIONS_ENV: sections}, kern.args, inputs, q.device)
    assert launch.lpt_sections == (sections == "1")
    cfg = Fa3Config(**{**dict(head_dim=D, block_m=bm, block_n=bn, stages=2, causal=False, bf16=True, persistent=True),
                       **options})
    out = torch.full_like(q, float("nan"))
    return lambda: fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=launch)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--prep", action="store_true", help="build and run our kernels once; time nothing")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", nargs="+", default=["128x64"], help="our configs (bench_d256 --rows); default: the "
                    "lowered variant's D 256 default, 128x64")
    a = ap.parse_args()
    if not (a.prep or a.out):
        ap.error("--out is required for a timed run")
    from cubridge.spec import load_spec
    b, hq, hkv, n = a.batch, 16, 8, a.n
    g = torch.Generator(device="cuda").manual_seed(256)
    q, k, v = (torch.randn(s, device="cuda", generator=g).to(torch.bfloat16) for s in ((b, hq, n, D), (b, hkv, n, D),
                                                                                      (b, hkv, n, D)))
    hooks = load_spec(str(GEMMA2)).hooks_for(n, n, hq, hkv, q.device, window=WINDOW, softcap=SOFTCAP)
    check = SampledCheck(q, k, v, hooks)
    w = min(WINDOW, n)
    flops = 4 * b * hq * D * (w * (w + 1) // 2 + (n - w) * w)
    makers = {}
    for row in a.rows:
        bm, bn, options = parse_row(row)
        for tag, on in (("", "0"), (" lpt_sections", "1")):
            makers[f"cubridge/fa3_sm90 {row}{tag}"] = lambda bm=bm, bn=bn, o=options, on=on: ours(q, k, v, bm, bn, o, on)
    if a.prep:
        for name, make in makers.items():
            make()()
        torch.cuda.synchronize()
        print(f"built {list(makers)}")
        return 0
    makers["fa4"] = lambda: fa4(q, k, v, softcap=SOFTCAP, window_size=(WINDOW - 1, 0))
    makers["flex_flash"] = lambda: make_flex_flash("gemma2", hooks, q, k, v)[0]
    res = {"device": torch.cuda.get_device_name(), "shape": {"B": b, "Hq": hq, "Hkv": hkv, "N": n, "D": D},
           "flops": flops, "systems": {}}
    fns, names = [], []
    for name, make in makers.items():
        entry = res["systems"][name] = {}
        try:
            fn = make()
            out = fn()
            torch.cuda.synchronize()
            verdict = check.verdict(out)
            entry["check"] = str(verdict)
            if verdict.passed:
                fns.append(fn)
                names.append(name)
            else:
                entry["skipped"] = "fails the verification rule at sampled rows: not timed"
        except Exception as e:  # noqa: BLE001 (a peer failing is recorded, the rest still run)
            entry["skipped"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc(limit=2)
    for name, t in zip(names, bench_round_robin(fns, warmup=5, reps=a.reps)):
        res["systems"][name].update(ms=round(t.median_ms, 4), p20_ms=round(t.p20_ms, 4), p80_ms=round(t.p80_ms, 4),
                                    tflops=round(flops / (t.median_ms * 1e-3) / 1e12, 1))
    s = res["systems"]
    res["ab_vs_default"] = {row: round(s[f"cubridge/fa3_sm90 {row}"]["ms"] / s[f"cubridge/fa3_sm90 {row} lpt_sections"]["ms"],
                                       4) for row in a.rows
                            if "ms" in s[f"cubridge/fa3_sm90 {row}"] and "ms" in s[f"cubridge/fa3_sm90 {row} lpt_sections"]}
    Path(a.out).write_text(json.dumps(res, indent=1))
    for name, e in s.items():
        print(f"{name:36} {e.get('ms', '-'):>9} ms {e.get('tflops', '-'):>7} TFLOPS {e.get('skipped', '')[:60]}")
    print("ab_vs_default (default ms / sections ms):", res["ab_vs_default"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
