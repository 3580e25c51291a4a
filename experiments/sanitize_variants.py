"""Small cases of both reference kernels and a sample of lowered variants, to run under
compute-sanitizer (racecheck, synccheck, memcheck): issue 20 item 2, the GPU half of race detection.

Each case is also checked under the verification rule against its spec's float64 reference, so a
kernel the tool slows or perturbs into a wrong answer fails here too (exit 1). Shapes are tiny:
racecheck multiplies the run time by ~100.

    compute-sanitizer --tool racecheck --error-exitcode 9 python3 experiments/sanitize_variants.py
    python3 experiments/sanitize_variants.py --only fa2_sm80      # one kernel's cases
"""
from __future__ import annotations

import argparse
import sys

import expkit  # noqa: F401 - makes the checkout's cubridge importable (experiments/expkit/)
import torch

from cubridge import rule  # noqa: E402
from cubridge.cuir.parser import parse_file  # noqa: E402
from cubridge.lower import lower  # noqa: E402
from cubridge.paths import ref_kernel_dir  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.rules import transfer  # noqa: E402

# (kernel, spec or None for the reference kernel itself, causal for the reference, B, Hq, Hkv, Nq=Nk, D)
CASES = [
    ("fa2_sm80", None, True, 1, 4, 1, 200, 128), ("fa2_sm80", None, False, 1, 2, 2, 150, 64),
    ("fa2_sm80", "global_sliding_window", False, 1, 2, 1, 333, 64), ("fa2_sm80", "relative_pos", False, 1, 2, 2, 190, 128),
    ("fa3_sm90", None, True, 1, 4, 1, 300, 128), ("fa3_sm90", None, False, 1, 2, 2, 200, 64),
    ("fa3_sm90", "prefixlm", False, 1, 4, 2, 300, 128), ("fa3_sm90", "composite", False, 1, 2, 1, 260, 128),
]


def run_case(kernel, spec_name, causal, B, Hq, Hkv, N, D):
    g = torch.Generator(device="cuda").manual_seed(N * 7 + D)
    q, k, v = (torch.randn(B, h, N, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    out = torch.full_like(q, float("nan"))
    spec = load_spec(spec_name or ("causal" if causal else "full"))
    launch, cfg_causal = None, causal
    if spec_name is not None:
        cand = transfer(parse_file(ref_kernel_dir(kernel) / "kernel.cuir"), spec)
        kern = lower(cand.program, kernel)
        cfg_causal = False
    if kernel == "fa3_sm90":
        from cubridge.runtime.fa3_sm90 import default_config, fa3_forward
        cfg = default_config(D, cfg_causal, True, N, variant=spec_name is not None)
        bm, bn = cfg.block_m, cfg.block_n
    else:
        from cubridge.runtime.fa2_sm80 import Fa2Sm80, default_config
        cfg = default_config(D)
        bm, bn = cfg.block_m, cfg.block_n
    if spec_name is not None:
        inputs = cand.bind(Nq=N, Nk=N, Hq=Hq, Hkv=Hkv, B=B, params={"BLOCK_M": bm, "BLOCK_N": bn}, device=q.device)
        launch = kern.args(inputs, q.device)
    if kernel == "fa3_sm90":
        fa3_forward(q, k, v, causal=cfg_causal, config=cfg, out=out, variant=launch)
    else:
        Fa2Sm80(cfg)(q, k, v, causal=cfg_causal, out=out, variant=launch)
    torch.cuda.synchronize()
    if torch.isnan(out).any():
        return f"{int(torch.isnan(out).sum())} output elements never written"
    verdict = rule.compare(out, spec.run_reference(q.double(), k.double(), v.double()), spec.run_reference(q, k, v))
    return None if verdict.passed else verdict.reason


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="fa2_sm80 or fa3_sm90")
    a = ap.parse_args(argv)
    cap = torch.cuda.get_device_capability()
    failed = 0
    for case in CASES:
        kernel = case[0]
        if (a.only and kernel != a.only) or (kernel == "fa3_sm90" and cap != (9, 0)):
            continue
        why = run_case(*case)
        failed += why is not None
        print(f"sanitize {kernel} {case[1] or ('causal' if case[2] else 'full')} B={case[3]} Hq={case[4]} "
              f"Hkv={case[5]} N={case[6]} D={case[7]}: {why or 'pass'}", flush=True)
    print("sanitize cases", "ok" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
